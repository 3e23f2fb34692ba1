"""Never more GPUs than granted, in real runc containers on the simulated host.

Every container sets NVIDIA_VISIBLE_DEVICES=all, as every CUDA image does. The grant comes
from the orchestrator's channel: a device-plugin CDI annotation, a DRA claim resolved
through a CDI spec, or the nodes the runtime already put in linux.devices. The container
must get exactly the granted GPU: its node opens with ENXIO, GPU 0 is absent, and a GPU 0
node the container makes itself gives EPERM (the cgroup grants nothing more).
"""

import json
import os

import pytest

from conftest import require_root_tools
from helpers.runtimes import STRICT_POLICY, start_with_runtime_node

pytestmark = pytest.mark.root

ALL = ["NVIDIA_VISIBLE_DEVICES=all"]
GPU0_BY_HAND = "mknod /dev/gpu0-by-hand c {major} {minor}"


def run(gpus, name, **kwargs):
    sim = gpus.sim
    before = GPU0_BY_HAND.format(major=sim["majors"]["nvidia"], minor=sim["gpus"][0]["minor"])
    result = gpus.run(name, env=ALL, before=before, paths=["/dev/gpu0-by-hand"], **kwargs)
    assert result.returncode == 0, result.stderr
    return result.probes()


def assert_only_gpu1(probes):
    nodes = {p for p, item in probes.items() if p.startswith("/dev/nvidia") and p[11:].isdigit() and item["exists"]}
    assert nodes == {"/dev/nvidia1"}, nodes
    assert probes["/dev/nvidia1"]["read"] == "ENXIO"
    assert probes["/dev/gpu0-by-hand"]["read"] == "EPERM"


def test_the_device_plugins_cdi_annotation_is_the_grant(gpus):
    require_root_tools("runc")
    annotations = {"cdi.k8s.io/nvidia-device-plugin_uid": f"k8s.device-plugin.nvidia.com/gpu={gpus.uuid(1)}"}
    assert_only_gpu1(run(gpus, "cdi-annotation", annotations=annotations))


def test_a_dra_claim_is_resolved_through_its_cdi_spec(gpus, tmp_path):
    require_root_tools("runc")
    sim = gpus.sim
    specs = tmp_path / "cdi"
    specs.mkdir(mode=0o755)
    claim = {"cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/claim",
             "devices": [{"name": "4f1c-gpu-0", "containerEdits": {"deviceNodes": [
                 {"path": "/dev/nvidia1", "type": "c", "major": sim["majors"]["nvidia"],
                  "minor": sim["gpus"][1]["minor"]}]}}]}
    (specs / "k8s.gpu.nvidia.com-claim_4f1c.json").write_text(json.dumps(claim))
    os.chmod(specs / "k8s.gpu.nvidia.com-claim_4f1c.json", 0o644)
    gpus.configure(**{"cdi-spec-dirs": [str(specs)]})
    annotations = {"cdi.k8s.io/k8s.gpu.nvidia.com_claim": "k8s.gpu.nvidia.com/claim=4f1c-gpu-0"}
    assert_only_gpu1(run(gpus, "dra-claim", annotations=annotations))

    # An unknown claim fails the start, naming it; it never falls back to the environment.
    result = gpus.run("dra-unknown", env=ALL, annotations={"cdi.k8s.io/x": "k8s.gpu.nvidia.com/claim=gone-gpu-0"})
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert "k8s.gpu.nvidia.com/claim=gone-gpu-0" in line and "no CDI spec" in line, line


