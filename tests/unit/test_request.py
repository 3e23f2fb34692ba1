"""Request resolution: which GPUs a container asks for, through which channel."""

import json

import pytest

from gpuhook import config as cfg
from gpuhook.request import oci
from gpuhook import driver
from gpuhook.plan import select
from gpuhook.request import resolve as request_resolve
from gpuhook.discover.types import Gpu
from gpuhook.errors import RequestError

GPUS = tuple(Gpu(i, f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}", i, f"0000:{i}0:00.0", "Sim") for i in range(4))


def spec(env=(), mounts=(), annotations=None, privileged=False):
    """`privileged` as docker --privileged: CAP_SYS_ADMIN and device rules allowing everything;
    "cap-add" CAP_SYS_ADMIN alone (--cap-add SYS_ADMIN), under docker's deny-all."""
    caps = ["CAP_CHOWN"] + (["CAP_SYS_ADMIN"] if privileged else [])
    rules = [{"allow": privileged is True, "access": "rwm"}]
    doc = {"root": {"path": "rootfs"}, "process": {"env": list(env), "capabilities": {"bounding": caps}},
           "mounts": list(mounts), "linux": {"resources": {"devices": rules}}}
    if annotations:
        doc["annotations"] = annotations
    return oci.parse_spec(json.dumps(doc).encode(), "/bundle")


def resolve(s, state_annotations=None, **config):
    return request_resolve.resolve(s, state_annotations or {}, cfg.from_mapping(config))


def vm(device):
    return {"destination": f"/var/run/nvidia-container-devices/{device}", "source": "/dev/null", "type": "bind"}


@pytest.mark.parametrize("env,wants,ids", [
    ([], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES="], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES=void"], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES=0,void"], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES= , "], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES=none"], request_resolve.DRIVER_ONLY, ()),
    (["NVIDIA_VISIBLE_DEVICES=all"], request_resolve.ALL, ()),
    (["NVIDIA_VISIBLE_DEVICES=1,all"], request_resolve.ALL, ()),
    (["NVIDIA_VISIBLE_DEVICES=0"], request_resolve.GPUS, ("0",)),
    (["NVIDIA_VISIBLE_DEVICES= 2, 0 ,2,0"], request_resolve.GPUS, ("2", "0")),
    (["NVIDIA_VISIBLE_DEVICES=GPU-x,1"], request_resolve.GPUS, ("GPU-x", "1")),
    (["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"], request_resolve.NOTHING, ()),
    (["CUDA_VERSION=11.0"], request_resolve.ALL, ()),
    (["CUDA_VERSION=11.0", "NVIDIA_REQUIRE_CUDA=cuda>=11.0"], request_resolve.NOTHING, ()),
    (["CUDA_VERSION=11.0", "NVIDIA_VISIBLE_DEVICES=void"], request_resolve.NOTHING, ()),
    (["CUDA_VERSION="], request_resolve.NOTHING, ()),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=void"], request_resolve.NOTHING, ()),  # last wins
])
def test_environment_requests(env, wants, ids):
    r = resolve(spec(env))
    assert (r.wants, r.ids) == (wants, ids)


def test_none_cannot_be_combined():
    with pytest.raises(RequestError, match="'none' cannot be combined"):
        resolve(spec(["NVIDIA_VISIBLE_DEVICES=0,none"]))


@pytest.mark.parametrize("value,caps", [
    (None, {"utility", "compute"}),
    ("", {"utility", "compute"}),
    ("utility", {"utility"}),
    ("compute, video", {"compute", "video"}),
    ("all", set(driver.CAPABILITIES)),
    ("graphics,all", set(driver.CAPABILITIES)),
])
def test_driver_capabilities(value, caps):
    env = ["NVIDIA_VISIBLE_DEVICES=0"] + ([f"NVIDIA_DRIVER_CAPABILITIES={value}"] if value is not None else [])
    assert resolve(spec(env)).capabilities == caps


def test_legacy_image_gets_every_capability():
    assert resolve(spec(["CUDA_VERSION=10.2"])).capabilities == set(driver.CAPABILITIES)


def test_unknown_capability_is_refused_with_the_known_list():
    with pytest.raises(RequestError, match=r"unknown driver capability 'gpu'.*compute"):
        resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,gpu"]))


def test_cap_sys_admin_without_every_device_allowed_is_no_privileged_container():
    """docker --cap-add SYS_ADMIN keeps the runtime's device policy: the environment policy and
    the privileged-only variables apply to it as to any unprivileged container."""
    strict = {"accept-env-when-unprivileged": False}
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=all"], privileged="cap-add"), **strict)
    assert r.empty and "unprivileged" in r.notes[0]
    with pytest.raises(RequestError, match="only honoured for privileged containers"):
        resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_MIG_CONFIG_DEVICES=all"], privileged="cap-add"))
    assert resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_MIG_CONFIG_DEVICES=all"],
                        privileged=True)).mig_config == ("all",)


