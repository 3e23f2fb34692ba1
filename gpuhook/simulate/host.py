"""`gpuhook simulate DIR`: a complete fake NVIDIA GPU host under one directory.

The GPU is the only fake in gpuhook's tests and demo; everything around it is real:

    DIR/driver/   driver root: real ELF libraries per capability (built with the system C
                  compiler, NVIDIA's sonames and versioned file names), an ld cache made by
                  the host's ldconfig, static binaries (nvidia-smi, ...), GSP firmware, the
                  persistenced socket. libnvidia-ml is a working simulated NVML
                  (csrc/nvml_sim.c) and nvidia-smi can reset a simulated GPU. Where in it
                  the files lie follows `layout` (LAYOUTS; docs/driver-layouts.md).
    DIR/dev/      device nodes with NVIDIA's numbers (major 195; nvidia-uvm and nvidia-caps
                  on free majors; nvidia-caps/nvidia-capN for MIG hosts)
    DIR/proc/     devices, driver/nvidia/{version,params,registry}, one
                  driver/nvidia/gpus/<bus>/information per GPU, driver/nvidia-caps/mig-minors
                  and driver/nvidia/capabilities/ as the driver makes them on every host
                  (mig/config, mig/monitor, gpu<minor>/mig/), with the access files of the
                  MIG instances of MIG hosts
    DIR/nvml.json     the simulated NVML's state: GPUs, MIG devices, faults, latencies
                      (gpuhook.simulate.nvml edits it; docs/simulated-host.md)
    DIR/config.toml   points gpuhook at all of the above
    DIR/host.json     what was built (GPUs, UUIDs, majors, MIG devices), for tests and tools

Opening a simulated node in a container gives ENXIO when the device cgroup allows it (no
driver behind the number) and EPERM when it does not: the observable difference tests use.
"""

import json
import os
import shutil
import socket
import stat
import subprocess
import uuid as uuidlib

from gpuhook.driver import LIBRARIES, MULTIARCH
from gpuhook.discover.nvml import BRANDS
from gpuhook.simulate import SimulationError
from gpuhook.simulate import nvml as simnvml

NVIDIA_MAJOR = 195
DEFAULT_DRIVER_VERSION = "550.54.15"
DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
DEFAULT_BRAND = "nvidia"  # what NVML reports for an H100
# What the simulated GPUs report besides their model name (an H100 80GB SXM5).
COMPUTE_CAPABILITY = "9.0"
PCI_DEVICE_ID = 0x233010DE  # device 0x2330, vendor NVIDIA (0x10de)
PCI_SUBSYSTEM_ID = 0x16C110DE
MEMORY_TOTAL = 81559 * (1 << 20)
# What the driver keeps for itself: NVML's v2 memory call reports it as "reserved", v1 counts
# it as used (615 MiB on an idle H200 with driver 580, docs/health.md).
MEMORY_RESERVED = 615 * (1 << 20)
MARKER = "host.json"
CSRC = os.path.join(os.path.dirname(__file__), "csrc")
NVML_SOURCES = ("nvml_sim.c", "simstate.c", "simjson.c")
TOOL_SOURCES = ("tool.c", "simstate.c", "simjson.c")

# The CUDA version each driver branch supports (NVIDIA's CUDA release notes, table 3).
CUDA_BY_BRANCH = {
    470: "11.4", 510: "11.6", 515: "11.7", 520: "11.8", 525: "12.0", 530: "12.1", 535: "12.2",
    545: "12.3", 550: "12.4", 555: "12.5", 560: "12.6", 565: "12.7", 570: "12.8", 575: "12.9",
    580: "13.0",
}

# MIG (docs/runtime-facts.md §4): an H100 has 7 compute slices; a profile "<slices>g.<GiB>gb" takes some.
MIG_SLICES = 7
DEFAULT_MIG_LAYOUT = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
# /proc/driver/nvidia-caps/mig-minors as the driver writes it: config 1, monitor 2, then per
# GPU minor 15 GPU instance slots of 9 minors (the GI's access, then 8 compute instances).
MIG_CONFIG_MINOR = 1
MIG_MONITOR_MINOR = 2
MIG_GPU_INSTANCES = 15
MIG_COMPUTE_INSTANCES = 8
# The sys-minors table's one entry (nv-caps.c numbers its tables in order: nvlink's one entry,
# MIG's config and monitor, every GPU's 32 x 135 instance slots, then sys).
IMEX_MINOR = MIG_MONITOR_MINOR + 1 + 32 * MIG_GPU_INSTANCES * (1 + MIG_COMPUTE_INSTANCES)

