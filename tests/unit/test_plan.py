"""make_plan is pure: literal inventory in, literal plan out."""

import json

import pytest

from gpuhook import config as cfg
from gpuhook.request import oci
from gpuhook.request import resolve as req
from gpuhook.discover.container import ContainerFacts
from gpuhook.discover.types import Gpu, HostFile, Inventory, Library
from gpuhook.discover.driverfiles import HostLdconfig
from gpuhook.errors import HostError, RequestError
from gpuhook.plan.make import make_plan
from gpuhook.plan.render import render_text
from gpuhook.discover.survey import Host

GPUS = (Gpu(0, "GPU-a", 0, "0000:18:00.0", "Sim"), Gpu(1, "GPU-b", 3, "0000:28:00.0", "Sim"))
INV = Inventory(
    driver_version="550.54.15",
    gpus=GPUS,
    majors={"nvidia": 195, "nvidia-uvm": 510},
    libraries=(
        Library("/d/libcuda.so.550.54.15", "libcuda.so.550.54.15", ("libcuda.so.1", "libcuda.so"), "compute", 64),
        Library("/d/libnvidia-ml.so.550.54.15", "libnvidia-ml.so.550.54.15", ("libnvidia-ml.so.1",), "utility", 64),
        Library("/d/32/libcuda.so.550.54.15", "libcuda.so.550.54.15", ("libcuda.so.1",), "compute", 32),
        Library("/d/libnvcuvid.so.550.54.15", "libnvcuvid.so.550.54.15", ("libnvcuvid.so.1",), "video", 64),
    ),
    binaries=(HostFile("/d/bin/nvidia-smi", "/usr/bin/nvidia-smi", "utility", "file"),),
    firmware=(HostFile("/d/fw/gsp.bin", "/lib/firmware/nvidia/550.54.15/gsp.bin", "firmware", "file"),),
    ipc=(HostFile("/d/run/socket", "/var/run/nvidia-persistenced/socket", "utility", "socket"),
         HostFile("/d/tmp/nvidia-mps", "/tmp/nvidia-mps", "compute", "dir")),
    proc_driver_dir="/proc/driver/nvidia",
)
STATE = oci.State("1.0.2", "c1", "creating", 77, "/b", {})


GLIBC_IMAGE = ContainerFacts("/usr/lib64", "/usr/lib", True)


NODE_PATHS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset", "/dev/nvidia0",
              "/dev/nvidia3")


def host(container=GLIBC_IMAGE, node_info=lambda p: None, inventory=INV) -> Host:
    """A literal survey.Host: what discovery would have found."""
    nodes = {p: node_info(p) for p in NODE_PATHS if node_info(p) is not None}
    ldconfig = HostLdconfig("/sbin/ldconfig", None, None, None) if container.glibc else None
    return Host(inventory, None, None, container, nodes, (), None, ldconfig)


def plan_for(env, container=GLIBC_IMAGE, node_info=lambda p: None, namespaces=(), linux=None, **config):
    doc = {"root": {"path": "rootfs"}, "process": {"env": env},
           "linux": {"namespaces": [{"type": t} for t in namespaces], **(linux or {})}}
    spec = oci.parse_spec(json.dumps(doc).encode(), "/b")
    config = cfg.from_mapping(config)
    r = req.resolve(spec, {}, config)
    return make_plan(STATE, spec, r, host(container, node_info), config)


def test_compute_utility_plan():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=1"])
    assert [(n.path, n.major, n.minor) for n in plan.nodes] == [
        ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", 510, 0), ("/dev/nvidia-uvm-tools", 510, 1),
        ("/dev/nvidia3", 195, 3)]
    assert [r.v1_line() for r in plan.rules] == ["c 195:255 rw", "c 510:0 rw", "c 510:1 rw", "c 195:3 rw"]
    assert [m.target for m in plan.mounts] == [
        "/usr/lib64/libcuda.so.550.54.15", "/usr/lib64/libnvidia-ml.so.550.54.15", "/usr/bin/nvidia-smi",
        "/lib/firmware/nvidia/550.54.15/gsp.bin", "/var/run/nvidia-persistenced/socket", "/tmp/nvidia-mps"]
    assert all(m.options == ("ro", "nosuid", "nodev") for m in plan.mounts[:4])
    assert plan.mounts[4].options == ("ro", "nosuid", "nodev", "noexec")
    assert plan.mounts[5].options == ("nosuid", "nodev", "noexec") and plan.mounts[5].kind == "dir"
    assert [(s.path, s.target) for s in plan.symlinks] == [
        ("/usr/lib64/libcuda.so.1", "libcuda.so.550.54.15"), ("/usr/lib64/libcuda.so", "libcuda.so.550.54.15"),
        ("/usr/lib64/libnvidia-ml.so.1", "libnvidia-ml.so.550.54.15")]
    assert plan.ldcache.directories == ("/usr/lib64",) and plan.ldcache.ldconfig == "/sbin/ldconfig"
    assert plan.proc_mask.gpu_buses == ("0000:28:00.0",)


