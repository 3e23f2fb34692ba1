"""crun runs gpuhook, on cgroup v1 only (docs/runtime-facts.md §2).

crun refuses this machine's hybrid cgroup layout (v1 controllers plus cgroup2 at
/sys/fs/cgroup/unified), so every crun command runs in a private mount namespace with the v2
mount unmounted (reference doc section 2). crun hands hooks a state of its own: ociVersion
"1.0", status "created", the config's root.path in an extra `root` member.
"""

import json
import os

import pytest

from conftest import LIBDIR, GpuContainers, require, require_root_tools
from helpers.runtimes import (STRICT_POLICY, gpu_nodes, gpuhook_cli, log_records, other_gpu_node, registered,
                              start_with_runtime_node)

from helpers import testbed

pytestmark = pytest.mark.root

UNIFIED = "/sys/fs/cgroup/unified"
# argv prefix: a private mount namespace without the cgroup2 mount, then the crun command.
CGROUP_V1_ONLY = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                  f'umount {UNIFIED} && exec "$@"', "crun-v1"]
OTHER = "/dev/other-gpu"


def hybrid_cgroup_layout() -> bool:
    with open("/proc/self/mountinfo") as f:
        fields = [line.split() for line in f]
    v2_at_unified = any(parts[4] == UNIFIED and "cgroup2" in parts for parts in fields)
    v1_devices = any(parts[parts.index("-") + 1] == "cgroup" and "devices" in parts[-1].split(",")
                     for parts in fields)
    return v2_at_unified and v1_devices


@pytest.fixture
def crun_gpus(sim_host, probe, tmp_path):
    require_root_tools("crun", "unshare")
    require(hybrid_cgroup_layout(), f"needs the hybrid cgroup layout (v1 devices controller, cgroup2 at {UNIFIED})")
    bed = testbed.Testbed(str(tmp_path / "bed"), runc="crun", wrapper=CGROUP_V1_ONLY)
    return GpuContainers(bed, sim_host, probe, tmp_path)


def capture_state(path):
    """An edit that adds a first prestart hook saving the state crun passes to hooks."""
    def edit(spec):
        spec["hooks"]["prestart"].insert(0, {"path": "/bin/sh", "args": ["sh", "-c", f"cat > {path}"]})
        spec["root"]["path"] = "rootfs"  # relative, as crun's state then reports it
    return edit


def test_crun_runs_the_hook_with_its_own_state_format(crun_gpus, tmp_path):
    state_file = tmp_path / "crun-state.json"
    result = crun_gpus.run("crun-gpu0", env=["NVIDIA_VISIBLE_DEVICES=0"], before=other_gpu_node(2),
                           paths=[OTHER, f"{LIBDIR}/libcuda.so.1"], edit=capture_state(state_file))
    assert result.returncode == 0, result.stderr
    state = json.loads(state_file.read_text())
    assert state["status"] == "created" and state["root"] == "rootfs" and state["id"] == "crun-gpu0"
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia0"} and p["/dev/nvidia0"]["read"] == "ENXIO"
    assert p[OTHER]["read"] == "EPERM"
    assert p[f"{LIBDIR}/libcuda.so.1"]["type"] == "reg"
    (line,) = crun_gpus.log_lines()
    assert line["decision"] == "gpus injected" and line["cgroup"] == "v1"


def test_crun_runs_the_hook_as_create_runtime(crun_gpus):
    result = crun_gpus.run("crun-create-runtime", env=["NVIDIA_VISIBLE_DEVICES=1"], stage="createRuntime")
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia1"}


@pytest.mark.parametrize("policy", [{}, STRICT_POLICY], ids=["default-policy", "strict-policy"])
@pytest.mark.parametrize("access", [None, "r"], ids=["not-allowed", "read-only"])
def test_a_gpu_node_crun_did_not_open_is_never_opened_by_the_hook(crun_gpus, policy, access):
    """crun writes linux.resources.devices to devices.allow/deny in order; a GPU node it left
    shut (or read-only) stays so with the hook."""
    start_with_runtime_node(crun_gpus, f"crun-runtime-node-{access}-{len(policy)}", policy, access)


