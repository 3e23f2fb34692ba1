"""`gpuhook simulate DIR`: build a simulated GPU host (see gpuhook.simulate.host)."""

import click

from gpuhook.simulate import SimulationError, host


def _parse_mig(values) -> dict:
    """--mig INDEX[=PROFILE,PROFILE...] options -> {index: [profiles]} (empty: the default layout)."""
    layouts = {}
    for value in values:
        index, _, profiles = value.partition("=")
        if not index.isdigit():
            raise SimulationError(f"--mig {value!r}: expected a GPU index, optionally =PROFILE,PROFILE "
                                  "(e.g. 0=3g.40gb,1g.10gb)")
        if int(index) in layouts:
            raise SimulationError(f"--mig names GPU {index} twice")
        layouts[int(index)] = [p for p in profiles.split(",") if p] if profiles else []
    return layouts


@click.command(help=(
    "Build a simulated NVIDIA GPU host under DIR: driver libraries (with a working simulated NVML), "
    "binaries and firmware, device nodes with NVIDIA's numbers, /proc driver files, DIR/nvml.json "
    "(the simulated GPUs' state: edit it to inject faults) and DIR/config.toml pointing gpuhook at "
    "them. Use it with GPUHOOK_CONFIG=DIR/config.toml or --config. Needs root."
))
@click.argument("directory", metavar="DIR")
@click.option("--gpus", default=2, show_default=True, help="Number of GPUs.")
@click.option("--driver-version", default=host.DEFAULT_DRIVER_VERSION, show_default=True, metavar="V",
              help="NVIDIA driver version the host reports (/proc/driver/nvidia/version, NVML, the versioned "
                   "library file names); the CUDA version follows its branch.")
@click.option("--cuda-version", metavar="X.Y",
              help="CUDA version the simulated driver supports [default: the driver branch's, e.g. 12.4 for 550].")
@click.option("--model", default=host.DEFAULT_MODEL, show_default=True, metavar="NAME",
              help="Model name of every GPU (NVML's device name and /proc/driver/nvidia/gpus/*/information); a "
                   "name only: the GPUs otherwise stay H100-like.")
@click.option("--brand", default=host.DEFAULT_BRAND, show_default=True,
              help="NVML brand of every GPU, as NVIDIA_REQUIRE_* spells it (tesla, nvidia, geforce, ...).")
@click.option("--mig", "mig", multiple=True, metavar="INDEX[=PROFILES]",
              help=f"Put GPU INDEX in MIG mode with these MIG devices (comma-separated profiles; default "
                   f"{','.join(host.DEFAULT_MIG_LAYOUT)}). Repeatable.")
@click.option("--nvml-latency-ms", default=0, show_default=True, type=int,
              help="Milliseconds every simulated NVML call takes.")
@click.option("--nvml-init-latency-ms", default=0, show_default=True, type=int,
              help="Milliseconds nvmlInit takes (NVML start-up without persistence mode).")
@click.option("--numa-nodes", default=1, show_default=True, type=int,
              help="NUMA nodes the GPUs are spread over, in bus order (sysfs numa_node; the device plugin's "
                   "topology).")
@click.option("--layout", type=click.Choice(host.LAYOUTS), default="distro", show_default=True,
              help="Where the driver's files lie in the driver root: distro (ld cache, /usr/bin), gke "
                   "(/usr/local/nvidia/{bin,lib64} with shell wrappers in /usr/bin, no ld cache entries) or "
                   "driver-container (NVIDIA's driver container root, with Ubuntu's ldconfig wrapper as the "
                   "configured ldconfig); docs/driver-layouts.md.")
@click.option("--nvswitches", default=0, show_default=True, type=int,
              help="NVSwitches: the nvidia-nvswitch driver's major and /dev/nvidia-nvswitchctl, "
                   "/dev/nvidia-nvswitch<N> (what NVIDIA_NVSWITCH=enabled injects).")
@click.option("--gdrcopy", is_flag=True,
              help="GDRCopy's gdrdrv module: its major and /dev/gdrdrv (what NVIDIA_GDRCOPY=enabled injects).")
def simulate(directory, gpus, driver_version, cuda_version, model, brand, mig, nvml_latency_ms, nvml_init_latency_ms,
             numa_nodes, layout, nvswitches, gdrcopy):
    built = host.build(directory, gpus=gpus, driver_version=driver_version, model=model, cuda_version=cuda_version,
                       brand=brand, mig=_parse_mig(mig), nvml_latency_ms=nvml_latency_ms,
                       nvml_init_latency_ms=nvml_init_latency_ms, numa_nodes=numa_nodes, layout=layout,
                       nvswitches=nvswitches, gdrcopy=gdrcopy)
    click.echo(f"simulated host with {len(built['gpus'])} GPU(s), driver {built['driver_version']} "
               f"(CUDA {built['cuda_version']}), {built['layout']} layout, in {built['directory']}")
    for gpu in built["gpus"]:
        click.echo(f"  GPU {gpu['index']}  {gpu['uuid']}  {gpu['bus_id']}  {gpu['model']}  brand {gpu['brand']}  "
                   f"NUMA node {gpu['numa_node']}")
        for device in gpu["mig_devices"]:
            click.echo(f"    MIG {gpu['index']}:{device['index']}  {device['uuid']}  {device['profile']}  "
                       f"GI {device['gpu_instance_id']} CI {device['compute_instance_id']}")
    click.echo(f"NVML state (edit to inject faults): {built['nvml_state']}")
    click.echo(f"use it with: GPUHOOK_CONFIG={built['config']} {_this_command()} list")


def _this_command() -> str:
    """How to run this gpuhook again from any directory: the console script next to this
    interpreter (.venv/bin/gpuhook after scripts/setup, /usr/bin/gpuhook from a package),
    else the interpreter with -m."""
    import os
    import shlex
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "gpuhook")
    if os.access(script, os.X_OK):
        return shlex.quote(script)
    return f"{shlex.quote(sys.executable)} -m gpuhook"
