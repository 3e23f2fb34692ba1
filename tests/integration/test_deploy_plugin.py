"""The DaemonSet's plugin container, with the configuration deploy/kubernetes/gpuhook.yaml gives
it, reaches NVML through the node's driver and advertises every healthy GPU Healthy
(docs/kubernetes.md).

The node is a simulated host: its driver root (DIR/driver: usr/lib/<multiarch> with the ld
cache, usr/bin/nvidia-smi) stands for the node's root that the container mounts at /host,
and DIR/dev, DIR/proc, DIR/sys for the node's /dev, /proc and /sys the container sees. The
ConfigMap's plugin.toml is used with exactly those paths swapped; nothing else is set, in
particular no nvml-library: the image has no libnvidia-ml, the node's must be found.
"""

import json
import os
import subprocess
import sys
import tempfile
import tomllib

import pytest
import yaml

from conftest import REPO, require_root_tools
from gpuhook.simulate import host as simhost

pytestmark = pytest.mark.root

MANIFEST = os.path.join(REPO, "deploy", "kubernetes", "gpuhook.yaml")

RECHECK = """
import json, sys
from gpuhook import config as cfg
from gpuhook.health.actions import reset_argv
from gpuhook.plugin.server import Plugin
config = cfg.load(sys.argv[1], {}, use_cache=False)
plugin = Plugin(config, sys.argv[2])
plugin.recheck()
try:
    reset = reset_argv(config, plugin.devices.ids[0])
except Exception as err:
    reset = str(err)
print(json.dumps({"health": plugin.devices.health, "reasons": plugin.devices.reasons, "reset": reset}))
"""


def configmap_text(name: str) -> str:
    with open(MANIFEST) as f:
        (configmap,) = [d for d in yaml.safe_load_all(f) if d and d["kind"] == "ConfigMap"]
    return configmap["data"][name]


def on_node(text: str, sim: dict, state_dir: str) -> str:
    """plugin.toml as the container sees the simulated node: /host is the node's root, and
    the container's own /dev, /proc and /sys are the node's."""
    d = sim["directory"]
    doc = tomllib.loads(text)
    assert doc["driver-root"] == "/host" and doc["dev-root"] == "/dev" and "nvml-library" not in doc
    lines = [line.replace('"/host', f'"{d}/driver').replace(" /host ", f" {d}/driver ")
             for line in text.splitlines()]
    # Top-level keys first (TOML): the container's /dev, /proc, /sys and a state dir of the test's.
    roots = [f'dev-root = "{d}/dev"', f'proc-root = "{d}/proc"', f'sys-root = "{d}/sys"', f'state-dir = "{state_dir}"']
    return "\n".join(roots + [line for line in lines if not line.startswith("dev-root")]) + "\n"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("deploy") / "host"), gpus=2, seed="deploy")


def test_the_plugin_container_config_finds_the_nodes_nvml_and_every_gpu_is_healthy(node, tmp_path):
    config = tmp_path / "plugin.toml"
    config.write_text(on_node(configmap_text("plugin.toml"), node, str(tmp_path / "run")))
    plugin_dir = tempfile.mkdtemp(prefix="gpuhook-dp-", dir="/tmp")
    try:
        done = subprocess.run([sys.executable, "-c", RECHECK, str(config), plugin_dir], capture_output=True,
                              text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})
    finally:
        os.rmdir(plugin_dir)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["health"] == {g["uuid"]: "Healthy" for g in node["gpus"]}, result["reasons"]
    # A reset runs the node's nvidia-smi inside the node's root, where its libnvidia-ml is.
    assert result["reset"] == ["/usr/sbin/chroot", f"{node['directory']}/driver", "nvidia-smi", "--gpu-reset",
                               "-i", node["gpus"][0]["uuid"]]


def test_the_nodes_config_in_the_plugin_container_leaves_every_gpu_unhealthy(node, tmp_path):
    """What the DaemonSet shipped before: the plugin read the node's config.toml, whose driver
    root / is the image's, where no libnvidia-ml exists."""
    d = node["directory"]
    config = tmp_path / "node.toml"
    config.write_text(f'dev-root = "{d}/dev"\nproc-root = "{d}/proc"\nsys-root = "{d}/sys"\n'
                      f'state-dir = "{tmp_path}/run"\n' + configmap_text("config.toml"))
    plugin_dir = tempfile.mkdtemp(prefix="gpuhook-dp-", dir="/tmp")
    try:
        done = subprocess.run([sys.executable, "-c", RECHECK, str(config), plugin_dir], capture_output=True,
                              text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})
    finally:
        os.rmdir(plugin_dir)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["health"].values()) == {"Unhealthy"}
    assert result["reset"].startswith("reset command not found")