def test_crun_container_without_request_is_untouched(crun_gpus):
    result = crun_gpus.run("crun-plain")
    assert result.returncode == 0, result.stderr
    assert not any(item["exists"] for path, item in result.probes().items() if path.startswith("/dev/nvidia"))
    assert crun_gpus.log_lines() == []


def test_bundle_registered_with_gpuhook_install_runs_under_crun(crun_gpus):
    bed = crun_gpus.bed
    rootfs = bed.rootfs(f"{bed.workdir}/bundles/installed/rootfs", files={"/bin/probe": crun_gpus.probe})
    bundle = bed.bundle("installed", ["/bin/probe", "/dev/nvidia3", "/dev/nvidia0"],
                        env=["NVIDIA_VISIBLE_DEVICES=3"], rootfs=rootfs)
    gpuhook_cli("install", "runc-bundle", bundle, "--config", crun_gpus.config)
    result = bed.run(bundle, "installed")  # crun run, then crun delete: the poststop hook
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia3"}
    assert [(line["stage"], line["decision"]) for line in crun_gpus.log_lines()] == \
        [("prestart", "gpus injected"), ("poststop", "cleaned up")]
    assert log_records(crun_gpus, "poststop")[0]["container"] == "installed"
    assert not registered(crun_gpus, "installed")
    gpuhook_cli("uninstall", "runc-bundle", bundle)
    assert not os.path.exists(f"{bundle}/config.json.gpuhook-bak")
    with open(f"{bundle}/config.json") as f:
        assert "hooks" not in json.load(f)


def test_a_container_without_a_cgroup_of_its_own_gets_no_grant_in_its_callers_cgroup(sim_host, probe, tmp_path):
    """Attacker pass 6: `crun --cgroup-manager=disabled` (and `podman --cgroups=disabled`)
    leave the container in the cgroup of whoever started crun, here a host service's devices
    cgroup that denies GPUs. gpuhook wrote its allow rules there: every process of that
    service could open GPU 0 while the container ran. The container now gets no grant (the
    service's rules stay exactly as they were), with a note in the log."""
    require_root_tools("crun", "unshare")
    require(hybrid_cgroup_layout(), f"needs the hybrid cgroup layout (v1 devices controller, cgroup2 at {UNIFIED})")
    service = f"/sys/fs/cgroup/devices/gpuhook-service-{os.getpid()}"
    os.makedirs(service)
    try:
        for name, rule in (("deny", "a"), ("allow", "c *:* m"), ("allow", "b *:* m"), ("allow", "c 1:* rwm"),
                           ("allow", "c 5:* rwm"), ("allow", "c 136:* rwm")):
            with open(f"{service}/devices.{name}", "w") as f:
                f.write(rule)
        before = open(f"{service}/devices.list").read()
        crun = tmp_path / "crun-no-cgroup"
        crun.write_text('#!/bin/sh\nexec crun --cgroup-manager=disabled "$@"\n')
        crun.chmod(0o755)
        wrapper = ["sh", "-c", f'echo $$ > {service}/cgroup.procs && exec "$@"', "in-service", *CGROUP_V1_ONLY]
        gpus = GpuContainers(testbed.Testbed(str(tmp_path / "bed"), runc=str(crun), wrapper=wrapper), sim_host,
                             probe, tmp_path)
        result = gpus.run("no-own-cgroup", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert result.returncode == 0, result.stderr
        assert result.probes()["/dev/nvidia0"]["read"] == "EPERM"  # the service's rules, as without the hook
        assert open(f"{service}/devices.list").read() == before
        (record,) = log_records(gpus, "prestart")
        assert not record.get("rules_added") and any("no cgroup grant" in n for n in record["notes"]), record
        # Nor a grant record: its planned rules would keep another container's grant in the
        # service's cgroup alive for as long as this one runs (attacker pass 7).
        assert not os.path.isdir(tmp_path / "run" / "grants") or not os.listdir(tmp_path / "run" / "grants")
    finally:
        with open(f"{service}/cgroup.procs") as f:
            for pid in f.read().split():
                with open("/sys/fs/cgroup/devices/cgroup.procs", "w") as root:
                    root.write(pid)
        os.rmdir(service)
