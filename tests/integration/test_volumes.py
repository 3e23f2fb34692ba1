"""Pod volumes, in real runc starts: gpuhook writes only on the container's rootfs and the
runtime's /dev, and a volume that stops answering never holds a start past its deadline.

- An image can point its library dir or /etc into a pod volume (`/usr/lib64 -> /vol/lib`):
  writes through it would be host root's writes into the host directory behind the volume.
  Every write path stays on the rootfs's own mount (RESOLVE_NO_XDEV); a required item there
  fails the start naming the container path, an IPC endpoint is left out with a note
  (docs/security.md, "Writes only on the rootfs and the runtime's /dev").
- A FUSE volume whose backend stopped answering (tests/helpers/hangfs.py) is never asked
  anything: not by the worker (the same rule), not by ldconfig (its sandbox holds no volume).
- When a filesystem gpuhook must use stalls anyway (here a driver binary on such a FUSE),
  the worker stuck in the kernel is not waited for: the start ends one line, exit 7 and a
  log record of exactly what is left, within a second of its deadline; the record is reaped
  once the worker is gone (gpuhook.apply.leftovers).
"""

import json
import os
import shutil
import subprocess
import time
import pytest
from conftest import (LIBDIR, GpuContainers, assert_rootfs_clean, require_root_tools, run_hook_process)
from helpers.hangfs import StalledFuse
from test_bad_input import snapshot
from gpuhook.discover import ldcache
from gpuhook.simulate import host as simhost


pytestmark = pytest.mark.root


ANOTHER_MOUNT = "lies on another mount than the container's rootfs"


def gpuhook_line(result) -> str:
    """The hook's one line, as runc quotes it in its own error."""
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    return line[line.index("gpuhook: "):].removesuffix('"').removesuffix("\\n")


def glibc_image(rootfs):
    """A loader where a glibc image has one: the image's ld cache is then gpuhook's to update
    wherever /etc leads (docs/ldconfig.md)."""
    os.makedirs(f"{rootfs}/lib64", exist_ok=True)
    with open(f"{rootfs}/lib64/ld-linux-x86-64.so.2", "w") as f:
        f.write("a loader")


def link(rootfs, path, target):
    full = rootfs + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full)
    os.symlink(target, full)


def bind(source, destination, *options) -> dict:
    return {"destination": destination, "type": "bind", "source": str(source), "options": ["rbind", *options]}


@pytest.fixture
def host_dir(tmp_path):
    """A root-owned host directory as a pod would get it in a hostPath volume, with an ld
    cache and a library link of its own (what the attack replaced)."""
    vol = tmp_path / "host-volume"
    (vol / "lib").mkdir(parents=True)
    (vol / "etc").mkdir()
    (vol / "etc" / "ld.so.cache").write_text("the host directory's own file\n")
    (vol / "etc" / "ld.so.conf").write_text("")
    (vol / "lib" / "libcuda.so.1").symlink_to("libcuda.so.1.0")
    for path in (vol, vol / "lib", vol / "etc"):
        os.chmod(path, 0o755)
    return vol


def volume_links(rootfs):
    glibc_image(rootfs)
    link(rootfs, LIBDIR, "/vol/lib")
    link(rootfs, "/etc", "/vol/etc")


def test_root_writes_are_never_redirected_into_a_pod_volume(gpus, host_dir):
    before = snapshot(str(host_dir))
    result = gpus.run("vol-links", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[bind(host_dir, "/vol")],
                      rootfs_setup=volume_links, edit=lambda spec: spec["process"]["user"].update(uid=1000))
    assert snapshot(str(host_dir)) == before
    assert result.returncode != 0
    line = gpuhook_line(result)
    assert f": {LIBDIR}: {ANOTHER_MOUNT}" in line and line.startswith("gpuhook: mount ")
    assert "cleanup" not in line


