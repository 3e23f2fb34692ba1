"""What the device plugin keeps between calls (gpuhook.plugin.server): the health table and
the details of its errors. docs/device-plugin.md."""

import pytest

from conftest import STRICT

if not STRICT:  # under CI a missing grpcio fails the import below instead of skipping
    pytest.importorskip("grpc", reason="the device plugin needs grpcio (pip install -e '.[plugin]')")

from gpuhook.plugin.server import HEALTHY, UNHEALTHY, Devices, details  # noqa: E402

IDS = ["GPU-0", "GPU-1"]


def test_ids_the_plugin_never_advertised_never_enter_its_health_table():
    devices = Devices(IDS, {ident: ident for ident in IDS})
    for i in range(1000):
        devices.set(f"GPU-made-up-{i}", False, "x")
    devices.set("GPU-1", False, "ecc")
    assert devices.health == {"GPU-0": HEALTHY, "GPU-1": UNHEALTHY}
    assert devices.reasons == {"GPU-1": "ecc"} and devices.version == 1


def test_error_details_are_printable_and_fit_grpcs_header():
    assert details("GPU-0 failed\n\x1b[31m") == "GPU-0 failed??[31m"
    long = details("x" * 100_000)
    assert len(long) == 1000 and long.endswith("…")