def test_unprivileged_env_request_is_ignored_when_policy_forbids_it():
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=all"]), **{"accept-env-when-unprivileged": False})
    assert r.empty and "unprivileged" in r.notes[0]
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=all"], privileged=True), **{"accept-env-when-unprivileged": False})
    assert r.wants == request_resolve.ALL


def test_volume_mounts_win_over_the_environment_and_are_deduplicated():
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=all"], mounts=[vm(1), vm(3), vm(1), {"destination": "/data"}]))
    assert (r.wants, r.ids, r.channel) == (request_resolve.GPUS, ("1", "3"), request_resolve.MOUNTS)
    assert any("takes precedence" in n for n in r.notes)


def test_volume_mount_all_and_run_alias():
    r = resolve(spec(mounts=[{"destination": "/run/nvidia-container-devices/all", "source": "/dev/null",
                              "type": "none", "options": ["rbind", "ro"]}]))
    assert r.wants == request_resolve.ALL


@pytest.mark.parametrize("mount", [
    {"destination": "/var/run/nvidia-container-devices/all", "type": "tmpfs", "source": "tmpfs"},
    {"destination": "/var/run/nvidia-container-devices/all", "type": "bind", "source": "/etc/hostname"},
    {"destination": "/var/run/nvidia-container-devices/all", "source": "/dev/null"},  # not a bind
    # podman: an image's VOLUME becomes a named volume bound from its storage
    {"destination": "/var/run/nvidia-container-devices/all", "type": "bind",
     "source": "/var/lib/containers/storage/volumes/abc/_data", "options": ["rbind"]},
])
def test_only_a_bind_of_dev_null_is_a_volume_mount_request(mount):
    for policy in ({}, {"accept-env-when-unprivileged": False, "accept-cdi-annotations": False}):
        r = resolve(spec(mounts=[mount]), **policy)
        assert r.empty and any("bind mount of /dev/null" in n for n in r.notes)


def test_requests_are_bounded():
    many = ",".join(f"GPU-{i}" for i in range(200_000))
    with pytest.raises(RequestError, match="more than 1024 devices"):
        resolve(spec([f"NVIDIA_VISIBLE_DEVICES={many}"]))
    cdi = ",".join(f"nvidia.com/gpu={i}" for i in range(50_000))
    with pytest.raises(RequestError, match="more than 1024 devices"):
        resolve(spec(annotations={"cdi.k8s.io/x": cdi}))
    with pytest.raises(RequestError, match="longer than 256"):
        resolve(spec(["NVIDIA_VISIBLE_DEVICES=" + "a" * 10_000]))


def test_an_index_with_thousands_of_digits_is_a_request_error_not_a_crash():
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=" + "9" * 200]))
    with pytest.raises(RequestError, match="does not exist"):
        select.select(r, GPUS)


def test_volume_mounts_work_for_unprivileged_containers_even_when_env_is_refused():
    r = resolve(spec(mounts=[vm(2)]), **{"accept-env-when-unprivileged": False})
    assert r.ids == ("2",)


def test_volume_mounts_ignored_by_policy():
    r = resolve(spec(mounts=[vm(2)]), **{"accept-volume-mounts": False})
    assert r.empty and "accept-volume-mounts" in r.notes[0]


def test_cdi_annotations_from_spec_and_state_are_merged():
    r = resolve(spec(annotations={"cdi.k8s.io/a": "nvidia.com/gpu=0, vendor.com/nic=eth1"}),
                state_annotations={"cdi.k8s.io/b": "nvidia.com/gpu=GPU-x,nvidia.com/gpu=0"})
    assert (r.wants, r.ids, r.channel) == (request_resolve.GPUS, ("0", "GPU-x"), request_resolve.CDI)
    assert any("vendor.com/nic" in n for n in r.notes)


def test_cdi_annotation_naming_only_other_vendors_is_no_request():
    assert resolve(spec(annotations={"cdi.k8s.io/a": "vendor.com/nic=eth1"})).empty


def test_cdi_empty_device_name_is_an_error():
    with pytest.raises(RequestError, match="empty device name"):
        resolve(spec(annotations={"cdi.k8s.io/a": "nvidia.com/gpu="}))