# Sonames as NVIDIA ships them: "1"-style ABI versions, or the full driver version ("V").
SONAME_SUFFIX = {
    "libnvidia-ml": "1", "libnvidia-cfg": "1", "libnvidia-nscq": "2",
    "libcuda": "1", "libcudadebugger": "1", "libnvidia-opencl": "1", "libnvidia-ptxjitcompiler": "1",
    "libnvidia-nvvm": "4", "libnvidia-allocator": "1", "libnvidia-gpucomp": "V",
    "libnvidia-pkcs11": "V", "libnvidia-pkcs11-openssl3": "V",
    "libnvcuvid": "1", "libnvidia-encode": "1", "libnvidia-opticalflow": "1", "libvdpau_nvidia": "1",
    "libnvidia-eglcore": "V", "libnvidia-glcore": "V", "libnvidia-tls": "V", "libnvidia-glsi": "V",
    "libnvidia-fbc": "1", "libnvidia-rtcore": "V", "libnvoptix": "1", "libGLX_nvidia": "0",
    "libEGL_nvidia": "0", "libGLESv2_nvidia": "2", "libGLESv1_CM_nvidia": "1",
    "libnvidia-glvkspirv": "V", "libnvidia-egl-gbm": "1", "libnvidia-egl-wayland": "1",
    "libnvidia-vulkan-producer": "V", "libnvidia-ngx": "1",
}
TOOLS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
         "nvidia-cuda-mps-server")
# Where the driver's files lie in the driver root (docs/driver-layouts.md):
# - distro: a distribution's packages or NVIDIA's installer: libraries in the multiarch dir,
#   listed in the ld cache; programs in /usr/bin;
# - gke: GKE's layout: everything under /usr/local/nvidia/{bin,lib64}, which no ld cache lists,
#   and in /usr/bin a shell wrapper per program that sets LD_LIBRARY_PATH and execs the real
#   one (what the H200 host of docs/driver-layouts.md had);
# - driver-container: the root of NVIDIA's (Ubuntu-based) driver container, as mounted at
#   /run/nvidia/driver: the distro layout plus its own ldconfig, /sbin/ldconfig being Ubuntu's
#   shell wrapper in front of /sbin/ldconfig.real; config.toml names that wrapper as the
#   ldconfig, as NVIDIA's GPU operator does ("@/run/nvidia/driver/sbin/ldconfig").
LAYOUTS = ("distro", "gke", "driver-container")
GKE_PREFIX = "/usr/local/nvidia"
# The wrappers' text: the shape of the one in front of nvidia-smi on that host.
WRAPPER = """#!/bin/sh
# Not the driver's program: a wrapper that finds the driver's libraries and runs the real one.
export LD_LIBRARY_PATH={prefix}/lib64${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}
exec {prefix}/bin/{name} "$@"
"""
# Ubuntu's /sbin/ldconfig (libc-bin), in short: it defers to a dpkg trigger during package
# installs and otherwise runs the real, static ldconfig.
UBUNTU_LDCONFIG = """#!/bin/sh
if test $# = 0 && test x"$LDCONFIG_NOTRIGGER" = x && test x"$DPKG_MAINTSCRIPT_PACKAGE" != x \\
    && dpkg-trigger --check-supported 2>/dev/null; then
    if dpkg-trigger --no-await ldconfig; then exit 0; fi
fi
exec /sbin/ldconfig.real "$@"
"""
BUILD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def _run(argv, what):
    try:
        subprocess.run(argv, env=BUILD_ENV, check=True, capture_output=True, timeout=120, cwd="/")
    except FileNotFoundError:
        raise SimulationError(f"{what}: {argv[0]} is not installed") from None
    except subprocess.CalledProcessError as err:
        tail = err.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SimulationError(f"{what} failed: {tail[0]}") from None


def free_major(taken_text: str, avoid=()) -> int:
    """A character major the running kernel does not use, from the dynamic range's top."""
    taken = set(avoid)
    for line in taken_text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit():
            taken.add(int(fields[0]))
    for major in range(511, 383, -1):
        if major not in taken:
            return major
    raise SimulationError("no free character device major for the simulated nvidia-uvm")


