"""`gpuhook list` and `gpuhook config`: what the hook sees on this host."""

import json
import os

import click

from gpuhook import config as cfg
from gpuhook import discover

CONFIG_OPTION = click.option("--config", "config_path", metavar="FILE",
                             help=f"Configuration file (default: ${cfg.ENV_VAR} or {cfg.DEFAULT_PATH}).")


@click.command(name="list", help="List the host's GPUs (from /proc/driver/nvidia, no NVML).")
@CONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_gpus(config_path, as_json):
    config = cfg.load(config_path, os.environ)
    version = discover.driver_version(config.proc_root)
    gpus = discover.gpus(config.proc_root)
    if as_json:
        click.echo(json.dumps({"driver_version": version, "gpus": [g._asdict() for g in gpus]}, indent=2))
        return
    click.echo(f"driver {version}, {len(gpus)} GPU(s)")
    for g in gpus:
        click.echo(f"  {g.index}  {g.uuid}  minor {g.minor}  {g.bus_id}  {g.model}")


@click.command(name="config", help="Show the effective configuration: every key, its value, and the source file.")
@CONFIG_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show_config(config_path, as_json):
    config = cfg.load(config_path, os.environ)
    if as_json:
        click.echo(json.dumps({"source": config.source, "values": config.as_dict()}, indent=2))
        return
    click.echo(f"# source: {config.source}")
    section = None
    for key in cfg.KEYS:
        if key.section != section:
            section = key.section
            click.echo(f"\n[{section}]")
        value = getattr(getattr(config, section) if section else config, key.name.replace("-", "_"))
        click.echo(f"{key.name} = {json.dumps(value)}")