def test_select_by_index_uuid_and_all():
    r = resolve(spec([f"NVIDIA_VISIBLE_DEVICES=3,{GPUS[1].uuid.lower()}"]))
    assert [g.index for g in select.select(r, GPUS).gpus] == [3, 1]
    assert select.select(resolve(spec(["NVIDIA_VISIBLE_DEVICES=all"])), GPUS).gpus == GPUS
    assert select.select(resolve(spec(["NVIDIA_VISIBLE_DEVICES=none"])), GPUS).gpus == ()


def test_same_gpu_by_index_and_uuid_is_given_once():
    r = resolve(spec([f"NVIDIA_VISIBLE_DEVICES=1,{GPUS[1].uuid}"]))
    assert [g.index for g in select.select(r, GPUS).gpus] == [1]


@pytest.mark.parametrize("ident", ["7", "GPU-nope", "-1", "1.0", "０"])
def test_missing_gpu_lists_the_real_ones(ident):
    r = resolve(spec([f"NVIDIA_VISIBLE_DEVICES={ident}"]))
    with pytest.raises(RequestError) as err:
        select.select(r, GPUS).gpus
    # The host's GPUs by index: other GPUs' UUIDs are host data, and the error reaches the
    # container's maker (attacker pass 5, A08).
    assert "does not exist" in err.value.message and "GPUs here: 0, 1, 2, 3" in err.value.message
    assert not any(gpu.uuid in err.value.message for gpu in GPUS)


def test_cdi_annotations_ignored_by_policy():
    r = resolve(spec(annotations={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), **{"accept-cdi-annotations": False})
    assert r.empty and "accept-cdi-annotations" in r.notes[-1]


# --- optional devices: NVIDIA_NVSWITCH, NVIDIA_GDRCOPY (NVIDIA's internal/modifier/gated.go) ---

@pytest.mark.parametrize("env,features", [
    (["NVIDIA_NVSWITCH=enabled"], ("nvswitch",)),
    (["NVIDIA_GDRCOPY=enabled"], ("gdrcopy",)),
    (["NVIDIA_GDRCOPY=enabled", "NVIDIA_NVSWITCH=enabled"], ("nvswitch", "gdrcopy")),
    (["NVIDIA_GDRCOPY=disabled", "NVIDIA_NVSWITCH="], ()),
])
def test_nvswitch_and_gdrcopy_are_enabled_by_the_exact_value_enabled(env, features):
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0"] + env))
    assert r.features == features and not [n for n in r.notes if "NVSWITCH" in n or "GDRCOPY" in n]


@pytest.mark.parametrize("value", ["1", "true", "Enabled", "yes"])
def test_another_value_of_an_optional_device_variable_is_named_in_a_note_not_enabled(value):
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_GDRCOPY={value}"]))
    assert r.features == ()
    assert f"NVIDIA_GDRCOPY={value!r} ignored: only NVIDIA_GDRCOPY=enabled turns it on (as NVIDIA's toolkit)" in r.notes


def test_optional_devices_without_a_gpu_request_are_not_gpuhooks_business():
    r = resolve(spec(["NVIDIA_GDRCOPY=enabled", "NVIDIA_NVSWITCH=enabled"]))
    assert r.empty and r.features == ()


STRICT = {"accept-env-when-unprivileged": False}


@pytest.mark.parametrize("request_env,mounts", [
    (["NVIDIA_VISIBLE_DEVICES=0"], []),  # the environment's request itself is refused ...
    ([], [vm(2)]),  # ... and a grant from another channel does not make the image's variables honoured
])
def test_optional_devices_from_an_environment_the_policy_does_not_honour_enable_nothing(request_env, mounts):
    env = request_env + ["NVIDIA_NVSWITCH=enabled", "NVIDIA_GDRCOPY=enabled"]
    r = resolve(spec(env, mounts=mounts), **STRICT)
    assert r.features == ()
    for name in ("NVIDIA_NVSWITCH", "NVIDIA_GDRCOPY"):
        if mounts:  # an empty request says nothing about optional devices (see above)
            assert (f"{name}=enabled ignored: the image's environment is not honoured "
                    f"(accept-env-when-unprivileged = false)") in r.notes
    assert resolve(spec(env, mounts=mounts, privileged=True), **STRICT).features == ("nvswitch", "gdrcopy")
    assert resolve(spec(env, mounts=mounts)).features == ("nvswitch", "gdrcopy")


def test_every_refused_variable_is_named_in_one_line():
    with pytest.raises(RequestError) as caught:
        resolve(spec(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_GDS=enabled", "NVIDIA_IMEX_CHANNELS=0",
                      "NVIDIA_GDRCOPY=enabled"]))
    line = caught.value.one_line()
    assert "\n" not in line
    assert "NVIDIA_IMEX_CHANNELS asks for IMEX channels" in line and "NVIDIA_GDS asks for GPUDirect Storage" in line
    assert "GDRCOPY" not in line.partition("which gpuhook does not provide")[0]