def cuda_version_for(driver_version: str) -> str:
    """The CUDA version a driver branch supports, e.g. 12.4 for 550.x."""
    branch = int(driver_version.split(".")[0])
    try:
        return CUDA_BY_BRANCH[branch]
    except KeyError:
        raise SimulationError(f"gpuhook does not know which CUDA version driver branch {branch} supports",
                              "pass --cuda-version") from None


def mig_layout(profiles) -> tuple:
    """Validate MIG profile names ("1g.10gb", ...) for one GPU; returns (profile, slices, GiB) each."""
    layout = []
    for profile in profiles:
        slices, _, memory = profile.partition("g.")
        if not (slices.isdigit() and memory.endswith("gb") and memory[:-2].isdigit()) or not 1 <= int(slices) <= 7:
            raise SimulationError(f"MIG profile {profile!r} is not like 1g.10gb (1 to 7 slices)")
        layout.append((profile, int(slices), int(memory[:-2])))
    if not layout:
        raise SimulationError("a MIG layout needs at least one profile")
    if sum(slices for _, slices, _ in layout) > MIG_SLICES:
        raise SimulationError(f"MIG layout {','.join(profiles)} needs more than the GPU's {MIG_SLICES} slices")
    return tuple(layout)


def mig_minor(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> int:
    """The nvidia-caps minor of gpu<M>/gi<G>/access (compute_instance None) or .../ci<C>/access."""
    base = MIG_MONITOR_MINOR + 1 + (gpu_minor * MIG_GPU_INSTANCES + gpu_instance) * (1 + MIG_COMPUTE_INSTANCES)
    return base if compute_instance is None else base + 1 + compute_instance


def gpu_records(count: int, seed: str, model: str) -> list[dict]:
    gpus = []
    for i in range(count):
        bus = f"00000000:{0x18 + 0x10 * (i % 14) + i // 14:02x}:00.0"
        gpus.append({
            "index": i,
            "minor": i,
            "uuid": "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpuhook-sim/{seed}/{i}")),
            "bus_id": bus[4:].lower(),
            "model": model,
        })
    return gpus


def _information(gpu: dict) -> str:
    return (
        f"Model: \t\t {gpu['model']}\n"
        f"IRQ:   \t\t {100 + gpu['index']}\n"
        f"GPU UUID: \t {gpu['uuid']}\n"
        f"Video BIOS: \t 96.00.61.00.01\n"
        f"Bus Type: \t PCIe\n"
        f"DMA Size: \t 52 bits\n"
        f"DMA Mask: \t 0xfffffffffffff\n"
        f"Bus Location: \t {gpu['bus_id']}\n"
        f"Device Minor: \t {gpu['minor']}\n"
        f"GPU Excluded:\t No\n"
    )


