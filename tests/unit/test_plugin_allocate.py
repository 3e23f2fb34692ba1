"""What the device plugin's Allocate returns is what the hook's request channels accept:
for each strategy, the response turned into a container spec (as kubelet and the runtime
do) resolves to exactly the allocated devices (docs/device-plugin.md, docs/requests.md)."""

import json

import pytest

from conftest import STRICT

if not STRICT:  # under CI a missing grpcio fails the import below instead of skipping
    pytest.importorskip("grpc", reason="the device plugin needs grpcio (pip install -e '.[plugin]')")

from gpuhook import config as cfg  # noqa: E402
from gpuhook.request import oci  # noqa: E402
from gpuhook.request import resolve as req  # noqa: E402
from gpuhook.plugin import server  # noqa: E402

IDS = ["GPU-1aaaaaaa-0000-0000-0000-000000000001", "GPU-3aaaaaaa-0000-0000-0000-000000000003"]


def container_spec(response) -> oci.Spec:
    """The config.json kubelet and the runtime make of one ContainerAllocateResponse; the
    image says NVIDIA_VISIBLE_DEVICES=all, as CUDA images do."""
    doc = {"root": {"path": "rootfs"},
           "process": {"env": [f"{k}={v}" for k, v in response.envs.items()] + ["NVIDIA_VISIBLE_DEVICES=all"],
                       "capabilities": {"bounding": ["CAP_CHOWN"]}},
           "mounts": [{"destination": m.container_path, "source": m.host_path, "type": "bind", "options": ["ro"]}
                      for m in response.mounts],
           "annotations": dict(response.annotations)}
    return oci.parse_spec(json.dumps(doc).encode(), "/bundle")


@pytest.mark.parametrize("strategy,channel", [("volume-mounts", req.MOUNTS), ("cdi-annotations", req.CDI)])
def test_the_hook_grants_exactly_what_allocate_named(strategy, channel):
    pb, _ = server._api()
    r = req.resolve(container_spec(server.allocate_response(pb, IDS, strategy)), {}, cfg.from_mapping({}))
    assert (r.wants, r.ids, r.channel) == (req.GPUS, tuple(IDS), channel)


def test_the_cdi_strategies_name_gpuhooks_own_kind():
    """The runtime resolves them through gpuhook's spec, whose hook is gpuhook, never through
    NVIDIA's spec of nvidia.com/gpu (docs/cdi.md)."""
    pb, _ = server._api()
    assert [d.name for d in server.allocate_response(pb, IDS, "cdi-cri").cdi_devices] == \
        [f"gpuhook.example/gpu={i}" for i in IDS]
    assert dict(server.allocate_response(pb, IDS, "cdi-annotations").annotations) == \
        {server.CDI_ANNOTATION: ",".join(f"gpuhook.example/gpu={i}" for i in IDS)}
