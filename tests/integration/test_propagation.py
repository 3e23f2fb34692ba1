"""gpuhook never attaches a mount where it can propagate, checked on the very mount it lands on.

A pod can bind a host file that lies on a shared host mount at a path where gpuhook mounts a
driver file, with `rshared` (and, under runc and crun, `rootfsPropagation: shared`; podman
needs only `:rshared`). That file mount is then a peer of the host's mount: a mount attached
on top of it propagates into the host's mount table, where the host's file would read as the
driver's library for every process, and stay after the container is gone. The directory the
target lives in is not shared; the target itself, a mount root, is. So the check is made on
the mount the new mount is attached to (docs/security.md, "A mount gpuhook makes propagates
to the host"): a driver file there fails the start, an IPC endpoint is left out with a note.
"""

import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import LIBDIR, GpuContainers, require, require_root_tools
from helpers.runtimes import PodmanGpus
from test_crun import UNIFIED, hybrid_cgroup_layout

from helpers import testbed

pytestmark = pytest.mark.root

HOST_TEXT = "a host file that must keep its content\n"
PERSISTENCED = "/var/run/nvidia-persistenced/socket"


def mounts_under(path) -> list:
    """Mount points at or below `path` in the host's mount table."""
    path = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return sorted(p for p in points if p == path or p.startswith(path + "/"))


@pytest.fixture
def shared_dir(tmp_path):
    """A host directory that is its own shared mount (a peer group), as /var/lib/kubelet is on
    a systemd host, holding the file the pod binds in."""
    shared = tmp_path / "shared"
    shared.mkdir()
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True)
    subprocess.run(["mount", "--make-shared", str(shared)], check=True)
    (shared / "victim").write_text(HOST_TEXT)
    try:
        yield shared
    finally:
        for point in reversed(mounts_under(shared)):  # what propagated, if anything, then ours
            subprocess.run(["umount", "-l", point], check=False)


def shared_rootfs(spec):
    spec["linux"]["rootfsPropagation"] = "shared"


def file_volume(source, destination) -> dict:
    return {"destination": destination, "type": "bind", "source": str(source), "options": ["bind", "rshared"]}


# crun refuses this host's hybrid cgroup layout: it runs in a mount namespace of its own
# without the cgroup2 mount (as tests/integration/test_crun.py does), but one that keeps the
# shared test directory a peer of the host's, or there would be nothing to propagate to.
CRUN_V1_KEEPING_PEERS = ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c",
                         f'mount --make-rprivate /sys && umount {UNIFIED} && exec "$@"', "crun-v1"]


@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_a_driver_library_is_never_attached_onto_a_shared_file_volume(gpus, shared_dir, runtime, tmp_path):
    require_root_tools(runtime)
    target = f"{LIBDIR}/libnvidia-ml.so.{gpus.version}"
    if runtime == "crun":
        require(hybrid_cgroup_layout(), "needs the hybrid cgroup layout")
        gpus = GpuContainers(testbed.Testbed(str(tmp_path / "crun-bed"), runc="crun", wrapper=CRUN_V1_KEEPING_PEERS),
                             gpus.sim, gpus.probe, tmp_path)
    before = mounts_under(shared_dir)
    result = gpus.run(f"propagate-{runtime}", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=shared_rootfs,
                      mounts=[file_volume(shared_dir / "victim", target)])
    assert mounts_under(shared_dir) == before
    assert (shared_dir / "victim").read_text() == HOST_TEXT
    assert result.returncode != 0
    (record,) = gpus.log_lines()  # crun shows only the hook's exit code; runc also its line
    assert record["error"].startswith(f"mount {target}: {target}: is on a shared mount")
    if runtime == "runc":
        assert f"gpuhook: {record['error']}" in result.stderr