PARAMS = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
InitializeSystemMemoryAllocations: 1
UsePageAttributeTable: 4294967295
EnableMSI: 1
EnablePCIeGen3: 0
MemoryPoolSize: 0
KMallocHeapMaxSize: 0
VMallocHeapMaxSize: 0
IgnoreMMIOCheck: 0
EnableStreamMemOPs: 0
EnableUserNUMAManagement: 1
NvLinkDisable: 0
RmProfilingAdminOnly: 1
PreserveVideoMemoryAllocations: 0
"""


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _check_target(directory: str) -> None:
    """Make `directory` (0755), or accept an existing one only if it is a real directory that
    root owns and nobody else can write. Root later loads the "NVML" library built there: a
    directory another user made (say /tmp/sim), or a symlink, would let that user swap it."""
    from gpuhook.apply import statefiles
    from gpuhook.kernel import files

    try:
        statefiles.ensure_dir(directory, 0o755)
    except files.UntrustedPath as err:
        raise SimulationError(f"{directory} is a symlink, or not a directory owned by root and writable only by "
                              f"it; choose a private directory (e.g. under /var/lib)") from err


def build(directory: str, gpus: int = 2, driver_version: str = DEFAULT_DRIVER_VERSION,
          model: str = DEFAULT_MODEL, seed: str = "default", machine: str | None = None,
          cuda_version: str | None = None, brand: str = DEFAULT_BRAND, mig: dict | None = None,
          nvml_latency_ms: int = 0, nvml_init_latency_ms: int = 0, numa_nodes: int = 1,
          layout: str = "distro", nvswitches: int = 0, gdrcopy: bool = False) -> dict:
    """Create the simulated host under `directory` (replacing an earlier one there).

    `cuda_version` defaults to the driver branch's; `mig` maps GPU indices to MIG layouts
    (lists of profiles; empty for DEFAULT_MIG_LAYOUT) for GPUs that start in MIG mode;
    `nvml_latency_ms` is slept in every simulated NVML call, `nvml_init_latency_ms` in nvmlInit;
    the GPUs are spread over `numa_nodes` NUMA nodes in bus order (DIR/sys/bus/pci/devices);
    `layout` (LAYOUTS) is where the driver's files lie in the driver root.
    `nvswitches` NVSwitches get the nvidia-nvswitch driver's major and nodes
    (nvidia-nvswitchctl, nvidia-nvswitch<N>), `gdrcopy` GDRCopy's gdrdrv major and node.
    """
    if os.geteuid() != 0:
        raise SimulationError("simulate needs root: it creates device nodes and runs ldconfig -r")
    if not 1 <= gpus <= 64:
        raise SimulationError(f"--gpus must be between 1 and 64, not {gpus}")
    if not 0 <= nvswitches <= 64:
        raise SimulationError(f"--nvswitches must be between 0 and 64, not {nvswitches}")
    if not 1 <= numa_nodes <= gpus:
        raise SimulationError(f"--numa-nodes must be between 1 and the number of GPUs ({gpus}), not {numa_nodes}")
    parts = driver_version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        raise SimulationError(f"--driver-version must look like 550.54.15, not {driver_version!r}")
    cuda_version = cuda_version or cuda_version_for(driver_version)
    major, _, minor = cuda_version.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise SimulationError(f"--cuda-version must look like 12.4, not {cuda_version!r}")
    if layout not in LAYOUTS:
        raise SimulationError(f"--layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if brand not in BRANDS:
        raise SimulationError(f"--brand must be one of {', '.join(BRANDS)}, not {brand!r}")
    layouts = {}
    for index, profiles in (mig or {}).items():
        if not 0 <= index < gpus:
            raise SimulationError(f"--mig names GPU {index}, but there are {gpus} GPU(s)")
        layouts[index] = mig_layout(profiles or DEFAULT_MIG_LAYOUT)
    for name, value in (("--nvml-latency-ms", nvml_latency_ms), ("--nvml-init-latency-ms", nvml_init_latency_ms)):
        if not 0 <= value <= simnvml.MAX_LATENCY_MS:
            raise SimulationError(f"{name} must be between 0 and {simnvml.MAX_LATENCY_MS}, not {value}")
    machine = machine or os.uname().machine
    multiarch = MULTIARCH.get(machine)
    if multiarch is None:
        raise SimulationError(f"unsupported machine {machine}")
    directory = os.path.abspath(directory)
    _check_target(directory)
    if os.listdir(directory):
        if not os.path.exists(os.path.join(directory, MARKER)):
            raise SimulationError(f"{directory} is not empty and is not a simulated host; refusing to replace it")
        shutil.rmtree(directory)
        _check_target(directory)

    driver = f"{directory}/driver"
    state_file = simnvml.state_path(directory)
    libdir, bindir, extra = _lay_out_driver(driver, layout, multiarch, driver_version, state_file)
    firmware = f"{driver}/lib/firmware/nvidia/{driver_version}"
    os.makedirs(firmware)
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        with open(f"{firmware}/{name}", "wb") as f:
            f.write(b"GSPSIM" + os.urandom(4090))
    _make_socket(f"{driver}/var/run/nvidia-persistenced/socket")

    with open("/proc/devices") as f:
        real_devices = f.read()
    uvm_major = free_major(real_devices, avoid=(NVIDIA_MAJOR,))
    caps_major = free_major(real_devices, avoid=(NVIDIA_MAJOR, uvm_major))
    majors = {"nvidia": NVIDIA_MAJOR, "nvidia-uvm": uvm_major, "nvidia-caps": caps_major}
    # The optional devices' drivers (docs/simulated-host.md): their own dynamic majors.
    for name, wanted in (("nvidia-nvswitch", nvswitches > 0), ("gdrdrv", gdrcopy)):
        if wanted:
            majors[name] = free_major(real_devices, avoid=tuple(majors.values()))
    records = gpu_records(gpus, seed, model)
    proc = f"{directory}/proc"
    _write(f"{proc}/devices",
           "Character devices:\n  1 mem\n  5 /dev/tty\n136 pts\n"
           f"{NVIDIA_MAJOR} nvidia-frontend\n{uvm_major} nvidia-uvm\n{caps_major} nvidia-caps\n"
           + "".join(f"{majors[name]} {name}\n" for name in ("nvidia-nvswitch", "gdrdrv") if name in majors)
           + "\nBlock devices:\n  7 loop\n")
    _write(f"{proc}/driver/nvidia/version",
           f"NVRM version: NVIDIA UNIX {machine} Kernel Module  {driver_version}  "
           f"(simulated by gpuhook)\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    _write(f"{proc}/driver/nvidia/params", PARAMS)
    _write(f"{proc}/driver/nvidia/registry", "Binary: \"\"\n")
    for gpu in records:
        _write(f"{proc}/driver/nvidia/gpus/{gpu['bus_id']}/information", _information(gpu))
        gpu["numa_node"] = gpu["index"] * numa_nodes // gpus
        _write(f"{directory}/sys/bus/pci/devices/{gpu['bus_id']}/numa_node", f"{gpu['numa_node']}\n")
        gpu["brand"] = brand
        gpu["mig_devices"] = _mig_devices(gpu, layouts.get(gpu["index"], ()), seed)

    dev = f"{directory}/dev"
    os.makedirs(dev)
    nodes = [("nvidiactl", NVIDIA_MAJOR, 255), ("nvidia-modeset", NVIDIA_MAJOR, 254),
             ("nvidia-uvm", uvm_major, 0), ("nvidia-uvm-tools", uvm_major, 1)]
    nodes += [(f"nvidia{g['minor']}", NVIDIA_MAJOR, g["minor"]) for g in records]
    if nvswitches:
        nodes += [("nvidia-nvswitchctl", majors["nvidia-nvswitch"], 255)]
        nodes += [(f"nvidia-nvswitch{n}", majors["nvidia-nvswitch"], n) for n in range(nvswitches)]
    if gdrcopy:
        nodes.append(("gdrdrv", majors["gdrdrv"], 0))
    old_umask = os.umask(0)
    try:
        for name, major, minor in nodes:
            os.mknod(f"{dev}/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
    finally:
        os.umask(old_umask)
    _write_capabilities(directory, records)
    if layouts:
        _write_mig_caps(directory, records, caps_major)

    nvml_library = f"{libdir}/libnvidia-ml.so.1"
    state = simnvml.new_state(driver_version, cuda_version, [_gpu_state(g, g["index"] in layouts) for g in records],
                              call_latency_ms=nvml_latency_ms, init_latency_ms=nvml_init_latency_ms)
    simnvml.save(state_file, state)

    values = {"driver-root": driver, "dev-root": dev, "proc-root": proc, "sys-root": f"{directory}/sys",
              "log-file": f"{directory}/gpuhook.log",
              "state-dir": f"{directory}/run", "nvml-library": nvml_library, **extra}
    # A JSON string is a valid TOML basic string: quotes and backslashes in paths survive.
    config_text = "# Written by `gpuhook simulate`: points gpuhook at the simulated host in this directory.\n" + \
        "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())
    _write(f"{directory}/config.toml", config_text)
    host = {
        "directory": directory,
        "driver_version": driver_version,
        "machine": machine,
        "cuda_version": cuda_version,
        "majors": majors,
        "gpus": records,
        "config": f"{directory}/config.toml",
        "nvml_state": state_file,
        "nvml_library": nvml_library,
        "layout": layout,
        "driver_root": driver,
        "bin_dir": bindir,
        "lib_dir": libdir,
    }
    _write(f"{directory}/{MARKER}", json.dumps(host, indent=2) + "\n")
    return host


def _lay_out_driver(driver: str, layout: str, multiarch: str, version: str, state_file: str) -> tuple:
    """Build the driver's libraries and programs where `layout` puts them; returns (library
    dir, program dir, config keys the layout needs)."""
    extra: dict = {}
    if layout == "gke":
        libdir, bindir = f"{driver}{GKE_PREFIX}/lib64", f"{driver}{GKE_PREFIX}/bin"
        os.makedirs(libdir)
        _build_libraries(libdir, version, state_file)
        # The soname links NVIDIA's installer makes (no ld cache lists this directory).
        _run(["ldconfig", "-n", libdir], "soname links for the simulated driver libraries")
        _write(f"{driver}/etc/ld.so.conf", "")  # the host's ld cache knows nothing of the driver
        _run(["ldconfig", "-r", driver], "ldconfig for the simulated driver root")
        _build_tools(bindir, version, state_file)
        for name in TOOLS:
            _write(f"{driver}/usr/bin/{name}", WRAPPER.format(prefix=GKE_PREFIX, name=name), 0o755)
        return libdir, bindir, extra
    libdir, bindir = f"{driver}/usr/lib/{multiarch}", f"{driver}/usr/bin"
    os.makedirs(libdir)
    _build_libraries(libdir, version, state_file)
    _write(f"{driver}/etc/ld.so.conf", f"/usr/lib/{multiarch}\n")
    _run(["ldconfig", "-r", driver], "ldconfig for the simulated driver root")
    _build_tools(bindir, version, state_file)
    if layout == "driver-container":
        os.makedirs(f"{driver}/sbin", exist_ok=True)
        shutil.copy2(_static_ldconfig(), f"{driver}/sbin/ldconfig.real")
        _write(f"{driver}/sbin/ldconfig", UBUNTU_LDCONFIG, 0o755)
        extra["ldconfig"] = f"{driver}/sbin/ldconfig"
    return libdir, bindir, extra


def _static_ldconfig() -> str:
    """This machine's statically linked ldconfig, to stand for a driver container's own."""
    from gpuhook.discover import elf

    for path in ("/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig", "/usr/bin/ldconfig"):
        try:
            if elf.read(path).static:
                return path
        except (OSError, ValueError):
            continue
    raise SimulationError("the driver-container layout copies this machine's static ldconfig; found none")


def _c_string(text: str) -> str:
    """`text` as a C string literal for a -D option (paths may hold quotes or backslashes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _build_libraries(libdir: str, version: str, state_file: str) -> None:
    for stems in LIBRARIES.values():
        for stem in stems:
            suffix = SONAME_SUFFIX[stem]
            soname = f"{stem}.so.{version if suffix == 'V' else suffix}"
            argv = ["gcc", "-shared", "-fPIC", "-O1", "-o", f"{libdir}/{stem}.so.{version}", f"-Wl,-soname,{soname}"]
            if stem == "libnvidia-ml":
                # The one driver library that works: a simulated NVML exporting only NVML's API.
                argv += ["-O2", "-pthread", "-fvisibility=hidden", f"-DSIM_STATE_PATH={_c_string(state_file)}",
                         f"-DSIM_DRIVER_BRANCH={int(version.split('.')[0])}"]
                argv += [f"{CSRC}/{name}" for name in NVML_SOURCES]
            else:
                argv += [f'-DSIM_LIBRARY="{stem}"', f'-DSIM_DRIVER_VERSION="{version}"', f"{CSRC}/driverlib.c"]
            _run(argv, f"building {stem}")


def _build_tools(bindir: str, version: str, state_file: str) -> None:
    os.makedirs(bindir)
    first = f"{bindir}/{TOOLS[0]}"
    _run(["gcc", "-static", "-O2", "-s", "-o", first, f'-DSIM_DRIVER_VERSION="{version}"',
          f"-DSIM_STATE_PATH={_c_string(state_file)}"] + [f"{CSRC}/{name}" for name in TOOL_SOURCES],
         "building the simulated nvidia-smi")
    for name in TOOLS[1:]:
        shutil.copy2(first, f"{bindir}/{name}")


def _mig_devices(gpu: dict, layout: tuple, seed: str) -> list:
    """MIG devices for `layout`: one GPU instance per profile (ids 1, 2, ... in order; a real
    driver picks them by placement) with one compute instance (id 0) each."""
    devices = []
    for index, (profile, _slices, gib) in enumerate(layout):
        gi, ci = index + 1, 0
        devices.append({
            "index": index,
            "uuid": "MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL,
                                               f"gpuhook-sim/{seed}/{gpu['index']}/gi{gi}/ci{ci}")),
            "gpu_instance_id": gi,
            "compute_instance_id": ci,
            "profile": profile,
            "memory_total": gib << 30,
            "caps": {"gpu_instance": mig_minor(gpu["minor"], gi), "compute_instance": mig_minor(gpu["minor"], gi, ci)},
        })
    return devices