def test_utility_only_has_no_uvm_and_no_compute_files():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    assert [n.path for n in plan.nodes] == ["/dev/nvidiactl", "/dev/nvidia0"]
    assert not any("cuda" in m.target or "mps" in m.target for m in plan.mounts)


def test_compat32_adds_32_bit_libraries_to_the_32_bit_dir():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,compat32"])
    assert "/usr/lib/libcuda.so.550.54.15" in [m.target for m in plan.mounts]
    assert plan.ldcache.directories == ("/usr/lib64", "/usr/lib")


def test_display_adds_modeset_and_missing_libraries_are_noted():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=display,graphics"])
    assert "/dev/nvidia-modeset" in [n.path for n in plan.nodes]
    assert "no graphics libraries found in the host's ld cache" in plan.notes


def test_node_mode_and_owner_come_from_the_host_node():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0"],
                    node_info=lambda p: (0o660, 0, 44, "/host/dev/nvidia0") if p == "/dev/nvidia0" else None)
    modes = {n.path: (n.mode, n.gid) for n in plan.nodes}
    assert modes["/dev/nvidia0"] == (0o660, 44) and modes["/dev/nvidiactl"] == (0o666, 0)


def test_missing_uvm_module_is_noted_not_fatal():
    inv = INV._replace(majors={"nvidia": 195})
    doc = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}
    spec = oci.parse_spec(json.dumps(doc).encode(), "/b")
    config = cfg.from_mapping({})
    r = req.resolve(spec, {}, config)
    plan = make_plan(STATE, spec, r, host(inventory=inv), config)
    assert "/dev/nvidia-uvm" not in [n.path for n in plan.nodes]
    assert any("nvidia-uvm is not loaded" in n for n in plan.notes)


def test_plan_renders_as_text_and_json():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=all"])
    text = render_text(plan)
    assert "request: all via env NVIDIA_VISIBLE_DEVICES" in text and "/dev/nvidia3" in text
    doc = json.loads(json.dumps(plan.as_dict()))
    assert doc["device_nodes"][0] == {"path": "/dev/nvidiactl", "major": 195, "minor": 255, "mode": "0666",
                                      "uid": 0, "gid": 0, "host_path": None}
    assert doc["user_namespace"] is False
    assert doc["cgroup_rules"][0] == {"type": "c", "major": 195, "minor": 255, "access": "rw", "allow": True}
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-a", "GPU-b"]


def test_image_without_glibc_gets_no_ld_cache_update():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0"], container=ContainerFacts("/usr/lib64", "/usr/lib", False))
    assert plan.ldcache is None and any("no glibc" in n for n in plan.notes)
    assert "/usr/lib64/libcuda.so.550.54.15" in [m.target for m in plan.mounts]


