"""Real runc containers on the simulated host, cgroup v1 (this machine's hybrid layout).

Device access is checked by errno inside the container: ENXIO = the device cgroup allows
the node but no driver is behind it (a simulated GPU), EPERM = the cgroup denies it.
"""

import os
import stat
import subprocess

import pytest

from conftest import LIBDIR, host_mounts, sim_config_values, write_config

from helpers import testbed

pytestmark = pytest.mark.root

EXTRA = [f"{LIBDIR}/libcuda.so.1", f"{LIBDIR}/libnvidia-ml.so.1", "/usr/bin/nvidia-smi", "/dev/null", "/dev/zero"]


def make_node(name: str, minor: int) -> str:
    return f"busybox mknod /dev/{name} c 195 {minor}"


def gpu_nodes(probes) -> set:
    return {p for p, item in probes.items() if p.startswith("/dev/nvidia") and p[11:].isdigit() and item["exists"]}


def test_one_gpu_container_sees_its_gpu_driver_files_and_nothing_else(gpus):
    lib = f"{LIBDIR}/libcuda.so.{gpus.version}"
    before = mounts_before = host_mounts()
    result = gpus.run("gpu0", env=["NVIDIA_VISIBLE_DEVICES=0"], before=make_node("test-gpu1", 1),
                      paths=EXTRA + [lib, "/dev/test-gpu1"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia0"}
    for node in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert p[node]["type"] == "chr" and p[node]["read"] == "ENXIO", p[node]
    assert (p["/dev/nvidia0"]["major"], p["/dev/nvidia0"]["minor"]) == (195, 0)
    assert p["/dev/nvidia0"]["mode"] == "0666"
    assert p["/dev/test-gpu1"]["read"] == "EPERM"  # GPU 1 exists on the host but is not ours
    assert p["/dev/null"]["read"] == "OK" and p["/dev/zero"]["write"] == "OK"  # runc's defaults still work
    assert p[lib]["type"] == "reg" and p[lib]["readonly_mount"] is True and p[lib]["write"] == "EROFS"
    assert p[f"{LIBDIR}/libcuda.so.1"]["link"] == f"libcuda.so.{gpus.version}"
    assert p[f"{LIBDIR}/libnvidia-ml.so.1"]["type"] == "reg"
    assert p["/usr/bin/nvidia-smi"]["type"] == "reg" and p["/usr/bin/nvidia-smi"]["write"] == "EROFS"
    cache = subprocess.run(["ldconfig", "-p", "-C", f"{result.rootfs}/etc/ld.so.cache"],
                           capture_output=True, text=True, check=True).stdout
    assert f"libcuda.so.1 (libc6,x86-64) => {LIBDIR}/libcuda.so.1" in cache
    assert f"libnvidia-ml.so.1 (libc6,x86-64) => {LIBDIR}/libnvidia-ml.so.1" in cache
    assert host_mounts() == before == mounts_before
    (line,) = gpus.log_lines()
    assert line["decision"] == "gpus injected" and line["gpus"] == [gpus.uuid(0)] and line["cgroup"] == "v1"


def test_a_mount_point_whose_name_is_not_utf8_does_not_fail_the_start(gpus, tmp_path):
    """A mount point is whatever bytes its creator chose, and the hook reads the runtime's
    whole mount table (to find the container's device cgroup): one name there that is not
    UTF-8 made every GPU start on the host fail with exit 70."""
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9 mount")
    gpus.bed.wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                        'mkdir -p "$0" && mount -t tmpfs tmpfs "$0" && exec "$@"', odd]
    result = gpus.run("odd", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia0"}
    assert gpus.log_lines()[-1]["decision"] == "gpus injected"


def test_static_image_gets_the_driver_but_no_ld_cache(gpus):
    result = gpus.run("static", env=["NVIDIA_VISIBLE_DEVICES=0"], glibc=False, paths=EXTRA)
    assert result.returncode == 0, result.stderr
    assert result.probes()[f"{LIBDIR}/libcuda.so.1"]["type"] == "reg"
    assert not os.path.exists(f"{result.rootfs}/etc/ld.so.cache")
    assert any("no glibc" in note for note in gpus.log_lines()[-1]["notes"])


def test_simulated_nvidia_smi_runs_in_the_container(gpus):
    result = gpus.run("smi", env=["NVIDIA_VISIBLE_DEVICES=1"], before="/usr/bin/nvidia-smi")
    assert result.returncode == 0, result.stderr
    assert "/dev/nvidia1" in result.stdout and "open: ENXIO" in result.stdout


def test_all_gives_every_gpu(gpus):
    result = gpus.run("all", env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {f"/dev/nvidia{i}" for i in range(4)}
    assert all(p[f"/dev/nvidia{i}"]["read"] == "ENXIO" for i in range(4))


def test_uuid_list_with_duplicates_and_mixed_index(gpus):
    value = f"{gpus.uuid(1)}, 3 ,{gpus.uuid(1).lower()},3"
    result = gpus.run("uuids", env=[f"NVIDIA_VISIBLE_DEVICES={value}"], before=make_node("test-gpu0", 0),
                      paths=["/dev/test-gpu0"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia1", "/dev/nvidia3"}
    assert p["/dev/test-gpu0"]["read"] == "EPERM"


def test_none_gives_driver_files_and_control_nodes_but_no_gpu(gpus):
    result = gpus.run("none", env=["NVIDIA_VISIBLE_DEVICES=none"], paths=EXTRA)
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == set()
    assert p["/dev/nvidiactl"]["read"] == "ENXIO"
    assert p[f"{LIBDIR}/libcuda.so.1"]["exists"] and p["/usr/bin/nvidia-smi"]["exists"]


def test_volume_mount_channel(gpus):
    mounts = [{"destination": "/var/run/nvidia-container-devices/2", "type": "bind",
               "source": "/dev/null", "options": ["rbind", "ro"]}]
    result = gpus.run("volumes", env=["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"], mounts=mounts)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}


def test_volume_mounts_ignored_when_policy_says_so(gpus):
    gpus.configure(**{"accept-volume-mounts": False})
    mounts = [{"destination": "/var/run/nvidia-container-devices/2", "type": "bind",
               "source": "/dev/null", "options": ["rbind", "ro"]}]
    result = gpus.run("volumes-off", mounts=mounts)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()


def test_cdi_annotation_channel_wins_over_the_environment(gpus):
    annotations = {"cdi.k8s.io/gpu-plugin_x": f"nvidia.com/gpu={gpus.uuid(3)}"}
    result = gpus.run("cdi", env=["NVIDIA_VISIBLE_DEVICES=all"], annotations=annotations)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia3"}


def test_unprivileged_env_request_is_refused_by_policy_but_privileged_is_served(gpus):
    gpus.configure(**{"accept-env-when-unprivileged": False})
    result = gpus.run("unpriv", env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()
    assert not result.probes()["/dev/nvidiactl"]["exists"]
    assert "unprivileged" in " ".join(gpus.log_lines()[-1]["notes"])
    result = gpus.run("priv", env=["NVIDIA_VISIBLE_DEVICES=0"], privileged=True)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia0"}


def test_cap_sys_admin_alone_is_not_a_privileged_container(gpus):
    """--cap-add SYS_ADMIN keeps runc's deny-all device rules: the environment policy applies
    to it as to any unprivileged container (docs/requests.md, Precedence)."""
    def cap_add_sys_admin(spec):
        caps = spec["process"]["capabilities"]
        for kind in ("bounding", "effective", "permitted"):
            caps[kind] = sorted(set(caps.get(kind, [])) | {"CAP_SYS_ADMIN"})

    gpus.configure(**{"accept-env-when-unprivileged": False})
    result = gpus.run("cap-add", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=cap_add_sys_admin)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()
    assert "unprivileged" in " ".join(gpus.log_lines()[-1]["notes"])


def test_missing_gpu_fails_the_start_with_one_line_naming_the_real_gpus(gpus):
    result = gpus.run("missing", env=["NVIDIA_VISIBLE_DEVICES=0,7"])
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert len(lines) == 1
    # The host's GPUs by index, never their UUIDs: the line reaches whoever made the container.
    assert "requested GPU '7'" in lines[0] and "GPUs here: 0, 1, 2, 3" in lines[0]
    assert not any(gpus.uuid(i) in lines[0] for i in range(4))


def test_container_without_request_is_untouched(gpus):
    result = gpus.run("plain", env=["CUDA_HOME=/usr/local/cuda"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert not any(p[n]["exists"] for n in p if n.startswith("/dev/nvidia"))
    assert not os.path.exists(f"{result.rootfs}{LIBDIR}")
    assert not os.path.exists(f"{result.rootfs}/etc/ld.so.cache")
    assert gpus.log_lines() == []  # the fast path decided without loading anything


def test_void_is_no_request(gpus):
    result = gpus.run("void", env=["NVIDIA_VISIBLE_DEVICES=void"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == set()


def test_legacy_cuda_image_gets_all_gpus(gpus):
    result = gpus.run("legacy", env=["CUDA_VERSION=11.0.3"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {f"/dev/nvidia{i}" for i in range(4)}


def test_running_the_hook_as_create_runtime_works_too(gpus):
    result = gpus.run("create-runtime", env=["NVIDIA_VISIBLE_DEVICES=2"], stage="createRuntime")
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}


def test_failed_apply_is_undone_and_names_the_step(gpus):
    def blocker(rootfs):
        os.makedirs(f"{rootfs}/usr/bin/nvidia-smi")  # a directory where the binary must go

    before = host_mounts()
    result = gpus.run("undo", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=blocker)
    assert result.returncode != 0
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert "mount /usr/bin/nvidia-smi" in line and "exists and is a directory" in line
    # Everything the hook created in the rootfs before the failure is gone again.
    assert not os.path.exists(f"{result.rootfs}{LIBDIR}")
    assert sorted(os.listdir(f"{result.rootfs}/usr/bin")) == ["nvidia-smi"]
    assert host_mounts() == before


def test_debian_family_image_gets_the_multiarch_library_dir(gpus):
    def debian(rootfs):
        os.makedirs(f"{rootfs}/etc", exist_ok=True)
        with open(f"{rootfs}/etc/debian_version", "w") as f:
            f.write("12.0\n")

    lib = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    result = gpus.run("debian", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=debian, paths=[lib])
    assert result.returncode == 0, result.stderr
    assert result.probes()[lib]["type"] == "reg"


def test_hook_run_twice_is_idempotent(gpus):
    # A second gpuhook with a state dir of its own (the same one would find the start served:
    # gpuhook.apply.served) applies again on the same container.
    other = write_config(f"{gpus.workdir}/other.toml", sim_config_values(gpus.sim, gpus.log),
                         **{"state-dir": f"{gpus.workdir}/other-run"})

    def twice(spec):
        spec["hooks"]["prestart"] = [spec["hooks"]["prestart"][0], testbed.hook_entry(other)]

    result = gpus.run("twice", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=twice, paths=EXTRA)
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia0"} and p["/dev/nvidia0"]["read"] == "ENXIO"
    assert [line["decision"] for line in gpus.log_lines()] == ["gpus injected", "gpus injected"]
    assert gpus.log_lines()[1]["rules_added"] == []  # the second run found them granted


def deny_after_allowing_everything(major: int, minor: int):
    """A spec edit: the runtime's rules open every device, then explicitly deny one
    (linux.resources.devices `allow a *:* rwm`, `deny c MAJOR:MINOR rwm`)."""
    def edit(spec):
        spec["linux"]["resources"]["devices"] = [
            {"allow": True, "access": "rwm"},
            {"allow": False, "type": "c", "major": major, "minor": minor, "access": "rwm"}]
    return edit


def image_node(path: str, major: int, minor: int):
    """A rootfs_setup: the image ships a device node at `path` (outside the runtime's /dev)."""
    def setup(rootfs):
        os.mknod(rootfs + path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return setup


def test_a_node_the_runtime_explicitly_denies_is_refused_never_granted(gpus):
    """Issue 23, G1: everything allowed but GPU 0 denied. A request for GPU 0 fails the start
    (exit 3, one line) instead of writing c 195:0 to devices.allow, which in the runtime's
    allow-all cgroup removes the deny; a request for GPU 1 is served and GPU 0 stays shut."""
    nvidia, minor0 = gpus.sim["majors"]["nvidia"], gpus.sim["gpus"][0]["minor"]
    edit = deny_after_allowing_everything(nvidia, minor0)
    result = gpus.run("denied-gpu0", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=edit, paths=["/gpu0"],
                      rootfs_setup=image_node("/gpu0", nvidia, minor0))
    assert result.returncode != 0 and "exit status 3" in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    assert f"c {nvidia}:{minor0}" in line and "deny" in line, line
    result = gpus.run("denied-gpu0-asks-gpu1", env=["NVIDIA_VISIBLE_DEVICES=1"], edit=edit, paths=["/gpu0"],
                      rootfs_setup=image_node("/gpu0", nvidia, minor0))
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia1"} and p["/dev/nvidia1"]["write"] == "ENXIO"
    assert p["/gpu0"]["read"] == "EPERM" and p["/gpu0"]["write"] == "EPERM", p["/gpu0"]
