"""`gpuhook cdi generate`: write a CDI spec for this host with gpuhook as its hook."""

import os

import click

from gpuhook import config as cfg
from gpuhook import install
from gpuhook.cli import CONFIG_OPTION
from gpuhook.driver import CAPABILITIES, CDI_KIND, DEFAULT_CAPABILITIES
from gpuhook.errors import InputError


@click.group(name="cdi", help="CDI (Container Device Interface) specs for runtimes that consume them.")
def cdi():
    pass


@cdi.command(name="generate", short_help="Write a CDI spec for this host's GPUs with gpuhook as its hook.", help=(
    f"Write a CDI spec of gpuhook's own kind {CDI_KIND} for this host (podman run --device "
    f"{CDI_KIND}=1): one device per GPU (by index and UUID), per MIG device (GPU:MIG and MIG "
    "UUID) and `all`, with their device nodes, the driver files for --capabilities mounted "
    "read-only, and gpuhook as the createRuntime and poststop hook, which updates the ld cache, "
    "masks /proc/driver/nvidia and checks and cleans the GPUs. Put it in /etc/cdi or "
    "/var/run/cdi (docs/cdi.md); it coexists with NVIDIA's nvidia.com/gpu spec. With --output, "
    "another spec of the same kind in that directory is refused (a runtime would refuse both)."))
@CONFIG_OPTION
@click.option("--output", metavar="FILE",
              help="Write the spec here (atomically, 0644) instead of stdout; its name ends in .json, .yaml or "
                   ".yml (runtimes read no other).")
@click.option("--format", "fmt", type=click.Choice(["json", "yaml"]), default=None,
              help="Spec format [default: from --output's suffix, else json].")
@click.option("--capabilities", default=",".join(sorted(DEFAULT_CAPABILITIES)), show_default=True, metavar="LIST",
              help=f"Driver capabilities whose files the spec mounts ({', '.join(CAPABILITIES)}).")
@click.option("--python", metavar="PATH",
              help="Interpreter the runtime starts for the hook [default: the running one].")
def generate(config_path, output, fmt, capabilities, python):
    from gpuhook.discover.cdi import SUFFIXES

    if output is not None and not output.endswith(SUFFIXES):
        raise InputError(f"--output {output}: runtimes read only CDI specs named *.json, *.yaml or *.yml",
                         "name the file gpuhook.json or gpuhook.yaml")
    config = cfg.load(config_path, os.environ)
    caps = tuple(c.strip() for c in capabilities.split(",") if c.strip())
    unknown = [c for c in caps if c not in CAPABILITIES]
    if unknown or not caps:
        raise InputError(f"--capabilities: unknown {', '.join(unknown)[:80] or 'empty list'} "
                         f"(known: {', '.join(CAPABILITIES)})")
    hook = install.this_installation(python, config_path, os.environ)
    if fmt is None:
        fmt = "yaml" if output and output.endswith((".yaml", ".yml")) else "json"
    if fmt == "yaml":
        try:
            import yaml  # noqa: F401  (PyYAML is only recommended by the RPM)
        except ImportError:
            raise InputError("YAML output needs PyYAML, which is not installed", "write JSON (--format json)") from None
    from gpuhook.discover import cdi, inventory, proc, survey
    from gpuhook.plan import cdispec

    # Read the host as the hook does (NVML only for MIG devices), then generate: pure.
    inv, facts, _, _ = inventory.read(config, want_facts=proc.has_mig_instances(proc.capabilities(config.proc_root)))
    spec = cdispec.generate(inv, facts, survey.host_nodes(config, inv), config.driver_root, hook, caps)
    text = cdispec.render(spec, fmt)
    if output is None:
        click.echo(text, nl=False)
        return
    conflicting, stale = cdi.neighbours(output, config.cdi_spec_dirs)
    if conflicting:
        raise InputError(f"{conflicting[0]} already defines CDI kind {CDI_KIND} in the same directory: "
                         f"a runtime would refuse the devices of both",
                         f"remove it, or write --output {conflicting[0]}")
    install.common._replace(os.path.abspath(output), text.encode())
    click.echo(f"wrote {output}")
    for path in stale:
        click.echo(f"gpuhook: {path} is a spec of an earlier gpuhook under NVIDIA's kind {cdi.NVIDIA_KIND}: "
                   f"remove it, it makes NVIDIA's devices of that kind unresolvable", err=True)
