"""`gpuhook doctor`: check this host's setup before a container start fails on it."""

import json
import os

import click

from gpuhook import config as cfg
from gpuhook.cli import CONFIG_OPTION
from gpuhook.errors import HostError

MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


@click.command(name="doctor", help=(
    "Check this host's setup for GPU containers, one line per check: the driver and its GPUs, "
    "device majors and nodes, the driver's libraries and programs (ELF, not wrappers), the static "
    "ldconfig gpuhook runs, the cgroup mode and what gpuhook does there, the state dir, the decision "
    "log, the health daemon, NVML (loaded once: driver version, MIG mode) and the runtimes gpuhook "
    "is registered with. Each check is ok, WARN (containers start without something, or slower), "
    "FAIL (GPU starts fail) or skip, with a hint. Changes nothing. Exit status: 0 when no check "
    "failed (warnings included), 4 when one did."
))
@CONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {ok, config, checks: [{name, status, summary, hint}]}.")
@click.option("--quick", is_flag=True,
              help="Only the checks that read files (no NVML, no health daemon, no runtime configuration): "
                   "what `list` and `prestart --dry-run` warn with.")
@click.option("--host-root", default="/", show_default=True, metavar="DIR",
              type=click.Path(exists=True, file_okay=False),
              help="Read the runtimes' configuration under DIR (a node's root mounted into a DaemonSet pod).")
def doctor(config_path, as_json, quick, host_root):
    from gpuhook.cli import preflight

    config = cfg.load(config_path, os.environ)
    checks = preflight.run(config, quick=quick, root=host_root)
    failed = [c.name for c in checks if c.status == preflight.FAIL]
    if as_json:
        click.echo(json.dumps({"ok": not failed, "config": config.source,
                               "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        click.echo(f"# gpuhook doctor, configuration: {config.source}")
        width = max(len(c.name) for c in checks)
        for check in checks:
            click.echo(f"{MARK[check.status]:<4}  {check.name:<{width}}  {check.summary}")
            if check.hint and check.status in (preflight.WARN, preflight.FAIL):
                click.echo(f"{'':<4}  {'':<{width}}  -> {check.hint}")
    if failed:
        raise HostError(f"{len(failed)} check(s) failed: {', '.join(failed)}", "see the lines above")
