"""The driver as real hosts lay it out (docs/driver-layouts.md), with real runc containers.

Each layout is a simulated host (`gpuhook simulate --layout`): GKE's /usr/local/nvidia with
shell wrappers in front of the programs and no ld cache entries, NVIDIA's driver container
with Ubuntu's ldconfig wrapper, and an Ubuntu host whose /sbin/ldconfig is that wrapper
(the host's /usr/sbin overlaid in a private mount namespace for runc and the hook).
"""

import os
import subprocess

import pytest

from conftest import GpuContainers, require, require_root_tools
from gpuhook.simulate import host as simhost
from helpers import testbed

ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
# What the simulated nvidia-smi prints first when it runs (gpuhook/simulate/csrc/tool.c).
SMI_BANNER = "nvidia-smi (simulated by gpuhook"


@pytest.fixture(scope="module")
def gke_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("gke") / "host"), gpus=2, layout="gke")


@pytest.fixture(scope="module")
def driver_container_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("drvctr") / "host"), gpus=2, layout="driver-container")


def containers(bed, sim, probe, tmp_path, **overrides) -> GpuContainers:
    gpus = GpuContainers(bed, sim, probe, tmp_path)
    extra = {"ldconfig": overrides.pop("ldconfig")} if "ldconfig" in overrides else {}
    if sim["layout"] == "driver-container" and "ldconfig" not in extra:
        extra["ldconfig"] = f"{sim['driver_root']}/sbin/ldconfig"  # what its config.toml says
    gpus.configure(**extra, **overrides)
    return gpus


def test_the_gke_layouts_wrappers_are_skipped_and_the_real_programs_run_in_the_container(bed, gke_host, probe,
                                                                                          tmp_path):
    """/usr/bin/nvidia-smi there is a shell script that execs /usr/local/nvidia/bin/nvidia-smi:
    mounted into a container it runs the image's shell and names a file the container lacks."""
    assert open(f"{gke_host['driver_root']}/usr/bin/nvidia-smi", "rb").read(2) == b"#!"
    gpus = containers(bed, gke_host, probe, tmp_path)
    result = gpus.run("gke-smi", env=ENV, before="/usr/bin/nvidia-smi; echo smi-rc=$?",
                      paths=["/usr/lib64/libcuda.so.1", "/usr/lib64/libnvidia-ml.so.1"])
    assert result.returncode == 0, result.stderr
    assert SMI_BANNER in result.stdout and "smi-rc=0" in result.stdout
    probes = result.probes()
    assert probes["/usr/lib64/libcuda.so.1"]["exists"] and probes["/usr/lib64/libnvidia-ml.so.1"]["exists"]
    record = gpus.log_lines()[-1]
    assert record["decision"] == "gpus injected", record


def test_named_driver_dirs_are_the_only_places_looked_at(bed, gke_host, probe, tmp_path):
    """driver-bin-dirs and driver-lib-dirs: the operator says where the driver is."""
    from gpuhook import config as cfg
    from gpuhook.discover import inventory as discover_inventory

    gpus = containers(bed, gke_host, probe, tmp_path, **{"driver-bin-dirs": ["/usr/bin"],
                                                          "driver-lib-dirs": ["/usr/local/nvidia/lib64"]})
    inventory = discover_inventory.scan(cfg.load(gpus.config))
    assert not any(b.container_path == "/usr/bin/nvidia-smi" for b in inventory.binaries)  # only a wrapper there
    assert {lib.host_path.rsplit("/", 1)[0] for lib in inventory.libraries} == {gke_host["lib_dir"]}
    result = gpus.run("gke-named", env=ENV, before="ls /usr/bin/nvidia-smi; echo ls-rc=$?")
    assert result.returncode == 0, result.stderr
    assert "ls-rc=1" in result.stdout  # no wrapper mounted, and no real program named


def test_a_driver_containers_ldconfig_wrapper_gives_way_to_its_real_binary(bed, driver_container_host, probe,
                                                                           tmp_path):
    """NVIDIA's GPU operator points the toolkit at /run/nvidia/driver/sbin/ldconfig, Ubuntu's
    shell wrapper in an Ubuntu-based driver container; the static binary is ldconfig.real."""
    gpus = containers(bed, driver_container_host, probe, tmp_path)
    result = gpus.run("drvctr-ld", env=ENV, before="ls /etc/ld.so.cache; echo ls-rc=$?")
    assert result.returncode == 0, result.stderr
    assert "ls-rc=0" in result.stdout
    record = gpus.log_lines()[-1]
    assert record["decision"] == "gpus injected", record
    real = f"{driver_container_host['driver_root']}/sbin/ldconfig.real"
    assert any(real in note for note in record.get("notes", [])), record


def ubuntu_sbin(tmp_path) -> list:
    """A runc wrapper that overlays /usr/sbin in a private mount namespace with Ubuntu's
    ldconfig: /usr/sbin/ldconfig the wrapper script, /usr/sbin/ldconfig.real the static binary
    (this host's own ldconfig). /sbin is /usr/sbin on a merged-/usr host like this one."""
    layer = tmp_path / "ubuntu-sbin"
    layer.mkdir()
    real = os.path.realpath("/sbin/ldconfig")
    subprocess.run(["cp", "-p", real, str(layer / "ldconfig.real")], check=True)
    (layer / "ldconfig").write_text(simhost.UBUNTU_LDCONFIG)
    (layer / "ldconfig").chmod(0o755)
    mount = f"mount -t overlay overlay -o lowerdir={layer}:/usr/sbin /usr/sbin && exec \"$@\""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]


def test_with_the_default_config_an_ubuntu_hosts_ldconfig_wrapper_is_passed_over(sim_host, probe, tmp_path):
    require_root_tools("runc", "unshare")
    require(os.path.realpath("/sbin") == "/usr/sbin", "the overlay stands for /sbin only on a merged-/usr host")
    bed = testbed.Testbed(str(tmp_path / "bed"), wrapper=ubuntu_sbin(tmp_path))
    gpus = GpuContainers(bed, sim_host, probe, tmp_path)  # no ldconfig key: the default
    result = gpus.run("ubuntu-ld", env=ENV, before="ls /etc/ld.so.cache; echo ls-rc=$?")
    assert result.returncode == 0, result.stderr
    assert "ls-rc=0" in result.stdout
    record = gpus.log_lines()[-1]
    assert any("/sbin/ldconfig.real" in note for note in record.get("notes", [])), record

