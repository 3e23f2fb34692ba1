"""NVIDIA_NVSWITCH and NVIDIA_GDRCOPY in real runc containers, served as NVIDIA's toolkit
serves them (internal/modifier/gated.go, internal/discover/nvswitch.go and gdrcopy.go): with
the exact value `enabled`, a GPU container gets every host NVSwitch node
(/dev/nvidia-nvswitchctl, /dev/nvidia-nvswitch<N>) or /dev/gdrdrv, allowed in its device
cgroup. The simulated host has two NVSwitches and GDRCopy's gdrdrv (docs/simulated-host.md).
"""

import pytest

from conftest import GpuContainers, require_root_tools
from gpuhook.simulate import host as simhost

pytestmark = pytest.mark.root

NVSWITCH = ["/dev/nvidia-nvswitchctl", "/dev/nvidia-nvswitch0", "/dev/nvidia-nvswitch1"]
GDRDRV = "/dev/gdrdrv"
BY_HAND = "mknod /dev/gdrdrv-by-hand c {gdr} 0; mknod /dev/nvswitch0-by-hand c {nvswitch} 0"
PROBED = NVSWITCH + [GDRDRV, "/dev/gdrdrv-by-hand", "/dev/nvswitch0-by-hand"]


@pytest.fixture(scope="module")
def fabric_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("fabric") / "host"), gpus=2, nvswitches=2, gdrcopy=True,
                         seed="fabric")


def start(bed, sim, probe, tmp_path, name, env):
    containers = GpuContainers(bed, sim, probe, tmp_path)
    before = BY_HAND.format(gdr=sim["majors"]["gdrdrv"], nvswitch=sim["majors"]["nvidia-nvswitch"])
    result = containers.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"] + env, before=before, paths=PROBED)
    assert result.returncode == 0, result.stderr
    (line,) = [r for r in containers.log_lines() if r.get("stage") == "prestart"]
    return result.probes(), line


def test_nvswitch_enabled_gives_every_nvswitch_node_and_nothing_of_gdrcopy(bed, fabric_host, probe, tmp_path):
    probes, _ = start(bed, fabric_host, probe, tmp_path, "nvswitch", ["NVIDIA_NVSWITCH=enabled"])
    for path in NVSWITCH:
        assert probes[path]["exists"] and probes[path]["read"] == "ENXIO", (path, probes[path])
    assert probes["/dev/nvswitch0-by-hand"]["read"] == "ENXIO"  # the cgroup allows the switch
    assert not probes[GDRDRV]["exists"]
    assert probes["/dev/gdrdrv-by-hand"]["read"] == "EPERM"  # and nothing of gdrdrv


def test_gdrcopy_enabled_gives_dev_gdrdrv_and_nothing_of_the_switches(bed, fabric_host, probe, tmp_path):
    probes, _ = start(bed, fabric_host, probe, tmp_path, "gdrcopy", ["NVIDIA_GDRCOPY=enabled"])
    assert probes[GDRDRV]["exists"] and probes[GDRDRV]["read"] == "ENXIO"
    assert probes["/dev/gdrdrv-by-hand"]["read"] == "ENXIO"
    assert not any(probes[path]["exists"] for path in NVSWITCH)
    assert probes["/dev/nvswitch0-by-hand"]["read"] == "EPERM"


def test_a_value_other_than_enabled_injects_nothing_and_says_so(bed, fabric_host, probe, tmp_path):
    probes, line = start(bed, fabric_host, probe, tmp_path, "gdrcopy-1", ["NVIDIA_GDRCOPY=1"])
    assert not probes[GDRDRV]["exists"] and probes["/dev/gdrdrv-by-hand"]["read"] == "EPERM"
    assert any("NVIDIA_GDRCOPY='1' ignored" in note for note in line["notes"]), line["notes"]


def test_a_host_without_the_driver_starts_the_container_with_a_note(gpus):
    """As NVIDIA's toolkit, which warns and goes on: the devices are optional."""
    require_root_tools("runc")
    result = gpus.run("no-switch", env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_NVSWITCH=enabled", "NVIDIA_GDRCOPY=enabled"],
                      paths=NVSWITCH + [GDRDRV])
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert not any(probes[path]["exists"] for path in NVSWITCH + [GDRDRV])
    (line,) = [r for r in gpus.log_lines() if r.get("stage") == "prestart"]
    assert any(n.startswith("NVIDIA_NVSWITCH=enabled, but the host has no /dev/nvidia-nvswitch*") for n in line["notes"])
    assert any(n.startswith("NVIDIA_GDRCOPY=enabled, but the host has no /dev/gdrdrv") for n in line["notes"])