def test_a_glibc_image_on_a_host_without_a_static_ldconfig_is_refused_at_planning():
    """Before anything changes (and so in --dry-run too), with discovery's reason and hint."""
    doc = {"root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}
    spec = oci.parse_spec(json.dumps(doc).encode(), "/b")
    config = cfg.from_mapping({})
    missing = HostLdconfig(None, None, "no static ldconfig on this host (looked for /sbin/ldconfig.real, ...)",
                           "install glibc's ldconfig")
    with pytest.raises(HostError) as err:
        make_plan(STATE, spec, req.resolve(spec, {}, config), host()._replace(ldconfig=missing), config)
    assert err.value.one_line() == ("no static ldconfig on this host (looked for /sbin/ldconfig.real, ...) "
                                    "(install glibc's ldconfig)")
    wrapper = HostLdconfig("/sbin/ldconfig.real", "host ldconfig: /sbin/ldconfig.real", None, None)
    plan = make_plan(STATE, spec, req.resolve(spec, {}, config), host()._replace(ldconfig=wrapper), config)
    assert plan.ldcache.ldconfig == "/sbin/ldconfig.real" and "host ldconfig: /sbin/ldconfig.real" in plan.notes


def test_user_namespaced_container_gets_device_nodes_bound_from_where_discovery_found_them():
    found = lambda p: (0o666, 0, 0, "/drv/dev" + p[4:]) if p != "/dev/nvidiactl" else (0o666, 0, 0, p)
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=1"], namespaces=("mount", "user"), node_info=found)
    assert plan.userns is True
    assert [(n.path, n.host_path) for n in plan.nodes] == [
        ("/dev/nvidiactl", "/dev/nvidiactl"), ("/dev/nvidia-uvm", "/drv/dev/nvidia-uvm"),
        ("/dev/nvidia-uvm-tools", "/drv/dev/nvidia-uvm-tools"), ("/dev/nvidia3", "/drv/dev/nvidia3")]
    assert all(n.host_path is None for n in plan_for(["NVIDIA_VISIBLE_DEVICES=1"], node_info=found).nodes)


def test_user_namespaced_container_needs_the_host_nodes():
    from gpuhook.errors import HostError

    with pytest.raises(HostError, match="must be bound into a container with a user namespace"):
        plan_for(["NVIDIA_VISIBLE_DEVICES=1"], namespaces=("user",))


def test_empty_request_plans_nothing():
    plan = plan_for(["PATH=/bin"])
    assert plan.empty and plan.nodes == () and plan.mounts == () and plan.ldcache is None
    assert "untouched" in render_text(plan)


def test_the_health_step_is_part_of_the_plan_and_of_the_dry_run():
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=all"])
    assert plan.health.mode == "fallback" and plan.health.gpus == ("GPU-a", "GPU-b")
    assert plan.as_dict()["health"]["gpus"] == ["GPU-a", "GPU-b"]
    assert "health (fallback, on failure: fail): while the rest is applied, check and repair GPU-a, GPU-b" \
        in render_text(plan)
    assert plan_for(["NVIDIA_VISIBLE_DEVICES=all"], health={"mode": "off"}).health is None
    assert plan_for(["NVIDIA_VISIBLE_DEVICES=none"]).health is None  # no GPU, nothing to check


@pytest.mark.parametrize("allowed,rule", [("rwm", "c 195:3 rw"), ("r", "c 195:3 r"), ("w", "c 195:3 w")])
def test_a_grant_from_linux_devices_keeps_exactly_the_letters_the_runtime_allowed(allowed, rule):
    """podman --device /dev/nvidia3:/dev/nvidia3:r: the hook must not make it writable."""
    linux = {"devices": [{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3}],
             "resources": {"devices": [{"allow": False, "access": "rwm"},
                                       {"allow": True, "type": "c", "major": 195, "minor": 3, "access": allowed}]}}
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=all"], linux=linux)
    assert plan.channel == req.RUNTIME_DEVICES and [g.index for g in plan.gpus] == [1]
    # The driver's control nodes are the hook's to add; the GPU's letters are the runtime's.
    assert [r.v1_line() for r in plan.rules] == ["c 195:255 rw", "c 510:0 rw", "c 510:1 rw", rule]


def test_a_foreign_node_with_an_nvidia_name_leaves_the_environments_gpu_its_rule():
    """/dev/nvidia1 as c 1:3 is no NVIDIA node: the environment picks GPU 0, which is then no
    grant of the runtime's, and keeps its rule."""
    linux = {"devices": [{"path": "/dev/nvidia1", "type": "c", "major": 1, "minor": 3}],
             "resources": {"devices": [{"allow": False, "access": "rwm"},
                                       {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"}]}}
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=0"], linux=linux)
    assert [g.index for g in plan.gpus] == [0] and "c 195:0 rw" in [r.v1_line() for r in plan.rules]


def test_a_node_the_runtime_explicitly_denies_is_refused_not_granted():
    """Issue 23, G1: `allow a *:* rwm` then `deny c 195:0 rwm`. GPU 0 (index 0, minor 0) is
    refused at planning with a request error (exit 3); GPU 1 is planned, with no rule for
    195:0; a denied control node refuses every GPU."""
    def linux(*denied):
        return {"resources": {"devices": [{"allow": True, "access": "rwm"}] + [
            {"allow": False, "type": "c", "major": 195, "minor": m, "access": "rwm"} for m in denied]}}

    with pytest.raises(RequestError) as refused:
        plan_for(["NVIDIA_VISIBLE_DEVICES=0"], linux=linux(0))
    assert refused.value.exit_code == 3
    assert "deny c 195:0 rw (/dev/nvidia0)" in str(refused.value)
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=1"], linux=linux(0))
    assert [g.index for g in plan.gpus] == [1] and "c 195:0" not in " ".join(r.v1_line() for r in plan.rules)
    with pytest.raises(RequestError, match="/dev/nvidiactl"):
        plan_for(["NVIDIA_VISIBLE_DEVICES=1"], linux=linux(255))


@pytest.mark.parametrize("extra,kept", [
    ({"type": "c", "major": 195, "access": "r"}, "c 195:3 r"),              # every GPU read-only
    ({"type": "c", "major": 195, "minor": 3, "access": "m"}, None),          # mknod only: not opened
    ({"type": "c", "major": 195, "minor": 255, "access": "r"}, None),        # another device: untouched
])
def test_a_gpu_the_runtimes_rules_name_is_never_widened_by_the_environment(extra, kept):
    """Attacker findings A10/A14: a request from the environment (or any channel) never adds
    letters to a device the runtime's rules name; one left with none is not granted."""
    linux = {"resources": {"devices": [{"allow": False, "access": "rwm"}, {"allow": True, **extra}]}}
    plan = plan_for(["NVIDIA_VISIBLE_DEVICES=1"], linux=linux)
    gpu_rules = [r.v1_line() for r in plan.rules if (r.major, r.minor) == (195, 3)]
    if extra.get("minor") == 255:
        assert gpu_rules == ["c 195:3 rw"] and "c 195:255 r" in [r.v1_line() for r in plan.rules]
    else:
        assert gpu_rules == ([kept] if kept else [])
        assert any("narrowed to the runtime's own rules for that device" in n for n in plan.notes)