def test_an_ld_cache_in_a_pod_volume_is_refused_naming_etc(gpus, host_dir):
    before = snapshot(str(host_dir))
    result = gpus.run("vol-etc", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[bind(host_dir, "/vol")],
                      rootfs_setup=lambda rootfs: (glibc_image(rootfs), link(rootfs, "/etc", "/vol/etc")))
    assert snapshot(str(host_dir)) == before
    assert result.returncode != 0
    assert gpuhook_line(result) == f"gpuhook: ldconfig: /etc: {ANOTHER_MOUNT} (a volume, or the runtime's)"
    assert_rootfs_clean(result.rootfs)


def test_an_ipc_socket_whose_directory_is_a_pod_volume_is_left_out_with_a_note(gpus, host_dir):
    before = snapshot(str(host_dir))
    result = gpus.run("vol-ipc", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[bind(host_dir, "/vol")],
                      rootfs_setup=lambda rootfs: link(rootfs, "/var/run", "/vol/lib"))
    assert snapshot(str(host_dir)) == before
    assert result.returncode == 0, result.stderr
    (record,) = gpus.log_lines()
    assert (f"/var/run/nvidia-persistenced/socket not mounted: /var/run {ANOTHER_MOUNT}"
            in " ".join(record["notes"])), record


@pytest.mark.parametrize("etc, make_volume", [
    ("/sys/kernel", None),
    ("/dev/mqueue", None),
    ("/etc", "read-only host directory"),
])
def test_an_etc_on_another_filesystem_fails_naming_etc_and_no_phantom_cleanup(gpus, tmp_path, etc, make_volume):
    """Each once ended in a message that named neither the file nor the operation
    ("ldconfig: Invalid argument") or reported a cleanup failure for a file that never
    existed ("could not remove ld.so.cache")."""
    mounts = []
    if make_volume:
        ro = tmp_path / "ro-etc"
        ro.mkdir()
        mounts.append(bind(ro, "/etc", "ro"))

    def setup(rootfs):
        glibc_image(rootfs)
        if etc != "/etc":
            link(rootfs, "/etc", etc)

    result = gpus.run("etc-elsewhere", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=mounts, rootfs_setup=setup)
    assert result.returncode != 0
    assert gpuhook_line(result) == f"gpuhook: ldconfig: /etc: {ANOTHER_MOUNT} (a volume, or the runtime's)"


# A FUSE volume whose backend stopped answering. Deadline 5 s: before these defences the
# first start ran into runc's 30 s hook timeout, the second left ldconfig stuck.
@pytest.fixture
def stalled_volume(tmp_path):
    mountpoint = tmp_path / "fuse-volume"
    mountpoint.mkdir()
    fuse = StalledFuse(mountpoint, "dir")
    try:
        yield mountpoint
    finally:
        fuse.stop()


