"""The host inventory cache: used while the host is unchanged, rebuilt when it changes.

Discovery only reads (gpuhook.discover.inventory.read); a start writes what it refreshed
(gpuhook.apply.statefiles.write_caches): `start_inventory` and `start_facts` do both, as a
start does."""

import json
import os
import shutil

import pytest

from gpuhook import config as cfg
from gpuhook.apply import statefiles
from gpuhook.discover import inventory, proc


def start_inventory(config):
    """The inventory as a start finds it, its refreshed cache written as a start writes it."""
    found, _, _, pending = inventory.read(config)
    statefiles.write_caches(config, [pending] if pending else [])
    return found


def start_facts(config):
    """(NVML facts, their source) as a start that needs them finds them, cache written."""
    _, facts, source, pending = inventory.read(config, want_facts=True)
    statefiles.write_caches(config, [pending] if pending else [])
    return facts, source


@pytest.fixture
def host(tmp_path, sim_host):
    """A private copy of the simulated host's proc and driver trees (tests edit them)."""
    src = sim_host["directory"]
    shutil.copytree(f"{src}/proc", tmp_path / "proc")
    shutil.copytree(f"{src}/driver", tmp_path / "driver", symlinks=True, ignore=shutil.ignore_patterns("socket"))
    config = cfg.from_mapping({"driver-root": str(tmp_path / "driver"), "dev-root": f"{src}/dev",
                               "proc-root": str(tmp_path / "proc"), "state-dir": str(tmp_path / "run")})
    return tmp_path, config


def test_reading_writes_nothing_a_start_writes_the_cache_and_the_next_uses_it(host, monkeypatch):
    tmp_path, config = host
    assert inventory.load(config).gpus and not os.path.exists(tmp_path / "run")  # a command: reads only
    first = start_inventory(config)
    assert os.path.exists(tmp_path / "run" / "inventory.json")
    monkeypatch.setattr(inventory, "scan", lambda c: pytest.fail("read the host again"))
    assert start_inventory(config) == first


@pytest.mark.parametrize("change", ["driver version", "gpu removed", "ld cache rebuilt", "uvm major"])
def test_a_changed_host_rebuilds_the_cache(host, change):
    tmp_path, config = host
    first = start_inventory(config)
    proc = tmp_path / "proc"
    if change == "driver version":
        text = (proc / "driver/nvidia/version").read_text()
        (proc / "driver/nvidia/version").write_text(text.replace(first.driver_version, "560.28.03"))
    elif change == "gpu removed":
        shutil.rmtree(proc / "driver/nvidia/gpus" / first.gpus[-1].bus_id)
    elif change == "ld cache rebuilt":
        os.unlink(tmp_path / "driver/usr/lib/x86_64-linux-gnu/libnvidia-ngx.so.1")
        os.unlink(tmp_path / f"driver/usr/lib/x86_64-linux-gnu/libnvidia-ngx.so.{first.driver_version}")
        os.system(f"ldconfig -r {tmp_path / 'driver'}")
    elif change == "uvm major":
        text = (proc / "devices").read_text()
        (proc / "devices").write_text(text.replace(f"{first.majors['nvidia-uvm']} nvidia-uvm", "300 nvidia-uvm"))
    second = start_inventory(config)
    assert second != first
    stored = json.loads((tmp_path / "run/inventory.json").read_text())["inventory"]
    assert stored == json.loads(json.dumps(inventory.inventory_to_dict(second)))


# Files discovery depends on besides the ld cache, installed after the first start: each must
# reach the next start without a reboot (the cache key covers their directories).
LATE_FILES = {
    "vulkan icd": ("/usr/share/vulkan/icd.d/nvidia_icd.json", "graphics"),
    "egl vendor": ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "graphics"),
    "xorg module": ("/usr/lib/xorg/modules/drivers/nvidia_drv.so", "display"),
}


