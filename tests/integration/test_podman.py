"""podman runs gpuhook from the hooks.d files `gpuhook install podman` writes (docs/packaging.md):
gpuhook.json at prestart, gpuhook-poststop.json when podman removes the stopped container.

Containers start from a busybox rootfs with podman's own storage, on the simulated GPU host.
Device access is checked by errno inside the container: ENXIO = the device cgroup allows the
node (no driver behind it), EPERM = denied.
"""

import json
import os

import pytest

from conftest import LIBDIR, require_root_tools
from helpers.runtimes import (STRICT_POLICY, PodmanGpus, assert_runtime_grant_kept, gpu_nodes, gpuhook_cli,
                              log_records, other_gpu_node, read_json, registered, wait_for_record)

pytestmark = pytest.mark.root

OTHER = "/dev/other-gpu"


def install_podman(hooks_dir, config, *extra):
    return gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), "--config", config, *extra)


@pytest.fixture
def make_podman_gpus(bed, sim_host, probe, tmp_path):
    """PodmanGpus on the simulated host with `hooks_dir` as podman's only hooks dir."""
    require_root_tools("podman")
    made = []

    def make(hooks_dir):
        made.append(PodmanGpus(bed, sim_host, probe, tmp_path, str(hooks_dir)))
        return made[-1]

    yield make
    for gpus in made:
        gpus.podman.close()


@pytest.fixture
def podman_gpus(make_podman_gpus, tmp_path):
    gpus = make_podman_gpus(tmp_path / "hooks.d")
    install_podman(tmp_path / "hooks.d", gpus.config)
    return gpus