def stuck_processes() -> list:
    """(pid, command) of every process in state D."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "D":
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                if command:  # not a kernel thread
                    found.append((int(pid), command))
        except (OSError, IndexError):
            continue
    return found


def test_a_path_through_a_stalled_volume_is_refused_without_asking_it(gpus, stalled_volume):
    gpus.configure(**{"deadline-seconds": 5})
    started = time.monotonic()
    result = gpus.run("stalled-bin", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[bind(stalled_volume, "/fv")],
                      rootfs_setup=lambda rootfs: link(rootfs, "/usr/bin", "/fv/hang"))
    took = time.monotonic() - started
    assert stuck_processes() == []
    assert took < 5, took
    assert result.returncode != 0
    assert f"/usr/bin: {ANOTHER_MOUNT}" in gpuhook_line(result)
    assert_rootfs_clean(result.rootfs)


def test_ldconfig_never_reads_a_stalled_volume(gpus, stalled_volume):
    gpus.configure(**{"deadline-seconds": 5})

    def include_volume(rootfs):
        with open(f"{rootfs}/etc/ld.so.conf", "w") as f:
            f.write("include /fv/hang/*.conf\n/fv/hang/lib\n")

    started = time.monotonic()
    result = gpus.run("stalled-ldconfig", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[bind(stalled_volume, "/fv")],
                      rootfs_setup=include_volume, paths=[f"{LIBDIR}/libcuda.so.1"])
    took = time.monotonic() - started
    assert stuck_processes() == []
    assert took < 5, took
    assert result.returncode == 0, result.stderr
    assert result.probes()[f"{LIBDIR}/libcuda.so.1"]["type"] == "reg"
    # The sandbox left the volume out and kept gpuhook's own mounts: the driver is in the cache.
    names = {entry.soname for entry in ldcache.read(f"{result.rootfs}/etc/ld.so.cache")}
    assert "libcuda.so.1" in names and "libnvidia-ml.so.1" in names


@pytest.fixture(scope="module")
def stalling_host(tmp_path_factory):
    """A simulated host of its own whose nvidia-debugdump will be a file on a stalled FUSE."""
    require_root_tools("gcc", "ldconfig", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("stalling") / "host"), gpus=1, seed="stalling")


def test_a_worker_stuck_in_the_kernel_is_left_recorded_and_reaped_later(bed, stalling_host, probe, tmp_path):
    """The driver's nvidia-debugdump answers the host (discovery) but never the container's
    namespace: the worker, three mounts in, waits on it in the kernel and does not die of
    SIGKILL. The start ends a second after its deadline with exit 7, one line and a record of
    exactly what the worker left; a second start on that rootfs is refused while it is stuck;
    once the filesystem lets go, poststop takes back what was left."""
    (tmp_path / "work").mkdir()
    gpus = GpuContainers(bed, stalling_host, probe, tmp_path / "work")
    gpus.configure(**{"deadline-seconds": 3})
    binary = f"{stalling_host['directory']}/driver/usr/bin/nvidia-debugdump"
    fuse = StalledFuse(binary, "file", size=os.path.getsize(binary))
    try:
        started = time.monotonic()
        result = gpus.run("stuck", env=["NVIDIA_VISIBLE_DEVICES=0"])
        took = time.monotonic() - started
        assert took < 3 + 1 + 0.5, took  # the deadline, its second, and runc's own work
        assert "exit status 7" in result.stderr
        line = gpuhook_line(result)
        assert line.startswith("gpuhook: hook deadline passed during mount /usr/bin/nvidia-debugdump")
        assert "namespace worker" in line and "stuck in the kernel" in line
        (record,) = gpus.log_lines()
        left = record["left_behind"]
        stuck = [pid for pid, _ in stuck_processes() if pid == left["worker"]]
        assert stuck, left
        assert left["step"] == "mount /usr/bin/nvidia-debugdump"
        assert f"dir {LIBDIR}" in left["made"] and "file /usr/bin/nvidia-smi" in left["made"]
        assert f"file {LIBDIR}/libcuda.so.{gpus.version}" in left["made"]
        assert all(os.path.lexists(result.rootfs + entry.split(" ", 1)[1]) for entry in left["made"]
                   if not entry.split(" ", 1)[1].startswith("/dev/"))

        again = gpus.run("stuck", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert again.returncode != 0
        assert f"left its namespace worker (pid {left['worker']}) stuck in the kernel" in gpuhook_line(again)
    finally:
        fuse.stop()
    for _ in range(100):
        if not os.path.exists(f"/proc/{left['worker']}"):
            break
        time.sleep(0.05)
    state = {"ociVersion": "1.0.2", "id": "stuck", "status": "stopped", "pid": 0,
             "bundle": f"{bed.workdir}/bundles/stuck"}
    done = run_hook_process(["poststop", "--config", gpus.config], json.dumps(state).encode())
    assert done.returncode == 0, done.stderr
    (stop,) = [r for r in gpus.log_lines() if r.get("stage") == "poststop"]
    (reaped,) = stop["leftovers"]
    assert reaped["problems"] == [] and reaped["container"] == "stuck"
    assert_rootfs_clean(result.rootfs)
    assert os.listdir(f"{tmp_path}/work/run/leftovers") == []
    subprocess.run(["true"])  # nothing of the start is left: the worker is gone, its files too
