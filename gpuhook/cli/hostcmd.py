"""`gpuhook list` and `gpuhook config`: what the hook sees on this host (and, as warnings,
what `gpuhook doctor --quick` finds wrong with it)."""

import json
import os

import click

from gpuhook import config as cfg
from gpuhook.cli import CONFIG_OPTION


def read_inventory(config, want_facts: bool = False) -> tuple:
    """(Inventory, NVML facts or None, their source) as a start would find them
    (gpuhook.discover.inventory.read); what the read refreshed is cached as a start caches it
    (gpuhook.apply.statefiles.write_caches), so the next start or command reads the cache."""
    from gpuhook.apply import statefiles
    from gpuhook.discover import inventory

    found, facts, source, pending = inventory.read(config, want_facts=want_facts)
    statefiles.write_caches(config, [pending] if pending else [])
    return found, facts, source


@click.command(name="list", help=(
    "List the host's GPUs and MIG devices as the hook sees them: /proc/driver/nvidia for "
    "identity, NVML (through the inventory cache) for brand, compute capability, CUDA version "
    "and MIG layout. Without NVML the list still shows what /proc says. Host problems that would "
    "fail GPU starts (`gpuhook doctor --quick`) are printed as warnings on stderr."
))
@CONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_gpus(config_path, as_json):
    from gpuhook.errors import GpuhookError

    config = cfg.load(config_path, os.environ)
    host = read_inventory(config)[0]
    try:
        (_, facts, source), problem = read_inventory(config, want_facts=True), None
    except GpuhookError as err:
        facts, source, problem = None, None, err.one_line()
    rows = []
    for gpu in host.gpus:
        known = facts.gpus.get(gpu.uuid) if facts else None
        rows.append(dict(gpu.identity(), brand=known and known.brand, arch=known and known.arch,
                         mig_mode=known and known.mig_mode,
                         mig_devices=[{"index": d.index, "uuid": d.uuid, "gpu_instance_id": d.gpu_instance_id,
                                       "compute_instance_id": d.compute_instance_id, "name": d.name,
                                       "id": f"{gpu.index}:{d.index}"}
                                      for d in (known.mig_devices if known and known.mig_mode else ())]))
    if as_json:
        from gpuhook.cli import preflight

        click.echo(json.dumps({"driver_version": host.driver_version,
                               "cuda_version": facts.cuda_version if facts else None,
                               "nvml": source, "nvml_error": problem, "gpus": rows,
                               "host_problems": [c.as_dict() for c in
                                                 preflight.problems(preflight.run(config, quick=True))]}, indent=2))
        return
    cuda = f", CUDA {facts.cuda_version}" if facts else ""
    click.echo(f"driver {host.driver_version}{cuda}, {len(rows)} GPU(s)")
    for row in rows:
        extra = f"  {row['brand']} sm {row['arch']}" if facts else ""
        mig = "  MIG on" if row["mig_mode"] else ""
        click.echo(f"  {row['index']}  {row['uuid']}  minor {row['minor']}  {row['bus_id']}  {row['model']}{extra}{mig}")
        for device in row["mig_devices"]:
            click.echo(f"     {device['id']}  {device['uuid']}  {device['name']}  "
                       f"gi {device['gpu_instance_id']} ci {device['compute_instance_id']}")
    if problem:
        click.echo(f"NVML: {problem}", err=True)
    elif source:
        click.echo(f"({source})")
    warn_about_host(config)


def warn_about_host(config) -> None:
    """One stderr line per quick preflight check that is not ok (`gpuhook doctor` has them
    all): a host problem that fails every start shows before a container meets it."""
    from gpuhook.cli import preflight

    for check in preflight.problems(preflight.run(config, quick=True)):
        hint = f" ({check.hint})" if check.hint else ""
        click.echo(f"warning: {check.name}: {check.summary}{hint}", err=True)


@click.command(name="config", help="Show the effective configuration: every key, its value, and the source file.")
@CONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show_config(config_path, as_json):
    config = cfg.load(config_path, os.environ)
    if as_json:
        click.echo(json.dumps({"source": config.source, "values": config.as_dict()}, indent=2))
        return
    click.echo(f"# source: {config.source}")
    section = ""  # top-level keys come first and need no table header
    for key in cfg.KEYS:
        if key.section != section:
            section = key.section
            click.echo(f"\n[{section}]")
        value = getattr(getattr(config, section) if section else config, key.name.replace("-", "_"))
        click.echo(f"{key.name} = {json.dumps(value)}")
