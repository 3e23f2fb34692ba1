"""`gpuhook prestart | createRuntime | poststop`: the hook, run by hand or as a dry run."""

import json
import os
import sys

import click

from gpuhook import config as cfg
from gpuhook import hook, schema
from gpuhook.cli import CONFIG_OPTION
from gpuhook.errors import InputError
from gpuhook.plan.render import render_text


def _read_state(path):
    if path is None:
        return sys.stdin.buffer.read(), None
    try:
        with open(path, "rb") as f:
            return f.read(), os.path.dirname(os.path.abspath(path))
    except OSError as err:
        raise InputError(f"cannot read state file {path}: {err.strerror}") from err


STATE_OPTION = click.option("--state", "state_path", metavar="FILE", type=click.Path(dir_okay=False),
                            help="Read the OCI state from FILE instead of stdin (a relative bundle "
                                 "path in it is taken relative to FILE).")


def _start_command(stage: str):
    @click.command(name=stage, help=(
        f"Run the {stage} hook: read the OCI state (stdin or --state) and give the container "
        "the GPUs it requested, checked first. With --dry-run, print the plan and change "
        "nothing (not even gpuhook's own caches); its notes also name host problems that would "
        "fail other starts (gpuhook doctor --quick)."
    ))
    @CONFIG_OPTION
    @STATE_OPTION
    @click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
    def command(config_path, state_path, dry_run, as_json):
        raw, base_dir = _read_state(state_path)
        if not dry_run:
            if as_json:
                raise click.UsageError("--json goes with --dry-run")
            sys.exit(hook.run_hook(stage, raw, config_path, base_dir=base_dir))
        config = cfg.load(config_path, os.environ)
        state, spec = hook.read_container(raw, base_dir=base_dir)
        plan, _ = hook.plan_start(state, spec, config)  # the real run minus apply (and cache writes)
        found = schema.state_deviations(raw)
        if found is None:
            deviations = ["state not checked against the OCI schema: jsonschema is not installed"]
        else:
            deviations = [f"state deviates from the OCI schema (accepted leniently): {d}" for d in found]
        from gpuhook.cli import preflight

        # What would fail other starts on this host (gpuhook doctor --quick), as notes.
        host = [f"host: {c.name}: {c.summary}" + (f" ({c.hint})" if c.hint else "")
                for c in preflight.problems(preflight.run(config, quick=True))]
        plan = plan._replace(notes=plan.notes + tuple(deviations) + tuple(host))
        if as_json:
            click.echo(json.dumps(plan.as_dict(), indent=2))
        else:
            click.echo(render_text(plan), nl=False)

    return command


prestart = _start_command("prestart")
create_runtime = _start_command("createRuntime")


@click.command(name="poststop", help=(
    "Run the poststop hook: read the OCI state of a stopped container (stdin or --state), "
    "kill the processes it left on its GPUs and, with health.reset-on-release, reset a GPU "
    "it was the last user of. Always exits 0: a stop never fails; problems go to the log."
))
@CONFIG_OPTION
@STATE_OPTION
def poststop(config_path, state_path):
    raw, base_dir = _read_state(state_path)
    sys.exit(hook.run_hook("poststop", raw, config_path, base_dir=base_dir))
