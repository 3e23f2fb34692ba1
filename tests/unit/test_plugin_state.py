"""What the device plugin keeps between calls (gpuhook.plugin.server): the health table, the
allocations' tokens, and the details of its errors. docs/device-plugin.md."""

import pytest

from conftest import STRICT

if not STRICT:  # under CI a missing grpcio fails the import below instead of skipping
    pytest.importorskip("grpc", reason="the device plugin needs grpcio (pip install -e '.[plugin]')")

from gpuhook.plugin.server import HEALTHY, UNHEALTHY, Allocations, Devices, details  # noqa: E402

IDS = ["GPU-0", "GPU-1"]


def test_ids_the_plugin_never_advertised_never_enter_its_health_table():
    devices = Devices(IDS, {ident: ident for ident in IDS})
    for i in range(1000):
        devices.set(f"GPU-made-up-{i}", False, "x")
    devices.set("GPU-1", False, "ecc")
    assert devices.health == {"GPU-0": HEALTHY, "GPU-1": UNHEALTHY}
    assert devices.reasons == {"GPU-1": "ecc"} and devices.version == 1


def test_each_allocation_gets_its_own_secret_token_by_exact_device_set():
    allocations = Allocations(limit=3)
    first = allocations.new(["GPU-0", "GPU-1"])
    assert len(first) == 32 and set(first) <= set("0123456789abcdef")
    assert allocations.token(["GPU-1", "GPU-0"]) == first  # kubelet's order is not the plugin's
    assert allocations.token(["GPU-0"]) is None  # a subset is another allocation
    second = allocations.new(["GPU-1", "GPU-0"])
    assert second != first and allocations.token(["GPU-0", "GPU-1"]) == second  # the newest is being started


def test_the_allocation_table_is_bounded_oldest_first():
    allocations = Allocations(limit=3)
    tokens = [allocations.new([f"GPU-{i}"]) for i in range(5)]
    assert [allocations.token([f"GPU-{i}"]) for i in range(5)] == [None, None] + tokens[2:]
    assert len(allocations.tokens) == 3


def test_error_details_are_printable_and_fit_grpcs_header():
    assert details("GPU-0 failed\n\x1b[31m") == "GPU-0 failed??[31m"
    long = details("x" * 100_000)
    assert len(long) == 1000 and long.endswith("…")
