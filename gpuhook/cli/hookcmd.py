"""`gpuhook prestart | createRuntime | poststop`: the hook, run by hand or as a dry run."""

import json
import os
import sys

import click

from gpuhook import config as cfg
from gpuhook import hook, schema
from gpuhook.errors import InputError
from gpuhook.plan import render_text


def _read_state(path):
    if path is None:
        return sys.stdin.buffer.read(), None
    try:
        with open(path, "rb") as f:
            return f.read(), os.path.dirname(os.path.abspath(path))
    except OSError as err:
        raise InputError(f"cannot read state file {path}: {err.strerror}") from err


def _stage_command(stage: str):
    @click.command(name=stage, help=(
        f"Run the {stage} hook: read the OCI state (stdin or --state), inject the GPUs the "
        "container requested. With --dry-run, print the plan and change nothing; a sample "
        "state's relative bundle path is taken relative to the state file."
    ))
    @click.option("--config", "config_path", metavar="FILE",
                  help=f"Configuration file (default: ${cfg.ENV_VAR} or {cfg.DEFAULT_PATH}).")
    @click.option("--state", "state_path", metavar="FILE", type=click.Path(dir_okay=False),
                  help="Read the OCI state from FILE instead of stdin.")
    @click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
    @click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
    def command(config_path, state_path, dry_run, as_json):
        raw, base_dir = _read_state(state_path)
        if not dry_run:
            if as_json:
                raise click.UsageError("--json goes with --dry-run")
            sys.exit(hook.run_hook(stage, raw, config_path))
        config = cfg.load(config_path, os.environ)
        state, spec = hook.read_container(raw, base_dir=base_dir)
        plan = hook.build_plan(state, spec, config)
        deviations = [f"state deviates from the OCI schema (accepted leniently): {d}"
                      for d in schema.state_deviations(raw)]
        plan = plan._replace(notes=plan.notes + tuple(deviations))
        if as_json:
            click.echo(json.dumps(plan.as_dict(), indent=2))
        else:
            click.echo(render_text(plan), nl=False)

    return command


prestart = _stage_command("prestart")
create_runtime = _stage_command("createRuntime")
poststop = _stage_command("poststop")
