"""Containers with a user namespace (podman --userns, Kubernetes hostUsers: false).

Inside a user namespace a device node on the container's own /dev tmpfs cannot be opened and
host root cannot even create files there (its uid is not mapped), so gpuhook opens the host's
files first, then joins the container's user namespace and works as the container's root:
device nodes are bind mounts of the host's nodes (as runc does for its own devices), and
every file it creates belongs to the container's root.
"""

import os
import shutil
import tempfile

import pytest

from conftest import LIBDIR, GpuContainers

pytestmark = pytest.mark.root

HOST_ID = 200000
SIZE = 65536


@pytest.fixture
def userns_gpus(sim_host, probe):
    """GpuContainers whose bundles live under a world-traversable directory: the container's
    root is host uid 200000, which must be able to reach its rootfs."""
    from helpers import testbed

    workdir = tempfile.mkdtemp(prefix="gpuhook-userns-")
    os.chmod(workdir, 0o755)
    try:
        yield GpuContainers(testbed.Testbed(workdir), sim_host, probe, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def in_user_namespace(spec):
    spec["linux"]["namespaces"].append({"type": "user"})
    spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": HOST_ID, "size": SIZE}]
    spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": HOST_ID, "size": SIZE}]


def owned_by_container_root(rootfs):
    for directory, dirs, files in os.walk(rootfs):
        for name in dirs + files + ["."]:
            os.lchown(os.path.join(directory, name), HOST_ID, HOST_ID)


def test_user_namespaced_container_gets_its_gpu(userns_gpus):
    gpus = userns_gpus
    lib = f"{LIBDIR}/libcuda.so.{gpus.version}"
    result = gpus.run("userns", env=["NVIDIA_VISIBLE_DEVICES=1"], edit=in_user_namespace,
                      rootfs_setup=owned_by_container_root, before="busybox mknod /dev/test-gpu0 c 195 0",
                      paths=[lib, f"{LIBDIR}/libcuda.so.1", "/dev/test-gpu0", "/usr/bin/nvidia-smi"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert p["/dev/nvidia1"]["type"] == "chr" and p["/dev/nvidia1"]["read"] == "ENXIO"
    assert p["/dev/nvidiactl"]["read"] == "ENXIO" and not p["/dev/nvidia0"]["exists"]
    # Read-only mount; the write is refused before that is checked (the file's owner is not mapped).
    assert p[lib]["readonly_mount"] is True and p[lib]["write"] in ("EROFS", "EACCES")
    assert p[f"{LIBDIR}/libcuda.so.1"]["link"] == f"libcuda.so.{gpus.version}"
    # What gpuhook created in the image belongs to the container's root, not to an unmapped uid.
    for made in (LIBDIR, f"{LIBDIR}/libcuda.so.1", "/etc/ld.so.cache"):
        st = os.lstat(result.rootfs + made)
        assert (st.st_uid, st.st_gid) == (HOST_ID, HOST_ID), made
    line = gpus.log_lines()[-1]
    assert line["decision"] == "gpus injected" and any("user namespace" in n for n in line["notes"])


def test_user_namespaced_failure_is_undone(userns_gpus):
    def blocker(rootfs):
        os.makedirs(f"{rootfs}/usr/bin/nvidia-smi")
        owned_by_container_root(rootfs)

    result = userns_gpus.run("userns-undo", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=in_user_namespace,
                             rootfs_setup=blocker)
    assert result.returncode != 0
    assert "mount /usr/bin/nvidia-smi" in result.stderr and "exists and is a directory" in result.stderr
    assert not os.path.exists(result.rootfs + LIBDIR)
