"""The image's environment never reaches the hook's interpreter or anything it starts.

CVE-2025-23266: a hook that inherited the container's LD_PRELOAD ran the image's code as host
root. Here an image sets LD_PRELOAD, LD_LIBRARY_PATH, PATH and PYTHON* to things that leave
a marker file if they ever run; the runtime is also started with PYTHON* variables of its own
(a hook registered without `env` inherits those). No marker may appear, and the host
ldconfig the hook starts must see an empty environment and a working directory outside the
rootfs. (Issue 7, item 2.)
"""

import ctypes
import os
import socket
import stat
import subprocess

import pytest

from conftest import fake_ldconfig, require_root_tools

pytestmark = pytest.mark.root

EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void evil(void) {
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "preload ran\n", 12); close(fd); }
}
"""


@pytest.fixture
def evil(tmp_path):
    """Booby traps on the host and in the image, all writing to one marker file."""
    require_root_tools("gcc")
    marker = tmp_path / "MARKER"
    lib = tmp_path / "evil"
    lib.mkdir()
    (lib / "evil.c").write_text(EVIL_C)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib / "evil.so"),
                    str(lib / "evil.c")], check=True)
    for name in ("sitecustomize.py", "usercustomize.py", "json.py", "tomllib.py", "gpuhook.py", "startup.py"):
        (lib / name).write_text(f"open({str(marker)!r}, 'a').write('python hook ran: {name}\\n')\n")
    for name in ("ldconfig", "sh", "python3"):
        (lib / name).write_text(f"#!/bin/sh\necho 'PATH binary ran: {name}' >> {marker}\n")
        (lib / name).chmod(0o755)
    env = [f"LD_PRELOAD={lib}/evil.so", f"LD_LIBRARY_PATH={lib}", f"PATH={lib}:/bin",
           f"PYTHONPATH={lib}", f"PYTHONSTARTUP={lib}/startup.py", f"PYTHONHOME={lib}",
           f"PYTHONUSERBASE={lib}", "PYTHONINSPECT=1", "PYTHONVERBOSE=1"]
    return marker, lib, env


def test_image_environment_reaches_neither_the_hook_nor_its_children(gpus, evil, tmp_path):
    marker, lib, env = evil
    gpus.configure(ldconfig=fake_ldconfig(tmp_path))  # a spy: it prints what it sees

    def copy_traps_into_image(rootfs):  # the image carries the same traps at the same paths
        os.makedirs(rootfs + str(lib), exist_ok=True)
        for name in os.listdir(lib):
            with open(lib / name, "rb") as src, open(rootfs + str(lib / name), "wb") as dst:
                dst.write(src.read())

    result = gpus.run("hygiene", env=["NVIDIA_VISIBLE_DEVICES=0"] + env, rootfs_setup=copy_traps_into_image)
    assert result.returncode == 0, result.stderr
    assert result.probes()["/dev/nvidia0"]["read"] == "ENXIO"
    assert not marker.exists(), marker.read_text()
    seen = gpus.log_lines()[-1]["ldconfig_output"].splitlines()
    assert not [line for line in seen if line.startswith("ENV ")], seen
    assert "CWD /" in seen


def test_host_ldconfig_runs_with_no_capability_no_procfs_and_a_read_only_rootfs(gpus, tmp_path):
    """The sandbox the host's ldconfig runs in (gpuhook.apply.ldsandbox), as ldconfig sees it."""
    gpus.configure(ldconfig=fake_ldconfig(tmp_path))

    def image_dev_zero(rootfs):  # the image's own node, under the runtime's /dev (which the sandbox leaves out)
        os.makedirs(f"{rootfs}/dev", exist_ok=True)
        os.mknod(f"{rootfs}/dev/zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))

    result = gpus.run("ldconfig-sandbox", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=image_dev_zero)
    assert result.returncode == 0, result.stderr
    seen = gpus.log_lines()[-1]["ldconfig_output"].splitlines()
    assert "CAPS 0 0 0 0 0 0" in seen and "BOUNDING_SYS_ADMIN 0" in seen and "NO_NEW_PRIVS 1" in seen
    assert f"RLIMIT_AS {512 << 20}" in seen and "RLIMIT_CPU 10" in seen
    assert "OPEN /proc/1/root/etc/hostname No such file or directory" in seen
    assert "OPEN /proc/self/mountinfo No such file or directory" in seen
    assert "OPEN /sys/kernel/uevent_seqnum No such file or directory" in seen
    assert "OPEN /dev/zero Permission denied" in seen  # the copy of the rootfs is nodev
    assert "WRITE_ROOTFS Read-only file system" in seen, "\n".join(seen)
    # The seccomp filter (attacker pass 13, B1, B2): no keyring of the host's root, no new
    # process, no memory outside its address space, no user namespace of its own.
    for call in ("ADD_KEY", "REQUEST_KEY", "KEYCTL", "FORK", "MEMFD", "UNSHARE_USER", "SOCKET", "PDEATHSIG",
                 "SEMGET", "INOTIFY", "FLOCK"):
        assert f"{call} Operation not permitted" in seen, (call, seen)
    assert "HOSTNAME ldconfig" in seen  # not the host's name
    with open(result.rootfs + "/etc/ld.so.cache", "rb") as f:
        assert f.read().startswith(b"glibc-ld.so.cache1.1")  # what it wrote, installed


def test_host_ldconfig_can_neither_signal_host_processes_nor_reach_host_sockets(gpus, tmp_path):
    """ldconfig parses the image's files: a compromised one (the spy, told by the image where
    to aim) must find no host process to signal, no host abstract UNIX socket to connect to
    and no host SysV IPC object to attach: it runs in its own PID (as its pid 1), network,
    IPC and UTS namespaces (issue 23, S1)."""
    gpus.configure(ldconfig=fake_ldconfig(tmp_path))
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x6770_0000 | (os.getpid() & 0xFFFF)
    shm = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT, owner only: root's, like the spy
    assert shm >= 0, os.strerror(ctypes.get_errno())
    victim = subprocess.Popen(["sleep", "120"])  # a host process of the same uid (root)
    name = f"gpuhook-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
        listener.listen(4)
        listener.setblocking(False)

        def aim(rootfs):
            os.makedirs(f"{rootfs}/etc", exist_ok=True)
            with open(f"{rootfs}/etc/escape-targets", "w") as f:
                f.write(f"{victim.pid} {name} {key}\n")

        result = gpus.run("ldconfig-escape", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=aim)
        assert result.returncode == 0, result.stderr
        seen = gpus.log_lines()[-1]["ldconfig_output"].splitlines()
        assert "PID 1" in seen, seen  # pid 1 of a namespace of its own
        assert "KILL No such process" in seen, seen
        assert "CONNECT Operation not permitted" in seen, seen  # no socket at all (seccomp)
        assert "SHM Operation not permitted" in seen, seen  # refused outright (seccomp)
        assert victim.poll() is None, "the host process was signalled"
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        victim.kill()
        victim.wait()
        libc.shmctl(shm, 0, None)  # IPC_RMID


def test_runtime_environment_python_variables_are_ignored_without_hook_env(gpus, evil, bed):
    """A hook entry without `env` inherits runc's environment; -I must neutralise PYTHON*."""
    marker, lib, env = evil
    python_vars = {e.split("=", 1)[0]: e.split("=", 1)[1] for e in env if e.startswith("PYTHON")}

    def no_hook_env(spec):
        del spec["hooks"]["prestart"][0]["env"]

    original_run = bed.run

    def run_with_runtime_env(bundle, container_id, timeout=60, runc_args=()):
        from helpers import testbed as tb

        saved = dict(tb.RUN_ENV)
        tb.RUN_ENV.update(python_vars)
        try:
            return original_run(bundle, container_id, timeout, runc_args)
        finally:
            tb.RUN_ENV.clear()
            tb.RUN_ENV.update(saved)

    bed.run = run_with_runtime_env
    result = gpus.run("runtime-env", env=["NVIDIA_VISIBLE_DEVICES=1"], edit=no_hook_env)
    assert result.returncode == 0, result.stderr
    assert result.probes()["/dev/nvidia1"]["read"] == "ENXIO"
    assert not marker.exists(), marker.read_text()