def _gpu_state(gpu: dict, mig_mode: bool) -> dict:
    return simnvml.gpu_state(
        gpu["uuid"], gpu["model"], gpu["minor"], "0000" + gpu["bus_id"].upper(),
        brand=gpu["brand"], pci_device_id=PCI_DEVICE_ID, pci_subsystem_id=PCI_SUBSYSTEM_ID,
        compute_capability=COMPUTE_CAPABILITY, memory_total=MEMORY_TOTAL, memory_reserved=MEMORY_RESERVED,
        mig_capable=True,
        mig_mode=mig_mode, mig_mode_pending=mig_mode,
        mig_devices=[
            {k: d[k] for k in ("gpu_instance_id", "compute_instance_id", "uuid", "profile", "memory_total")}
            for d in gpu["mig_devices"]
        ],
    )


def _capability_file(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _write_capabilities(directory: str, gpus: list) -> None:
    """What the driver makes on every host, MIG or not (docs/runtime-facts.md §4): the MIG
    minor table, mig/config, mig/monitor and fabric-imex-mgmt, and an empty gpu<minor>/mig
    directory per GPU. An H200 with MIG off lists exactly these."""
    lines = [f"config {MIG_CONFIG_MINOR}", f"monitor {MIG_MONITOR_MINOR}"]
    for gpu in gpus:
        for gi in range(MIG_GPU_INSTANCES):
            lines.append(f"gpu{gpu['minor']}/gi{gi}/access {mig_minor(gpu['minor'], gi)}")
            lines += [f"gpu{gpu['minor']}/gi{gi}/ci{ci}/access {mig_minor(gpu['minor'], gi, ci)}"
                      for ci in range(MIG_COMPUTE_INSTANCES)]
    _write(f"{directory}/proc/driver/nvidia-caps/mig-minors", "\n".join(lines) + "\n", 0o444)
    capabilities = f"{directory}/proc/driver/nvidia/capabilities"
    _write(f"{capabilities}/mig/config", _capability_file(MIG_CONFIG_MINOR, 0o400), 0o444)
    _write(f"{capabilities}/mig/monitor", _capability_file(MIG_MONITOR_MINOR, 0o444), 0o444)
    _write(f"{capabilities}/fabric-imex-mgmt", _capability_file(IMEX_MINOR, 0o400), 0o444)
    for gpu in gpus:
        os.makedirs(f"{capabilities}/gpu{gpu['minor']}/mig", exist_ok=True)


def _write_mig_caps(directory: str, gpus: list, caps_major: int) -> None:
    """The capability files of the MIG instances that exist, and nvidia-modprobe's device
    nodes for them (docs/runtime-facts.md §4)."""
    capabilities = f"{directory}/proc/driver/nvidia/capabilities"
    nodes = [("mig/config", MIG_CONFIG_MINOR, 0o400), ("mig/monitor", MIG_MONITOR_MINOR, 0o444)]
    for gpu in gpus:
        for device in gpu["mig_devices"]:
            gi, ci = device["gpu_instance_id"], device["compute_instance_id"]
            nodes.append((f"gpu{gpu['minor']}/mig/gi{gi}/access", device["caps"]["gpu_instance"], 0o444))
            nodes.append((f"gpu{gpu['minor']}/mig/gi{gi}/ci{ci}/access", device["caps"]["compute_instance"], 0o444))
    caps_dev = f"{directory}/dev/nvidia-caps"
    os.makedirs(caps_dev, exist_ok=True)
    old_umask = os.umask(0)
    try:
        for name, minor, mode in nodes:
            _write(f"{capabilities}/{name}", _capability_file(minor, mode), 0o444)
            node = f"{caps_dev}/nvidia-cap{minor}"
            if not os.path.exists(node):
                os.mknod(node, stat.S_IFCHR | mode, os.makedev(caps_major, minor))
    finally:
        os.umask(old_umask)


def _make_socket(path: str) -> None:
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    # A socket path is limited to 107 bytes; bind through a descriptor of its directory so a
    # simulated host can live anywhere.
    dirfd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"/proc/self/fd/{dirfd}/{name}")
    finally:
        sock.close()
        os.close(dirfd)
