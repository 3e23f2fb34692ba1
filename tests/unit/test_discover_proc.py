"""Host discovery from files: /proc/driver/nvidia, /proc/devices, the driver root.

The tests of it that need no root; those that do are in tests/integration/test_discover.py.
"""

import pytest
from gpuhook import config as cfg
from gpuhook.discover import container, proc, survey
from gpuhook.errors import HostError


def proc_tree(tmp_path, version_line="NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023",
              devices="Character devices:\n195 nvidia-frontend\n509 nvidia-uvm\n\nBlock devices:\n  7 loop\n", gpus=()):
    root = tmp_path / "proc"
    (root / "driver/nvidia/gpus").mkdir(parents=True)
    (root / "driver/nvidia/version").write_text(version_line + "\nGCC version:  gcc version 12.2.0\n")
    (root / "devices").write_text(devices)
    for bus, text in gpus:
        (root / f"driver/nvidia/gpus/{bus}").mkdir()
        (root / f"driver/nvidia/gpus/{bus}/information").write_text(text)
    return str(root)


def info(uuid, minor, bus, model="Tesla V100-SXM2-16GB", excluded="No"):
    return (f"Model: \t\t {model}\nIRQ:   \t\t 34\nGPU UUID: \t {uuid}\nVideo BIOS: \t 88.00.4f.00.09\n"
            f"Bus Type: \t PCIe\nBus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t {excluded}\n")


@pytest.mark.parametrize("line,version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", "535.104.05"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)", "550.54.15"),
    ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  470.82  Tue Oct 26 2021", "470.82"),
])
def test_driver_version_from_the_nvrm_line(tmp_path, line, version):
    assert proc.driver_version(proc_tree(tmp_path, line)) == version


def test_no_driver_is_a_clear_error(tmp_path):
    with pytest.raises(HostError) as err:
        proc.driver_version(str(tmp_path))
    assert "no NVIDIA driver" in err.value.message and "kernel module" in err.value.one_line()


def test_majors_read_character_devices_only(tmp_path):
    devices = "Character devices:\n195 nvidia-frontend\n508 nvidia-uvm\n507 nvidia-caps\n\nBlock devices:\n195 nvidia\n"
    assert proc.majors(proc_tree(tmp_path, devices=devices)) == {"nvidia": 195, "nvidia-uvm": 508, "nvidia-caps": 507}


def test_majors_without_nvidia_is_an_error(tmp_path):
    with pytest.raises(HostError, match="no nvidia character device major"):
        proc.majors(proc_tree(tmp_path, devices="Character devices:\n  1 mem\n"))


def test_gpus_are_indexed_by_pci_bus_order_and_excluded_ones_skipped(tmp_path):
    root = proc_tree(tmp_path, gpus=[
        ("0000:3b:00.0", info("GPU-b", 1, "0000:3B:00.0")),
        ("0000:1a:00.0", info("GPU-a", 0, "0000:1a:00.0")),
        ("0000:5e:00.0", info("GPU-x", 2, "0000:5e:00.0", excluded="Yes")),
    ])
    gpus = proc.gpus(root)
    assert [(g.index, g.uuid, g.minor, g.bus_id) for g in gpus] == [
        (0, "GPU-a", 0, "0000:1a:00.0"), (1, "GPU-b", 1, "0000:3b:00.0")]
    assert gpus[0].model == "Tesla V100-SXM2-16GB" and gpus[1].node == "/dev/nvidia1"


@pytest.mark.parametrize("text,message", [
    ("Model: x\nDevice Minor: 0\n", "missing or bad"),
    ("GPU UUID: GPU-a\nDevice Minor: zero\n", "missing or bad"),
    ("GPU UUID: GPU-a\nDevice Minor: 255\n", "out of range"),
])
def test_bad_information_files_are_errors(tmp_path, text, message):
    with pytest.raises(HostError, match=message):
        proc.gpus(proc_tree(tmp_path, gpus=[("0000:01:00.0", text)]))


def test_container_facts_by_image_family(tmp_path):
    c = cfg.from_mapping({})
    plain = tmp_path / "plain"
    plain.mkdir()
    assert container.container_facts(str(plain), c, "x86_64") == ("/usr/lib64", "/usr/lib", False)
    deb = tmp_path / "deb"
    (deb / "etc").mkdir(parents=True)
    (deb / "etc/debian_version").write_text("12\n")
    (deb / "etc/ld.so.cache").write_text("")
    assert container.container_facts(str(deb), c, "x86_64") == (
        "/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu", True)
    hostile = tmp_path / "hostile"
    (hostile / "etc").mkdir(parents=True)
    (hostile / "etc/debian_version").symlink_to("/etc/debian_version")  # host file; inside root: missing
    (hostile / "etc/ld.so.conf").symlink_to("/etc/ld.so.conf")
    assert container.container_facts(str(hostile), c, "x86_64") == ("/usr/lib64", "/usr/lib", False)
    forced = cfg.from_mapping({"container-lib-dir": "/opt/nvidia/lib"})
    assert container.container_facts(str(plain), forced).lib64 == "/opt/nvidia/lib"


def test_host_node_falls_back_to_dev_only_without_dev_root(tmp_path):
    null = cfg.from_mapping({"driver-root": str(tmp_path)})  # <driver-root>/dev does not exist
    assert survey.host_node(null, "/dev/null")[3] == "/dev/null"
    strict = cfg.from_mapping({"driver-root": str(tmp_path), "dev-root": str(tmp_path)})
    assert survey.host_node(strict, "/dev/null") is None
