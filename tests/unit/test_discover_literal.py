"""Discovery from a literal /proc (tests/data/host-a100-proc): what gpuhook.discover.proc makes of
the driver's own files, without a simulated host."""

import os
import shutil

import pytest

from gpuhook.discover import proc as discover
from gpuhook.errors import HostError

PROC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "host-a100-proc")


def test_the_driver_version_from_the_nvrm_line():
    assert discover.driver_version(PROC) == "550.54.15"


def test_majors_of_character_devices_only_with_the_old_frontend_name():
    majors = discover.majors(PROC)
    assert (majors["nvidia"], majors["nvidia-uvm"], majors["nvidia-caps"]) == (195, 235, 234)
    assert "nvidia-not-a-char-device" not in majors


def test_gpus_in_bus_order_without_the_excluded_one():
    found = discover.gpus(PROC)
    assert [(g.index, g.bus_id, g.minor, g.uuid) for g in found] == [
        (0, "0000:07:00.0", 0, "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"),
        (1, "0000:47:00.0", 2, "GPU-4b4d7f5a-2f6e-7d3c-1a0b-9c8d7e6f5a4b"),
    ]
    assert {g.model for g in found} == {"NVIDIA A100-SXM4-80GB"}


def test_mig_minors_and_capability_files():
    assert discover.mig_minors(PROC) == {"config": 1, "monitor": 2, "gpu0/gi1/access": 12,
                                         "gpu0/gi1/ci0/access": 13, "gpu2/gi1/access": 48}
    assert discover.capabilities(PROC) == ("gpu0/mig/gi1/access", "gpu0/mig/gi1/ci0/access")


@pytest.fixture
def proc(tmp_path):
    copy = tmp_path / "proc"
    shutil.copytree(PROC, copy)
    return copy


@pytest.mark.parametrize("field,value,message", [
    ("Device Minor", "254", "device minor 254 out of range"),
    ("GPU UUID", "GPU-../../etc", "'GPU UUID' is not a GPU UUID"),
])
def test_a_bad_information_file_is_a_host_error_naming_the_field(proc, field, value, message):
    path = proc / "driver/nvidia/gpus/0000:07:00.0/information"
    text = path.read_text()
    start = text.index(f"{field}:")
    end = text.index("\n", start)
    path.write_text(text[:start] + f"{field}: \t {value}" + text[end:])
    with pytest.raises(HostError) as caught:
        discover.gpus(str(proc))
    assert message in caught.value.one_line()


def test_no_driver_and_no_nvidia_major_are_host_errors(proc):
    (proc / "devices").write_text("Character devices:\n  1 mem\n\nBlock devices:\n195 nvidia\n")
    with pytest.raises(HostError, match="lists no nvidia character device major"):
        discover.majors(str(proc))
    (proc / "driver/nvidia/version").unlink()
    with pytest.raises(HostError, match="no NVIDIA driver"):
        discover.driver_version(str(proc))


def test_the_numa_node_of_a_gpu_from_sysfs(tmp_path):
    device = tmp_path / "bus/pci/devices/0000:47:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    assert discover.numa_node(str(tmp_path), "0000:47:00.0") == 1
    (device / "numa_node").write_text("-1\n")  # a machine without NUMA information
    assert discover.numa_node(str(tmp_path), "0000:47:00.0") is None
    assert discover.numa_node(str(tmp_path), "0000:07:00.0") is None  # no such device
    assert discover.numa_node(str(tmp_path), "../../../etc") is None
