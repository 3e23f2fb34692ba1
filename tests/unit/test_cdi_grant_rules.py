"""Never more GPUs than the orchestrator granted (README, "Request channels"; docs/requests.md).

The tests of it that need no root; those that do are in tests/integration/test_cdi_grant.py.
"""

import json
import os
import pytest
from gpuhook.discover import cdi
from gpuhook import config as cfg
from gpuhook.request import oci
from gpuhook import driver
from gpuhook.plan import select
from gpuhook.request import resolve as request_resolve
from gpuhook.discover.types import Gpu, Inventory
from gpuhook.errors import HostError, RequestError
from gpuhook.discover.inventory import NvmlFacts
from gpuhook.discover.types import MigDevice


GPUS = tuple(Gpu(i, f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}", i, f"0000:{i}0:00.0", "Sim") for i in range(4))


ALL = ["NVIDIA_VISIBLE_DEVICES=all"]


MAJORS = {"nvidia": 195, "nvidia-caps": 236}


def inventory(mig_minors=None):
    return Inventory("550.0", GPUS, MAJORS, (), (), (), (), "", mig_minors or {}, ())


DENY_ALL = {"allow": False, "access": "rwm"}


def spec(env=(), mounts=(), annotations=None, privileged=False, devices=(), rules=None):
    """A parsed config.json. `rules` (linux.resources.devices) default to what containerd and
    CRI-O write for the `devices` they inject: deny everything, then allow each node rwm; for
    a `privileged` container, docker --privileged's allow-all ("cap-add": CAP_SYS_ADMIN alone)."""
    caps = ["CAP_CHOWN"] + (["CAP_SYS_ADMIN"] if privileged else [])
    if rules is None and privileged is True:
        rules = [{"allow": True, "access": "rwm"}]
    if rules is None:
        rules = [DENY_ALL] + [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rwm"}
                              for d in devices]
    doc = {"root": {"path": "rootfs"}, "process": {"env": list(env), "capabilities": {"bounding": caps}},
           "mounts": list(mounts), "linux": {"devices": list(devices), "resources": {"devices": list(rules)}}}
    if annotations:
        doc["annotations"] = annotations
    return oci.parse_spec(json.dumps(doc).encode(), "/bundle")


def resolve(s, **config):
    return request_resolve.resolve(s, {}, cfg.from_mapping(config))


def chosen(request, **kwargs) -> list:
    return [g.index for g in select.select(request, GPUS, None, inventory(), **kwargs).gpus]


def node(path, major, minor):
    return {"path": path, "type": "c", "major": major, "minor": minor}


@pytest.mark.parametrize("kind", ["nvidia.com/gpu", "k8s.device-plugin.nvidia.com/gpu", "management.nvidia.com/gpu"])
def test_a_cdi_grant_of_any_nvidia_kind_wins_over_an_images_all(kind):
    granted = GPUS[1].uuid
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/nvidia-device-plugin_abc": f"{kind}={granted}"}))
    assert (r.wants, r.ids, r.channel) == (request_resolve.GPUS, (granted,), request_resolve.CDI)
    assert chosen(r) == [1]
    assert any("NVIDIA_VISIBLE_DEVICES ignored" in n for n in r.notes)


@pytest.mark.parametrize("name,is_direct", [("0", True), ("all", True), ("GPU-abc", True), ("MIG-abc", True),
                                            ("1:0", True), ("claim-1", False), ("gpu0", False)])
def test_which_cdi_names_need_a_spec(name, is_direct):
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/x": f"k8s.device-plugin.nvidia.com/gpu={name}"}))
    assert (r.ids == () if not is_direct else r.cdi == ()) and not r.empty
    if not is_direct:
        assert r.cdi == (f"k8s.device-plugin.nvidia.com/gpu={name}",)


def test_a_dra_claim_is_left_to_the_cdi_specs():
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/claim": "k8s.gpu.nvidia.com/claim=a1b2-gpu-0"}))
    assert (r.wants, r.ids, r.cdi) == (request_resolve.GPUS, (), ("k8s.gpu.nvidia.com/claim=a1b2-gpu-0",))


def test_a_refused_grant_is_not_replaced_by_the_environment():
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/x": "nvidia.com/gpu=1"}), **{"accept-cdi-annotations": False})
    assert r.empty and "NVIDIA_VISIBLE_DEVICES not honoured either" in r.notes[-1]
    r = resolve(spec(ALL, mounts=[{"destination": "/var/run/nvidia-container-devices/1", "source": "/dev/null",
                                   "type": "bind"}]), **{"accept-volume-mounts": False})
    assert r.empty


def test_the_device_plugin_sends_a_cdi_name_as_a_volume_mount():
    mount = {"destination": f"/var/run/nvidia-container-devices/cdi/k8s.device-plugin.nvidia.com/gpu/{GPUS[2].uuid}",
             "source": "/dev/null", "type": "bind", "options": ["rbind"]}
    r = resolve(spec(ALL, mounts=[mount]))
    assert (r.ids, r.channel) == ((GPUS[2].uuid,), request_resolve.MOUNTS) and chosen(r) == [2]
    claim = dict(mount, destination="/var/run/nvidia-container-devices/cdi/k8s.gpu.nvidia.com/claim/uid-gpu-0")
    assert resolve(spec(ALL, mounts=[claim])).cdi == ("k8s.gpu.nvidia.com/claim=uid-gpu-0",)


def test_an_unknown_uuid_in_a_grant_fails_naming_it():
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/x": "k8s.device-plugin.nvidia.com/gpu=GPU-gone"}))
    with pytest.raises(RequestError, match="GPU-gone.*does not exist"):
        chosen(r)


def test_nodes_the_runtime_injected_are_the_grant():
    devices = [node("/dev/nvidiactl", 195, 255), node("/dev/nvidia2", 195, 2)]
    r = resolve(spec(ALL, devices=devices))
    assert r.channel == request_resolve.RUNTIME_DEVICES
    assert [n.path for n in r.nodes] == ["/dev/nvidia2"] and chosen(r) == [2]
    assert chosen(resolve(spec(["NVIDIA_VISIBLE_DEVICES=0,1"], devices=devices))) == [2]  # the env cannot pick others
    # The env still says whether the container wants the driver at all.
    assert resolve(spec([], devices=devices)).empty
    assert resolve(spec(["NVIDIA_VISIBLE_DEVICES=none"], devices=devices)).wants == request_resolve.DRIVER_ONLY


def test_runtime_nodes_do_not_bind_a_privileged_container():
    devices = [node(f"/dev/nvidia{i}", 195, i) for i in range(4)]
    assert resolve(spec(["NVIDIA_VISIBLE_DEVICES=0"], devices=devices, privileged=True)).ids == ("0",)


def test_runtime_nodes_bind_a_container_that_only_has_cap_sys_admin():
    """CAP_SYS_ADMIN alone (a CDI grant of GPU 1 to a pod that also added SYS_ADMIN) is no
    privileged container: its runtime nodes are its grant, and the image's `all` cannot
    widen it to every GPU."""
    r = resolve(spec(ALL, devices=[node("/dev/nvidia1", 195, 1)], privileged="cap-add"))
    assert r.channel == request_resolve.RUNTIME_DEVICES and chosen(r) == [1]


def test_runtime_nodes_the_policy_refuses_are_not_replaced_by_the_environment():
    """accept-runtime-devices = false refuses the runtime's grant of GPU 1; the image's `all`
    must not then give every GPU (docs/requests.md, precedence 2)."""
    r = resolve(spec(ALL, devices=[node("/dev/nvidia1", 195, 1)]), **{"accept-runtime-devices": False})
    assert r.empty and "NVIDIA_VISIBLE_DEVICES not honoured either" in r.notes[-1]
    # No GPU node at all: the environment is the request, as before.
    assert resolve(spec(ALL, devices=[]), **{"accept-runtime-devices": False}).wants == request_resolve.ALL


@pytest.mark.parametrize("rules", [
    [],  # runc's default: deny all but its own default devices
    [DENY_ALL],
    [DENY_ALL, {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "m"}],  # a node, no open
    [DENY_ALL, {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
     {"allow": False, "type": "c", "major": 195, "minor": 0, "access": "rw"}],
])
def test_a_node_the_runtimes_rules_do_not_open_is_no_grant(rules):
    """/dev/nvidia0 in linux.devices but not opened by linux.resources.devices: it neither
    gives GPU 0 nor displaces the environment's request for GPU 1."""
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=1"], devices=[node("/dev/nvidia0", 195, 0)], rules=rules))
    assert (r.channel, r.nodes) == (request_resolve.ENV, ())
    assert chosen(r) == [1]
    assert any("/dev/nvidia0 (c 195:0) in linux.devices is no grant" in n for n in r.notes)
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=1"], devices=[node("/dev/nvidia0", 195, 0)], rules=rules),
                **{"accept-env-when-unprivileged": False})
    assert r.empty


def test_a_node_the_runtime_opens_for_reading_only_is_still_the_grant():
    devices = [node("/dev/nvidia2", 195, 2)]
    r = resolve(spec(ALL, devices=devices, rules=[DENY_ALL, {"allow": True, "type": "c", "major": 195, "minor": 2,
                                                              "access": "r"}]))
    assert (r.channel, [n.path for n in r.nodes]) == (request_resolve.RUNTIME_DEVICES, ["/dev/nvidia2"]) and chosen(r) == [2]


def test_a_granted_node_that_is_no_gpu_fails_naming_it():
    r = resolve(spec(ALL, devices=[node("/dev/nvidia7", 195, 7)]))
    with pytest.raises(RequestError, match="/dev/nvidia7 .c 195:7.* is no GPU on this host"):
        chosen(r)


def test_a_foreign_node_with_an_nvidia_name_never_lets_the_env_past_its_policy():
    """/dev/nvidia1 as c 1:3 is no grant; with accept-env-when-unprivileged = false the
    image's `all` must not become the grant through the runtime-devices path either."""
    r = resolve(spec(ALL, devices=[node("/dev/nvidia1", 1, 3)]), **{"accept-env-when-unprivileged": False})
    with pytest.raises(RequestError, match="names no GPU"):
        chosen(r)
    r = resolve(spec(ALL, devices=[node("/dev/nvidia2", 195, 2)]), **{"accept-env-when-unprivileged": False})
    assert chosen(r) == [2]  # a real NVIDIA node is the runtime's grant whatever the env policy


def test_a_runtime_node_of_another_driver_is_no_grant():
    """/dev/nvidia1 as c 1:3 is /dev/null by another name: not NVIDIA's, so the environment
    decides (and the plan then refuses the conflicting node, tests/integration/test_faults.py)."""
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0"], devices=[node("/dev/nvidia1", 1, 3)]))
    assert chosen(r) == [0]


def test_mig_access_nodes_name_mig_devices():
    minors = {"gpu1/gi2/access": 21, "gpu1/gi2/ci0/access": 22, "config": 1}
    mig = MigDevice(0, "MIG-1111", 2, 0, "1g.10gb")
    facts = NvmlFacts("12.4", {g.uuid: g._replace(brand="nvidia", arch="9.0", mig_mode=g.index == 1,
                                                  mig_devices=(mig,) if g.index == 1 else ()) for g in GPUS})
    devices = [node("/dev/nvidia1", 195, 1), node("/dev/nvidia-caps/nvidia-cap21", 236, 21),
               node("/dev/nvidia-caps/nvidia-cap22", 236, 22)]
    r = resolve(spec(ALL, devices=devices))
    assert driver.needs_mig_layout(r.ids, r.mig_config, r.mig_monitor, r.nodes)
    selection = select.select(r, GPUS, facts, inventory(minors))
    assert [m.uuid for m in selection.migs] == ["MIG-1111"] and [g.index for g in selection.gpus] == [1]


CLAIM_SPEC = {
    "cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/claim",
    "devices": [{"name": "uid-gpu-0", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}}],
    "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}]},
}