@pytest.mark.parametrize("what", sorted(LATE_FILES))
def test_a_driver_data_file_installed_later_reaches_the_next_start(host, what):
    tmp_path, config = host
    path, capability = LATE_FILES[what]
    first = start_inventory(config)
    assert path not in {b.container_path for b in first.binaries}
    target = tmp_path / ("driver" + path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text('{"file_format_version": "1.0.0"}\n')
    found = {b.container_path: b.capability for b in start_inventory(config).binaries}
    assert found.get(path) == capability


def test_a_real_program_installed_later_replaces_a_wrapper(host):
    """A layout whose only nvidia-smi was a wrapper script, until the driver's own dir got the
    real one (an ELF program: here the simulated one)."""
    tmp_path, config = host
    smi = tmp_path / "driver/usr/bin/nvidia-smi"
    real = smi.read_bytes()
    smi.write_text("#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi \"$@\"\n")
    first = start_inventory(config)
    assert "/usr/bin/nvidia-smi" not in {b.container_path for b in first.binaries}
    (tmp_path / "driver/usr/local/nvidia/bin").mkdir(parents=True)
    (tmp_path / "driver/usr/local/nvidia/bin/nvidia-smi").write_bytes(real)
    found = {b.container_path: b.host_path for b in start_inventory(config).binaries}
    assert found["/usr/bin/nvidia-smi"] == str(tmp_path / "driver/usr/local/nvidia/bin/nvidia-smi")


def test_nvml_facts_survive_a_driver_file_installed_later(host, sim_host, monkeypatch):
    """Facts NVML gave depend on the driver and the GPUs only: a new data file rebuilds the
    inventory but loads no NVML again."""
    tmp_path, config = host
    config = cfg.from_mapping({**{k.replace("_", "-"): v for k, v in config.as_dict().items()},
                               "nvml-library": sim_host["nvml_library"]})
    facts, source = start_facts(config)
    assert source == inventory.QUERIED
    target = tmp_path / "driver/usr/share/vulkan/icd.d/nvidia_icd.json"
    target.parent.mkdir(parents=True)
    target.write_text("{}\n")
    monkeypatch.setattr(inventory, "_query_nvml", lambda c: pytest.fail("asked NVML again"))
    again, source = start_facts(config)
    assert (again, source) == (facts, inventory.CACHED)
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in {b.container_path for b in start_inventory(config).binaries}


def test_a_cold_start_on_a_host_without_mig_instances_loads_no_nvml(gpus, sim_host):
    """The driver makes mig/config, mig/monitor and a gpu<minor>/mig directory on every host:
    an H200 with MIG off lists them (so does the simulated host). Only a GPU instance's
    access file means MIG devices exist; without one, nothing in this start needs NVML."""
    caps = proc.capabilities(f"{sim_host['directory']}/proc")
    assert "mig/config" in caps and not any("/gi" in path for path in caps)
    gpus.configure(health={"mode": "off"})
    result = gpus.run("cold-no-mig", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    record = gpus.log_lines()[-1]
    assert record["decision"] == "gpus injected" and record["nvml"] == "not loaded", record


def test_damaged_cache_is_rebuilt(host):
    tmp_path, config = host
    first = start_inventory(config)
    for damage in ("{not json", json.dumps({"key": inventory.fingerprint(config, first.driver_version),
                                            "inventory": {"gpus": "wrong"}})):
        (tmp_path / "run/inventory.json").write_text(damage)
        assert start_inventory(config) == first


def test_ipc_sockets_are_looked_up_on_every_start(host, sim_host):
    tmp_path, config = host
    assert start_inventory(config).ipc == ()  # the copy has no persistenced socket
    real = cfg.from_mapping({**{k.replace("_", "-"): v for k, v in config.as_dict().items()},
                             "driver-root": f"{sim_host['directory']}/driver"})
    assert [f.kind for f in start_inventory(real).ipc] == ["socket"]


def test_unwritable_state_dir_still_works(host):
    tmp_path, config = host
    (tmp_path / "run").write_text("a file where the directory should be")
    assert start_inventory(config).gpus


def test_a_preloaded_cache_serves_the_next_read_only_while_the_host_is_unchanged(host, monkeypatch):
    """gpuhook.agent's spare preloads the cache while it waits: the start still takes the
    host's fingerprint, and uses the preloaded document only when it is the same."""
    tmp_path, config = host
    first = start_inventory(config)
    inventory.preload(config)
    real_read = inventory.files.read
    monkeypatch.setattr(inventory.files, "read", lambda path, *a: pytest.fail(f"read {path} again"))
    assert inventory.read(config)[0] == first  # served from the preload, which is used up
    assert not inventory._PRELOADED
    monkeypatch.setattr(inventory.files, "read", real_read)
    inventory.preload(config)
    version = tmp_path / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace(first.driver_version, "560.28.03"))
    found, _, _, pending = inventory.read(config)
    assert found.driver_version == "560.28.03" and pending is not None  # the host changed: scanned again
    inventory.preload(None)  # no configuration loaded: nothing kept
    assert not inventory._PRELOADED
