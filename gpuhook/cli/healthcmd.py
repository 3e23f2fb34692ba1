"""`gpuhook prepare` and `gpuhook check`: the health checks by hand or from a device plugin."""

import json
import os

import click

from gpuhook import config as cfg
from gpuhook.cli import CONFIG_OPTION
from gpuhook.errors import InputError, printable

DEADLINE_OPTION = click.option("--deadline", "deadline_seconds", type=click.FloatRange(min=0.1, max=3600),
                               metavar="SECONDS", help="Time for all GPUs together (default: health.deadline-seconds).")
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")


def resolve_devices(text: str | None, config) -> list:
    """GPU and MIG UUIDs from a comma-separated list of NVML indices, GPU UUIDs, PCI bus ids
    and MIG UUIDs; every GPU of the host when `text` is None. A device this host does not
    have is bad input (exit 2), named: nothing is checked and no report is written for it."""
    from gpuhook.discover import proc
    from gpuhook.plan import select

    host = proc.gpus(config.proc_root)
    if text is None:
        return [gpu.uuid for gpu in host]
    wanted = [item.strip() for item in text.split(",") if item.strip()]
    if not wanted:
        raise InputError("--devices names no device")
    migs = None
    found = []
    for item in wanted:
        if item.upper().startswith("MIG-"):
            if migs is None:
                migs = _mig_uuids(config)
            uuid = migs.get(item.lower())
        else:
            gpu = select.match_gpu(item, host)
            uuid = gpu.uuid if gpu is not None else None
        if uuid is None:
            here = ", ".join(f"{gpu.index} ({gpu.uuid})" for gpu in host) or "none"
            raise InputError(f"--devices: no device {item[:80]!r} on this host (GPUs here: {here})")
        if uuid not in found:
            found.append(uuid)
    return found


def _mig_uuids(config) -> dict:
    """Lower-cased MIG UUID -> MIG UUID of every MIG device NVML reports."""
    from gpuhook.cli.hostcmd import read_inventory

    _, facts, _ = read_inventory(config, want_facts=True)
    return {mig.uuid.lower(): mig.uuid for gpu in facts.gpus.values() for mig in gpu.mig_devices}


def render(report, stamped: frozenset = frozenset(), allocation: str | None = None) -> str:
    lines = []
    for result in report.gpus:
        line = f"{result.uuid}  {result.status.value}  {result.seconds:.3f} s"
        if result.fixed:
            line += "  fixed: " + "; ".join(f"{f.check.value}: {f.evidence}" for f in result.fixed)
        if result.actions:
            line += "  actions: " + "; ".join(f"{a.action} {a.target}: {a.detail}" for a in result.actions)
        if result.problems:
            line += f"  {result.failure()}"
        if result.users:
            line += "  used by: " + ", ".join(result.users)
        if result.uuid in stamped:
            line += f"  stamped for allocation {allocation}"
        lines.append(printable(line))  # pod names and evidence come from pods and processes
    for cut in report.cut_off:
        lines.append(printable(f"cut off: {cut.text()}"))
    return "\n".join(lines)


def _show(report, as_json: bool, stamped: frozenset = frozenset(), allocation: str | None = None) -> None:
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        click.echo(render(report, stamped, allocation))


def _stamped(report, config, allocation: str | None) -> frozenset:
    """The GPUs of `report` that prepare left a stamp for `allocation` on (the healthy ones,
    unless writing a stamp failed): read back, so the output never claims a stamp that is
    not there."""
    from gpuhook.health import store

    if allocation is None:
        return frozenset()
    return frozenset(g.uuid for g in report.gpus
                     if g.ok and os.path.isfile(store.stamp_path(config.state_dir, g.uuid, allocation)))


@click.command(name="prepare", help=(
    "Check and clean GPUs before a container gets them, exactly as the hook does: kill processes "
    "left behind by gone containers, reset a GPU that needs it and that nobody uses, check again. "
    "With --allocation, leaves a stamp per GPU that is fine for the container carrying that "
    "allocation token, so its start (health.mode = fallback) skips the GPU; no other start can "
    "use the stamp. For a device plugin's PreStartContainer. Exits non-zero with one line naming "
    "the GPU, the check and the evidence when a GPU stays unhealthy."
))
@CONFIG_OPTION
@click.option("--devices", required=True, metavar="UUID[,UUID...]",
              help="The GPUs: UUIDs (GPU-..., or MIG-... for a MIG device's parent GPU) or NVML indices.")
@click.option("--allocation", metavar="TOKEN", help=(
    "The token the device plugin's Allocate gave the container, as a read-only bind of /dev/null "
    "at /var/run/gpuhook-allocation/TOKEN (16 to 128 letters, digits, - or _). Without it, no stamp "
    "is left."))
@DEADLINE_OPTION
@JSON_OPTION
def prepare(config_path, devices, allocation, deadline_seconds, as_json):
    from gpuhook import health
    from gpuhook.errors import GpuUnhealthyError, HealthDeadlineError

    config = cfg.load(config_path, os.environ)
    uuids = resolve_devices(devices, config)
    try:
        report = health.prepare(uuids, config, deadline_seconds, allocation)
    except (GpuUnhealthyError, HealthDeadlineError) as err:
        _show(err.report, as_json, _stamped(err.report, config, allocation), allocation)
        raise
    _show(report, as_json, _stamped(report, config, allocation), allocation)


@click.command(name="check", help=(
    "Run the health checks on GPUs (all of the host's by default) and write their reports "
    "under <state-dir>/health/. Changes nothing on the GPUs unless --repair is given, which "
    "kills orphaned processes and resets as `gpuhook prepare` does (without stamps). Exits 6 "
    "when a GPU is unhealthy, 7 when the deadline cut a check off."
))
@CONFIG_OPTION
@click.option("--devices", metavar="UUID[,UUID...]",
              help="The GPUs: UUIDs (GPU-..., or MIG-... for a MIG device's parent GPU) or NVML indices.")
@click.option("--repair", is_flag=True, help="Kill orphaned processes and reset GPUs that need it.")
@DEADLINE_OPTION
@JSON_OPTION
def check(config_path, devices, repair, deadline_seconds, as_json):
    from gpuhook import health

    config = cfg.load(config_path, os.environ)
    uuids = resolve_devices(devices, config)
    report = health.check(uuids, config, repair, deadline_seconds)
    _show(report, as_json)
    error = report.error()
    if error is not None:
        raise error
