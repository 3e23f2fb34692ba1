"""The device plugin's GetPreferredAllocation choice (gpuhook.plugin.server.preferred): health,
stamps, and NUMA topology, on literal device sets."""

import os
import time

import pytest

from conftest import STRICT

if not STRICT:  # under CI a missing grpcio fails the import below instead of skipping
    pytest.importorskip("grpc", reason="the device plugin needs grpcio (pip install -e '.[plugin]')")

from gpuhook.health import store  # noqa: E402
from gpuhook.plugin.server import UNHEALTHY, Devices, preferred  # noqa: E402

# Eight GPUs, two NUMA nodes of four, as on a two-socket server.
IDS = [f"GPU-{i}" for i in range(8)]
NUMA = {ident: i // 4 for i, ident in enumerate(IDS)}


def devices(numa=NUMA) -> Devices:
    return Devices(IDS, {ident: ident for ident in IDS}, numa)


def stamp(state_dir, ident, age_seconds) -> None:
    path = store.stamp_path(str(state_dir), ident, "0123456789abcdef0123456789abcdef")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w"):
        pass
    when = time.time() - age_seconds
    os.utime(path, (when, when))


def test_without_numa_information_index_order(tmp_path):
    assert preferred(devices({}), IDS, [], 3, str(tmp_path)) == ["GPU-0", "GPU-1", "GPU-2"]


def test_the_choice_stays_on_one_numa_node(tmp_path):
    # GPU-1 is unhealthy: node 0 still has three, so the choice stays there.
    d = devices()
    d.set("GPU-1", False, "ecc")
    assert preferred(d, IDS, [], 3, str(tmp_path)) == ["GPU-0", "GPU-2", "GPU-3"]
    # Four healthy GPUs are no longer on node 0: node 1 has them.
    assert preferred(d, IDS, [], 4, str(tmp_path)) == ["GPU-4", "GPU-5", "GPU-6", "GPU-7"]


def test_must_include_pulls_the_rest_onto_its_node(tmp_path):
    assert preferred(devices(), IDS, ["GPU-6"], 3, str(tmp_path)) == ["GPU-6", "GPU-4", "GPU-5"]


def test_recently_stamped_gpus_decide_between_nodes(tmp_path):
    stamp(tmp_path, "GPU-5", 10)
    stamp(tmp_path, "GPU-7", 20)
    assert preferred(devices(), IDS, [], 2, str(tmp_path)) == ["GPU-5", "GPU-7"]


def test_when_no_node_is_big_enough_the_best_of_all_are_taken(tmp_path):
    available = ["GPU-0", "GPU-1", "GPU-4", "GPU-5", "GPU-6"]
    assert preferred(devices(), available, [], 4, str(tmp_path)) == ["GPU-0", "GPU-1", "GPU-4", "GPU-5"]


def test_only_available_devices_and_must_include_always(tmp_path):
    chosen = preferred(devices(), ["GPU-2", "GPU-5", "GPU-6"], ["GPU-2", "GPU-5"], 1, str(tmp_path))
    assert chosen == ["GPU-2", "GPU-5"]  # kubelet asked for 1, yet both must be included


def test_an_unhealthy_gpu_comes_last_even_on_the_right_node(tmp_path):
    d = devices()
    d.set("GPU-5", False, "ecc")
    assert preferred(d, ["GPU-4", "GPU-5", "GPU-6"], ["GPU-4"], 3, str(tmp_path)) == ["GPU-4", "GPU-6", "GPU-5"]
    assert d.health["GPU-5"] == UNHEALTHY
