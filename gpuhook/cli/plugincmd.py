"""`gpuhook plugin`: the Kubernetes device plugin."""

import os
import sys

import click

from gpuhook import config as cfg
from gpuhook.cli import CONFIG_OPTION

DEFAULT_DIR = "/var/lib/kubelet/device-plugins"


@click.command(name="plugin", help=(
    "Run the Kubernetes device plugin (API v1beta1): advertise the GPUs (by UUID) with their "
    "health, re-checked every [plugin] recheck-seconds; check, clean and stamp them in "
    "PreStartContainer (registered as required); Allocate them through [plugin] strategy. "
    "Registers with kubelet again whenever kubelet restarts; SIGTERM or SIGINT stops it "
    "(exit 0). docs/device-plugin.md."))
@CONFIG_OPTION
@click.option("--device-plugin-dir", default=DEFAULT_DIR, show_default=True, metavar="DIR",
              help="kubelet's device plugin directory (kubelet.sock; the plugin's socket goes here).")
def plugin(config_path, device_plugin_dir):
    from gpuhook.plugin import server

    config = cfg.load(config_path, os.environ)
    sys.exit(server.main(config, device_plugin_dir))