def test_an_ipc_socket_is_left_out_rather_than_attached_onto_a_shared_file_volume(gpus, shared_dir):
    before = mounts_under(shared_dir)
    result = gpus.run("propagate-ipc", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=shared_rootfs,
                      mounts=[file_volume(shared_dir / "victim", PERSISTENCED)], paths=[PERSISTENCED])
    assert mounts_under(shared_dir) == before
    assert (shared_dir / "victim").read_text() == HOST_TEXT
    assert result.returncode == 0, result.stderr
    assert result.probes()[PERSISTENCED]["type"] == "reg"  # the pod's file, nothing on top of it
    (record,) = gpus.log_lines()
    assert f"{PERSISTENCED} not mounted: {PERSISTENCED} is on a shared mount" in " ".join(record["notes"])


def test_podman_rshared_file_volume_never_gets_a_driver_library_on_top(bed, sim_host, probe, tmp_path, shared_dir):
    """Under podman `-v FILE:TARGET:rshared` alone makes the volume a peer of the host's mount."""
    require_root_tools("podman")
    from test_podman import install_podman

    gpus = PodmanGpus(bed, sim_host, probe, tmp_path, str(tmp_path / "hooks.d"))
    install_podman(tmp_path / "hooks.d", gpus.config)
    target = f"{LIBDIR}/libnvidia-ml.so.{gpus.version}"
    before = mounts_under(shared_dir)
    try:
        rootfs = bed.rootfs(f"{tmp_path}/rootfs/podman-shared", files={"/bin/probe": probe})
        argv = gpus.podman.argv(rootfs, ["/bin/probe", target], env=["NVIDIA_VISIBLE_DEVICES=0"],
                                cap_add=("MKNOD",))
        argv[argv.index("--rootfs"):argv.index("--rootfs")] = ["-v", f"{shared_dir}/victim:{target}:rshared"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd="/")
        assert gpus.podman.wait_until_idle()
        assert mounts_under(shared_dir) == before
        assert (shared_dir / "victim").read_text() == HOST_TEXT
        assert done.returncode != 0
        assert f"{target}: is on a shared mount" in done.stderr
    finally:
        gpus.podman.close()


def test_a_user_namespaced_device_bind_is_never_attached_onto_a_shared_file_volume(sim_host, probe):
    """In a user namespace a device node is a bind of the host's node: the same code path as
    the libraries, the same check on the mount it would land on. (A mount namespace owned by a
    user namespace gets the host's shared mounts as slaves, so the host's table is not reached
    from here even without the check: before it, the node was attached onto the shared mount
    and the start succeeded; gpuhook cannot see where a peer group reaches, so it refuses.)"""
    from test_userns import in_user_namespace, owned_by_container_root

    workdir = tempfile.mkdtemp(prefix="gpuhook-userns-shared-")
    os.chmod(workdir, 0o755)  # the container's root (an unmapped host uid) must reach its rootfs
    shared = os.path.join(workdir, "shared")
    os.mkdir(shared)
    subprocess.run(["mount", "--bind", shared, shared], check=True)
    try:
        subprocess.run(["mount", "--make-shared", shared], check=True)
        with open(f"{shared}/victim", "w") as f:
            f.write(HOST_TEXT)
        os.chmod(f"{shared}/victim", 0o644)
        gpus = GpuContainers(testbed.Testbed(workdir), sim_host, probe, workdir)
        before = mounts_under(shared)
        result = gpus.run("userns-shared", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=owned_by_container_root,
                          edit=lambda spec: (in_user_namespace(spec), shared_rootfs(spec)),
                          mounts=[file_volume(f"{shared}/victim", "/dev/nvidia0")])
        assert mounts_under(shared) == before
        with open(f"{shared}/victim") as f:
            assert f.read() == HOST_TEXT
        assert result.returncode != 0
        assert "gpuhook: device node /dev/nvidia0: /dev/nvidia0: is on a shared mount" in result.stderr
    finally:
        for point in reversed(mounts_under(shared)):
            subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