# --- gpuhook's own CDI kind (docs/cdi.md, "Next to NVIDIA's") -------------------------------

@pytest.mark.parametrize("value,ids", [("gpuhook.example/gpu=1", ("1",)), ("gpuhook.example/gpu=GPU-x", ("GPU-x",)),
                                       ("gpuhook.example/gpu=all", ())])
def test_the_cdi_annotation_channel_accepts_gpuhooks_own_kind(value, ids):
    r = resolve(spec(annotations={"cdi.k8s.io/gpuhook": value}))
    assert (r.ids, r.channel) == (ids, request_resolve.CDI) and r.wants == (request_resolve.ALL if not ids else request_resolve.GPUS)


def test_the_device_plugins_cdi_mount_of_gpuhooks_kind_is_a_grant():
    r = resolve(spec(mounts=[vm("cdi/gpuhook.example/gpu/GPU-x")]))
    assert (r.ids, r.channel) == (("GPU-x",), request_resolve.MOUNTS)


@pytest.mark.parametrize("value", ["gpuhook.example/nic=1", "example.com/gpu=1", "gpuhook.example.com/gpu=1"])
def test_other_kinds_are_left_to_other_tools(value):
    r = resolve(spec(["NVIDIA_VISIBLE_DEVICES=0"], annotations={"cdi.k8s.io/x": value}))
    assert r.channel == request_resolve.ENV and any("not an NVIDIA device" in note for note in r.notes)


PODMAN_MARKS = [{"annotations": {"io.podman.annotations.autoremove": "TRUE", "io.container.manager": "someone"}},
                {"annotations": {"io.container.manager": "libpod"}},
                {"mounts": [{"destination": "/run/.containerenv", "source": "/x/containerenv", "type": "bind"}]}]


@pytest.mark.parametrize("mark", PODMAN_MARKS, ids=["podman-annotation-keys", "manager-libpod", "containerenv"])
def test_a_cdi_annotation_in_a_podman_spec_counts_only_as_the_images_environment(mark):
    """podman (to 4.5.0) copies the image's manifest annotations into the spec; any one of its
    own marks makes the spec podman's (the image can replace io.container.manager, not drop
    the others)."""
    annotations = {"cdi.k8s.io/image": "nvidia.com/gpu=all", **mark.get("annotations", {})}
    s = spec(mounts=mark.get("mounts", ()), annotations=annotations)
    assert s.from_podman and s.runtime_annotations() == {}
    strict = resolve(s, **STRICT)
    assert strict.empty and any("podman copies the image's annotations" in n for n in strict.notes)
    assert resolve(s).wants == request_resolve.ALL  # where its NVIDIA_VISIBLE_DEVICES=all would count too
    privileged = spec(mounts=mark.get("mounts", ()), annotations=annotations, privileged=True)
    assert resolve(privileged, **STRICT).wants == request_resolve.ALL


def test_a_spec_without_podmans_marks_keeps_its_annotations_as_the_runtimes():
    s = spec(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=1", "io.container.manager": "cri-o"})
    assert not s.from_podman and s.runtime_annotations() == s.annotations
    assert resolve(s, **STRICT).ids == ("1",)


def test_podman_annotations_name_no_kubernetes_pod():
    from gpuhook import journal

    names = {"io.kubernetes.pod.name": "p", "io.kubernetes.pod.namespace": "n"}
    assert journal.k8s_names(names) == {"pod": "p", "namespace": "n"}
    assert journal.k8s_names({**names, "io.podman.annotations.init": "FALSE"}) == {}


def test_a_capability_that_adds_a_device_node_is_not_taken_from_an_environment_the_policy_refuses():
    """Attacker finding A13: under the strict policy, with a grant from the orchestrator, the
    image's NVIDIA_DRIVER_CAPABILITIES=display still added /dev/nvidia-modeset."""
    granted = spec(["NVIDIA_DRIVER_CAPABILITIES=display,compute"], mounts=[vm("1")])
    strict = resolve(granted, **STRICT)
    assert "display" not in strict.capabilities and "compute" in strict.capabilities
    assert any("driver capability display ignored" in n for n in strict.notes)
    assert "display" in resolve(granted).capabilities  # where the environment counts, it counts
    assert "display" in resolve(spec(["NVIDIA_DRIVER_CAPABILITIES=display"], mounts=[vm("1")], privileged=True),
                                 **STRICT).capabilities
