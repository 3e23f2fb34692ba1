"""The host inventory cache: used while the host is unchanged, rebuilt when it changes."""

import json
import os
import shutil

import pytest

from gpuhook import config as cfg
from gpuhook import discover, inventory


@pytest.fixture
def host(tmp_path, sim_host):
    """A private copy of the simulated host's proc and driver trees (tests edit them)."""
    src = sim_host["directory"]
    shutil.copytree(f"{src}/proc", tmp_path / "proc")
    shutil.copytree(f"{src}/driver", tmp_path / "driver", symlinks=True, ignore=shutil.ignore_patterns("socket"))
    config = cfg.from_mapping({"driver-root": str(tmp_path / "driver"), "dev-root": f"{src}/dev",
                               "proc-root": str(tmp_path / "proc"), "state-dir": str(tmp_path / "run")})
    return tmp_path, config


def test_second_load_uses_the_cache(host, monkeypatch):
    tmp_path, config = host
    first = inventory.load(config)
    assert os.path.exists(tmp_path / "run" / "inventory.json")
    monkeypatch.setattr(discover, "inventory", lambda c: pytest.fail("read the host again"))
    assert inventory.load(config) == first


@pytest.mark.parametrize("change", ["driver version", "gpu removed", "ld cache rebuilt", "uvm major"])
def test_a_changed_host_rebuilds_the_cache(host, change):
    tmp_path, config = host
    first = inventory.load(config)
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
    second = inventory.load(config)
    assert second != first
    stored = json.loads((tmp_path / "run/inventory.json").read_text())["inventory"]
    assert stored == json.loads(json.dumps(discover.inventory_to_dict(second)))


def test_damaged_cache_is_rebuilt(host):
    tmp_path, config = host
    first = inventory.load(config)
    for damage in ("{not json", json.dumps({"key": inventory.fingerprint(config, first.driver_version),
                                            "inventory": {"gpus": "wrong"}})):
        (tmp_path / "run/inventory.json").write_text(damage)
        assert inventory.load(config) == first


def test_ipc_sockets_are_looked_up_on_every_start(host, sim_host):
    tmp_path, config = host
    assert inventory.load(config).ipc == ()  # the copy has no persistenced socket
    real = cfg.from_mapping({**{k.replace("_", "-"): v for k, v in config.as_dict().items()},
                             "driver-root": f"{sim_host['directory']}/driver"})
    assert [f.kind for f in inventory.load(real).ipc] == ["socket"]


def test_unwritable_state_dir_still_works(host):
    tmp_path, config = host
    (tmp_path / "run").write_text("a file where the directory should be")
    assert inventory.load(config).gpus