def test_nodes_the_runtime_injected_are_the_grant(gpus):
    """As containerd and CRI-O do after resolving CDI: the node is in linux.devices and
    runc allows it in the cgroup; the image's `all` must not add the other GPUs."""
    require_root_tools("runc")
    sim = gpus.sim
    major, minor = sim["majors"]["nvidia"], sim["gpus"][1]["minor"]

    def inject(spec):
        spec["linux"].setdefault("devices", []).append(
            {"path": "/dev/nvidia1", "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0})
        spec["linux"].setdefault("resources", {}).setdefault("devices", []).append(
            {"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"})

    probes = run(gpus, "runtime-devices", edit=inject)
    assert_only_gpu1(probes)
    (record,) = [r for r in gpus.log_lines() if r.get("container") == "runtime-devices"]
    assert record["channel"] == "runtime devices (linux.devices)" and record["gpus"] == [gpus.uuid(1)]



@pytest.mark.parametrize("policy", [{}, STRICT_POLICY], ids=["default-policy", "strict-policy"])
@pytest.mark.parametrize("access", [None, "r"], ids=["not-allowed", "read-only"])
def test_a_gpu_node_the_runtime_did_not_open_is_never_opened_by_the_hook(gpus, policy, access):
    """/dev/nvidia2 in linux.devices that runc's default deny (or a read-only rule) leaves shut:
    without the hook its open gives EPERM, and with the hook it still does. A node the rules do
    not open at all is no grant (the image's NVIDIA_VISIBLE_DEVICES=0 is the request, where
    the policy takes it); a read-only one is the grant, read-only."""
    require_root_tools("runc")
    start_with_runtime_node(gpus, f"runtime-node-{access}-{len(policy)}", policy, access)


def test_runtime_nodes_the_policy_refuses_are_not_replaced_by_the_images_all(gpus):
    """accept-runtime-devices = false: the runtime's grant of GPU 1 is not taken, and the
    image's NVIDIA_VISIBLE_DEVICES=all does not take its place; the container keeps exactly
    what the runtime gave it and nothing of the hook's."""
    require_root_tools("runc")
    from helpers.runtimes import runtime_node

    sim = gpus.sim
    gpus.configure(**{"accept-runtime-devices": False})
    probes = run(gpus, "runtime-devices-refused",
                 edit=runtime_node("/dev/nvidia1", sim["majors"]["nvidia"], sim["gpus"][1]["minor"], "rwm"))
    assert_only_gpu1(probes)  # the runtime's own node and rule, GPU 0 made by hand denied
    assert not probes["/dev/nvidiactl"]["exists"]  # the hook added nothing
    (record,) = [r for r in gpus.log_lines() if r.get("container") == "runtime-devices-refused"]
    assert "NVIDIA_VISIBLE_DEVICES not honoured either" in record["notes"][-1]


@pytest.mark.parametrize("channel", ["env", "cdi-annotation"])
@pytest.mark.parametrize("minor,access", [("*", "r"), ("gpu", "m")], ids=["every-gpu-read-only", "this-gpu-mknod-only"])
def test_a_gpu_the_runtimes_rules_name_keeps_exactly_their_letters_whatever_the_channel(gpus, channel, minor, access):
    """Attacker findings A04, A10, A14: a runtime rule naming the GPU (`allow c 195:* r`, or `m`
    alone as `podman --device …:m` writes it) with no node in linux.devices; the request comes
    from the image's environment or a CDI annotation. gpuhook added `c 195:N rw`, so a GPU the
    runtime opened read-only, or not at all, opened read-write. It keeps their letters now."""
    require_root_tools("runc")
    sim = gpus.sim
    major, gpu_minor = sim["majors"]["nvidia"], sim["gpus"][1]["minor"]

    def rule(spec):
        spec["linux"].setdefault("resources", {}).setdefault("devices", []).append(
            {"allow": True, "type": "c", "major": major, **({} if minor == "*" else {"minor": gpu_minor}),
             "access": access})

    request = ({"env": ["NVIDIA_VISIBLE_DEVICES=1"]} if channel == "env" else
               {"env": [], "annotations": {"cdi.k8s.io/req": f"nvidia.com/gpu={gpus.uuid(1)}"}})
    result = gpus.run(f"named-{channel}-{access}", edit=rule, **request)
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert probes["/dev/nvidia1"]["exists"]
    assert probes["/dev/nvidia1"]["read"] == ("ENXIO" if "r" in access else "EPERM")
    assert probes["/dev/nvidia1"]["write"] == "EPERM"
    (record,) = [r for r in gpus.log_lines() if r.get("container") == f"named-{channel}-{access}"]
    assert any("narrowed to the runtime's own rules for that device" in n for n in record["notes"]), record["notes"]