def test_installed_hooks_file_runs_gpuhook_for_podman(podman_gpus):
    for name, stage in (("gpuhook.json", "prestart"), ("gpuhook-poststop.json", "poststop")):
        hook = read_json(f"{podman_gpus.podman.hooks_dir}/{name}")
        assert hook["when"] == {"always": True} and hook["stages"] == [stage]
        assert hook["hook"]["args"][1:3] == ["-I", "-S"]
        assert hook["hook"]["args"][-3:] == [stage, "--config", podman_gpus.config]

    result = podman_gpus.run("gpu0", env=["NVIDIA_VISIBLE_DEVICES=0"], before=other_gpu_node(1),
                             paths=[OTHER, f"{LIBDIR}/libcuda.so.1"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia0"}
    assert p["/dev/nvidia0"]["read"] == "ENXIO" and p["/dev/nvidiactl"]["read"] == "ENXIO"
    assert p[OTHER]["read"] == "EPERM"  # GPU 1 exists on the host but is not this container's
    assert p[f"{LIBDIR}/libcuda.so.1"]["type"] == "reg"
    (line,) = log_records(podman_gpus, "prestart")
    assert line["decision"] == "gpus injected" and line["gpus"] == [podman_gpus.uuid(0)]


def test_podman_runs_the_poststop_hook_when_it_removes_a_gpu_container(podman_gpus):
    podman_gpus.configure(health={"mode": "fallback"})  # the file the installed hooks name
    result = podman_gpus.run("stops", env=["NVIDIA_VISIBLE_DEVICES=2"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}
    (start,) = log_records(podman_gpus, "prestart")
    assert start["decision"] == "gpus injected" and start["health"]["mode"] == "fallback"
    assert isinstance(start["registered"], dict), start["registered"]  # the health registry knew it

    stop = wait_for_record(podman_gpus, "poststop", start["container"])
    assert stop["decision"] == "cleaned up", stop
    assert stop["nvml"] == "not loaded"  # nothing was left to kill, reset-on-release is off (docs/health.md)
    assert not registered(podman_gpus, start["container"])
    assert podman_gpus.podman.wait_until_idle()
    assert len(log_records(podman_gpus, "poststop")) == 1


@pytest.mark.parametrize("policy", [{}, STRICT_POLICY], ids=["default-policy", "strict-policy"])
def test_a_gpu_podman_gave_read_only_stays_read_only(podman_gpus, policy):
    """podman --device HOST:/dev/nvidia2:r puts the node in linux.devices with an "r" rule:
    the hook takes it as the grant (the image's NVIDIA_VISIBLE_DEVICES=0 adds nothing) and
    keeps it read-only."""
    podman_gpus.configure(**policy)
    host_node = f"{podman_gpus.sim['directory']}/dev/nvidia2"
    result = podman_gpus.run(f"read-only-{len(policy)}", env=["NVIDIA_VISIBLE_DEVICES=0"],
                             devices=[f"{host_node}:/dev/nvidia2:r"])
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert_runtime_grant_kept(probes, "/dev/nvidia2", "r")
    assert gpu_nodes(probes) == {"/dev/nvidia2"}
    (line,) = log_records(podman_gpus, "prestart")
    sim = podman_gpus.sim
    narrowed = f"narrowed to the runtime's own device rules: c {sim['majors']['nvidia']}:{sim['gpus'][2]['minor']} r"
    assert line["gpus"] == [podman_gpus.uuid(2)] and any(narrowed in note for note in line["notes"])


IMAGE_ANNOTATIONS = {"cdi.k8s.io/image": "nvidia.com/gpu=all", "io.container.manager": "not-libpod",
                     "io.kubernetes.pod.name": "someone-elses-pod"}


def test_an_images_own_cdi_annotation_grants_nothing_its_environment_could_not(podman_gpus):
    """podman (4.3 here, up to 4.5.0) copies an image's manifest annotations into the spec, so
    an image could ask for every GPU with a CDI annotation where its NVIDIA_VISIBLE_DEVICES is
    not honoured (strict policy), or widen the GPU podman --device gave. It even replaces
    io.container.manager; podman's own marks stay and tell gpuhook whose spec it is."""
    podman_gpus.configure(**STRICT_POLICY)
    result = podman_gpus.run("image-cdi-strict", image_annotations=IMAGE_ANNOTATIONS)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()

    podman_gpus.configure()
    host_node = f"{podman_gpus.sim['directory']}/dev/nvidia2"
    result = podman_gpus.run("image-cdi-device", image_annotations=IMAGE_ANNOTATIONS,
                             env=["NVIDIA_VISIBLE_DEVICES=all"], devices=[f"{host_node}:/dev/nvidia2:rw"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}
    strict, line = log_records(podman_gpus, "prestart")
    assert not strict["gpus"] and any("podman copies the image's annotations" in n for n in strict["notes"])
    assert line["gpus"] == [podman_gpus.uuid(2)]
    assert any("podman copies the image's annotations" in note for note in line["notes"]), line["notes"]
    assert "pod" not in line  # nor do the image's Kubernetes names reach the log

    # Where the image's environment counts (the default policy, no runtime grant), so does
    # its annotation: it asks for nothing NVIDIA_VISIBLE_DEVICES=all could not.
    result = podman_gpus.run("image-cdi-default", image_annotations=IMAGE_ANNOTATIONS)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {f"/dev/nvidia{i}" for i in range(4)}


def test_podman_container_without_request_is_untouched(podman_gpus):
    result = podman_gpus.run("plain", env=["CUDA_HOME=/usr/local/cuda"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert not any(item["exists"] for path, item in p.items() if path.startswith("/dev/nvidia"))
    assert not os.path.exists(f"{result.rootfs}{LIBDIR}")
    assert podman_gpus.podman.wait_until_idle()  # its poststop hook has run too, and logged nothing
    assert podman_gpus.log_lines() == []


def test_cdi_annotations_and_legacy_cuda_images_reach_the_hook_through_podman(podman_gpus):
    annotations = {"cdi.k8s.io/gpuhook-test_req": f"nvidia.com/gpu={podman_gpus.uuid(2)}"}
    result = podman_gpus.run("cdi", annotations=annotations)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}
    result = podman_gpus.run("legacy", env=["CUDA_VERSION=12.2.0"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {f"/dev/nvidia{i}" for i in range(4)}


def test_annotated_variant_runs_only_for_cdi_annotations(podman_gpus, tmp_path):
    install_podman(tmp_path / "hooks.d", podman_gpus.config, "--annotated")
    for name in ("gpuhook.json", "gpuhook-poststop.json"):
        assert "annotations" in read_json(tmp_path / "hooks.d" / name)["when"], name
    annotations = {"cdi.k8s.io/gpuhook-test_req": "nvidia.com/gpu=1"}
    result = podman_gpus.run("annotated", annotations=annotations, before=other_gpu_node(0), paths=[OTHER])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia1"} and p["/dev/nvidia1"]["read"] == "ENXIO"
    assert p[OTHER]["read"] == "EPERM"
    (start,) = log_records(podman_gpus, "prestart")
    assert wait_for_record(podman_gpus, "poststop", start["container"])["decision"] == "cleaned up"
    # The documented trade-off: podman never starts the hook for an env-only request, at
    # either stage (ungated, the poststop hook would log "not registered" for it).
    result = podman_gpus.run("env-only", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()
    assert podman_gpus.podman.wait_until_idle()
    assert [(line["stage"], line["container"]) for line in podman_gpus.log_lines()] == \
        [("prestart", start["container"]), ("poststop", start["container"])]


def refused_by_the_users_hook(result) -> bool:
    return result.returncode != 0 and "error running hook #0: error running hook: exit status 1" in result.stderr


def test_a_replaced_user_hooks_file_is_backed_up_where_podman_ignores_it_and_restored(
        make_podman_gpus, tmp_path):
    hooks_dir = tmp_path / "hooks.d"
    hooks_dir.mkdir()
    # The user's own gpuhook.json: a hook that fails every container start.
    failing = {"version": "1.0.0", "hook": {"path": "/bin/false"}, "when": {"always": True},
               "stages": ["prestart"]}
    (hooks_dir / "gpuhook.json").write_text(json.dumps(failing))
    gpus = make_podman_gpus(hooks_dir)
    assert refused_by_the_users_hook(gpus.run("before-install"))

    install_podman(hooks_dir, gpus.config)
    assert json.loads((hooks_dir / "gpuhook.json.gpuhook-bak").read_text()) == failing
    assert sorted(os.listdir(hooks_dir)) == ["gpuhook-poststop.json", "gpuhook.json", "gpuhook.json.gpuhook-bak"]
    result = gpus.run("installed", env=["NVIDIA_VISIBLE_DEVICES=3"])
    assert result.returncode == 0, result.stderr  # the backup is not a *.json file: not run
    assert gpu_nodes(result.probes()) == {"/dev/nvidia3"}

    gpuhook_cli("uninstall", "podman", "--hooks-dir", str(hooks_dir))
    assert sorted(os.listdir(hooks_dir)) == ["gpuhook.json"]
    assert json.loads((hooks_dir / "gpuhook.json").read_text()) == failing
    assert refused_by_the_users_hook(gpus.run("after-uninstall"))