YAML_SPEC = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: gpu3
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia3
      major: 195
      minor: 3
"""


def write(directory, name, text, mode=0o644):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(text))
    os.chmod(path, mode)
    return path


def test_a_claim_resolves_through_its_json_or_yaml_spec(tmp_path):
    write(tmp_path / "etc", "claim.json", CLAIM_SPEC)
    write(tmp_path / "run", "gpu.yaml", YAML_SPEC)
    dirs = [str(tmp_path / "etc"), str(tmp_path / "run")]
    nodes = cdi.resolve(["k8s.gpu.nvidia.com/claim=uid-gpu-0"], dirs)
    assert [(n.path, n.minor) for n in nodes] == [("/dev/nvidia1", 1), ("/dev/nvidiactl", 255)]
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/c": "k8s.gpu.nvidia.com/claim=uid-gpu-0,nvidia.com/gpu=gpu3"}))
    r = r._replace(nodes=driver.gpu_nodes(cdi.resolve(r.cdi, dirs)))
    assert chosen(r) == [1, 3]


def test_an_unknown_claim_fails_naming_it(tmp_path):
    write(tmp_path, "claim.json", CLAIM_SPEC)
    with pytest.raises(RequestError, match="k8s.gpu.nvidia.com/claim=other .*no CDI spec"):
        cdi.resolve(["k8s.gpu.nvidia.com/claim=other"], [str(tmp_path)])


def test_a_later_directory_overrides_and_a_duplicate_in_one_is_an_error(tmp_path):
    moved = json.loads(json.dumps(CLAIM_SPEC))
    moved["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="/dev/nvidia2", minor=2)
    write(tmp_path / "etc", "claim.json", CLAIM_SPEC)
    write(tmp_path / "run", "claim.json", moved)
    nodes = cdi.resolve(["k8s.gpu.nvidia.com/claim=uid-gpu-0"], [str(tmp_path / "etc"), str(tmp_path / "run")])
    assert nodes[0].minor == 2
    write(tmp_path / "run", "again.json", moved)
    with pytest.raises(HostError, match="defined twice"):
        cdi.resolve(["k8s.gpu.nvidia.com/claim=uid-gpu-0"], [str(tmp_path / "run")])


def test_a_spec_node_that_does_not_exist_fails_naming_it(tmp_path):
    missing = json.loads(json.dumps(CLAIM_SPEC))
    missing["devices"][0]["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia-nowhere-9"}]
    write(tmp_path, "claim.json", missing)
    with pytest.raises(RequestError, match="/dev/nvidia-nowhere-9, which does not exist"):
        cdi.resolve(["k8s.gpu.nvidia.com/claim=uid-gpu-0"], [str(tmp_path)])


def test_the_config_key_lists_the_spec_dirs():
    assert cfg.defaults().cdi_spec_dirs == ["/etc/cdi", "/var/run/cdi"]
    assert cfg.from_mapping({"cdi-spec-dirs": ["/x/"]}).cdi_spec_dirs == ["/x"]
    with pytest.raises(Exception, match="absolute"):
        cfg.from_mapping({"cdi-spec-dirs": ["relative"]})


@pytest.mark.parametrize("bus", ["0000:20:00.0", "00000000:20:00.0", "20:00.0", "0000:20:00.0".upper()])
def test_gpus_can_be_named_by_pci_bus_id(bus):
    r = resolve(spec([f"NVIDIA_VISIBLE_DEVICES={bus}"]))
    assert not driver.needs_mig_layout(r.ids, r.mig_config, r.mig_monitor, r.nodes) and chosen(r) == [2]


def test_an_unknown_bus_id_is_a_missing_gpu_not_a_mig_device():
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0000:99:00.0"]))
    with pytest.raises(RequestError, match="requested GPU '0000:99:00.0'.*does not exist"):
        chosen(r)


@pytest.mark.parametrize("word,wants", [("ALL", request_resolve.ALL), ("All", request_resolve.ALL), ("NONE", request_resolve.DRIVER_ONLY),
                                        ("Void", request_resolve.NOTHING)])
def test_keywords_in_any_case(word, wants):
    assert resolve(spec([f"NVIDIA_VISIBLE_DEVICES={word}"])).wants == wants


@pytest.mark.parametrize("variable,value", [("NVIDIA_IMEX_CHANNELS", "0"), ("NVIDIA_IMEX_CHANNELS", "all"),
                                            ("NVIDIA_GDS", "enabled"), ("NVIDIA_MOFED", "enabled")])
def test_requests_gpuhook_does_not_provide_are_refused_clearly(variable, value):
    with pytest.raises(RequestError, match=f"{variable} asks for .* which gpuhook does not provide"):
        resolve(spec(ALL + [f"{variable}={value}"]))
    assert resolve(spec([f"{variable}={value}"])).empty  # no GPU request: not gpuhook's business
    assert resolve(spec(ALL + [f"{variable}=void"])).wants == request_resolve.ALL


def test_video_alone_brings_what_nvenc_and_nvdec_need():
    caps = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=video"])).capabilities
    assert caps == {"video", "compute"}  # libcuda and nvidia-uvm: NVENC/NVDEC create a CUDA context


def test_a_legacy_image_gets_every_capability_whatever_channel_names_its_gpus():
    """As NVIDIA's toolkit: CUDA_VERSION without NVIDIA_REQUIRE_CUDA and no
    NVIDIA_DRIVER_CAPABILITIES means every capability, also with NVIDIA_VISIBLE_DEVICES set
    or a device plugin's grant (it was utility,compute there)."""
    legacy = ["CUDA_VERSION=10.2"]
    assert resolve(spec(legacy + ["NVIDIA_VISIBLE_DEVICES=0"])).capabilities == set(driver.CAPABILITIES)
    annotated = resolve(spec(legacy, annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}))
    assert annotated.capabilities == set(driver.CAPABILITIES)
    explicit = resolve(spec(legacy + ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"]))
    assert explicit.capabilities == {"utility"}


def test_graphics_and_display_bring_the_icd_vendor_and_xorg_files(tmp_path):
    from gpuhook.discover import driverfiles as discover

    files = {
        "/usr/share/glvnd/egl_vendor.d/10_nvidia.json": "graphics",
        "/usr/share/vulkan/icd.d/nvidia_icd.json": "graphics",
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": "graphics",
        "/usr/lib/xorg/modules/drivers/nvidia_drv.so": "display",
        "/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so.550.54.15": "display",
    }
    for path in files:
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text("{}")
    (tmp_path / "usr/share/vulkan/implicit_layer.d").mkdir(parents=True)
    (tmp_path / "usr/share/vulkan/implicit_layer.d/nvidia_layers.json").symlink_to("/etc/shadow")  # never followed
    found = {f.container_path: f.capability for f in discover.data_files(str(tmp_path), "550.54.15")}
    assert found == files
    assert all(f.host_path.startswith(str(tmp_path)) for f in discover.data_files(str(tmp_path), "550.54.15"))


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "cdi")


def fixture_dir(tmp_path, name: str, uuids=()) -> str:
    text = open(os.path.join(FIXTURES, name)).read()
    for i, uuid in enumerate(uuids):
        text = text.replace(f"GPU-UUID-{i}", uuid)
    return os.path.dirname(write(tmp_path / "cdi", name, text))


def test_a_dra_claim_spec_shaped_like_the_drivers_grants_its_one_gpu(tmp_path):
    specs = fixture_dir(tmp_path, "dra-claim.json")
    claim = "k8s.gpu.nvidia.com/claim=4d1b6c2e-9a4f-4e07-8a0e-1b7e0b1c2d3e-gpu-0"
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/k8s.gpu.nvidia.com_claim": claim}))
    r = r._replace(nodes=driver.gpu_nodes(cdi.resolve(r.cdi, [specs])))
    assert chosen(r) == [1]


def test_the_gpu_operators_spec_resolves_its_non_direct_names_and_keeps_direct_ones_direct(tmp_path):
    specs = fixture_dir(tmp_path, "gpu-operator.yaml", [GPUS[0].uuid, GPUS[1].uuid])
    # Its names say which GPU they are: the device plugin's annotation needs no spec.
    r = resolve(spec(ALL, annotations={"cdi.k8s.io/x": f"nvidia.com/gpu={GPUS[1].uuid}"}))
    assert r.cdi == () and chosen(r) == [1]
    # Through the spec, the same device injects the node of GPU 1 (minor 1), and `all` both.
    nodes = driver.gpu_nodes(cdi.resolve([f"nvidia.com/gpu={GPUS[1].uuid}", "nvidia.com/gpu=all"], [specs]))
    assert sorted((n.path, n.minor) for n in nodes) == [("/dev/nvidia0", 0), ("/dev/nvidia1", 1)]
