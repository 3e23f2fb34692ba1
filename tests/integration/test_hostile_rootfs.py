"""Hostile images: every trap an image can set in its rootfs, in a real runc container start.

For each image the host must lose nothing: a sentinel directory outside the rootfs (the
target every trap aims at) and the host mount table are compared before and after, and the
start either gives the container a safe result or fails with one clear gpuhook line.
(Issue 7, item 1; CVE-2024-0132, CVE-2024-0134, CVE-2025-23359 were escapes of this kind.)
"""

import json
import os
import shutil
import socket
import threading
import time

import pytest

from conftest import LIBDIR, gpus_denied_parent, host_mounts

from test_bad_input import snapshot

pytestmark = pytest.mark.root


@pytest.fixture
def sentinel(tmp_path):
    host = tmp_path / "host-sentinel"
    (host / "lib").mkdir(parents=True)
    (host / "lib" / "precious.so").write_text("host library: must not change\n")
    (host / "etc").mkdir()
    (host / "etc" / "ld.so.cache").write_text("host cache\n")
    return host


def _link(rootfs, path, target):
    full = rootfs + path
    os.makedirs(os.path.dirname(full), exist_ok=True)
    if os.path.isdir(full) and not os.path.islink(full):
        shutil.rmtree(full)
    elif os.path.lexists(full):
        os.remove(full)
    os.symlink(target, full)


def trap(kind, sentinel):
    """A rootfs_setup callback for each trap."""
    host = str(sentinel)

    def setup(rootfs):
        if kind == "libdir -> absolute host path":
            _link(rootfs, LIBDIR, f"{host}/lib")
        elif kind == "libdir -> climbing relative path":
            _link(rootfs, LIBDIR, "../../../../../../../../.." + f"{host}/lib")
        elif kind == "libdir -> chain to host":
            _link(rootfs, LIBDIR, "/chain1")
            _link(rootfs, "/chain1", "/chain2")
            _link(rootfs, "/chain2", f"{host}/lib")
        elif kind == "libdir -> loop":
            _link(rootfs, LIBDIR, "/usr/loop")
            _link(rootfs, "/usr/loop", LIBDIR)
        elif kind == "libdir -> in-image /etc":
            os.makedirs(rootfs + "/etc", exist_ok=True)
            _link(rootfs, LIBDIR, "/etc")
        elif kind == "usr -> host root":
            _link(rootfs, "/usr", "/")
        elif kind == "bin dir -> host path":
            _link(rootfs, "/usr/bin", f"{host}/lib")
        elif kind == "etc -> host etc":
            _link(rootfs, "/etc", f"{host}/etc")
        elif kind == "etc -> host etc in a glibc image":
            _link(rootfs, "/etc", f"{host}/etc")
            os.makedirs(rootfs + "/lib64", exist_ok=True)
            with open(rootfs + "/lib64/ld-linux-x86-64.so.2", "w") as f:
                f.write("a loader")
        elif kind == "ld.so.cache -> host file":
            os.makedirs(rootfs + "/etc", exist_ok=True)
            _link(rootfs, "/etc/ld.so.cache", f"{host}/etc/ld.so.cache")
        elif kind == "ld.so.conf names host dirs":
            os.makedirs(rootfs + "/etc", exist_ok=True)
            with open(rootfs + "/etc/ld.so.conf", "w") as f:
                f.write(f"{host}/lib\n/../../../{host}/lib\ninclude /proc/self/root{host}/etc/*\n")
        elif kind == "firmware dir -> host path":
            _link(rootfs, "/lib/firmware", f"{host}/lib")
        elif kind == "library file is a symlink to a host file":
            os.makedirs(rootfs + LIBDIR, exist_ok=True)
            _link(rootfs, f"{LIBDIR}/libcuda.so.{VERSION[0]}", f"{host}/lib/precious.so")
        elif kind == "soname link points at a host file":
            os.makedirs(rootfs + LIBDIR, exist_ok=True)
            _link(rootfs, f"{LIBDIR}/libcuda.so.1", f"{host}/lib/precious.so")
        elif kind == "fifo where a library goes":
            os.makedirs(rootfs + LIBDIR, exist_ok=True)
            os.mkfifo(rootfs + f"{LIBDIR}/libcuda.so.{VERSION[0]}")
        elif kind == "socket where a binary goes":
            os.makedirs(rootfs + "/usr/bin", exist_ok=True)
            s = socket.socket(socket.AF_UNIX)
            # By a short name from the directory: the path may pass sun_path's 108 bytes
            # (pytest's temporary directories grow with each run on a host).
            here = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.chdir(rootfs + "/usr/bin")
                s.bind("nvidia-smi")
            finally:
                os.fchdir(here)
                os.close(here)
            s.close()
        elif kind == "file where a directory goes":
            os.makedirs(rootfs + "/usr", exist_ok=True)
            with open(rootfs + LIBDIR, "w") as f:
                f.write("not a directory")
        elif kind == "persistenced socket path -> host":
            _link(rootfs, "/var/run", f"{host}/etc")
        elif kind == "proc dir is a symlink":
            os.rmdir(rootfs + "/proc") if os.path.isdir(rootfs + "/proc") else None
            _link(rootfs, "/proc", f"{host}/etc")
        elif kind == "very deep library dir":
            deep = "/" + "/".join(["deep"] * 120)
            os.makedirs(rootfs + deep)
            _link(rootfs, LIBDIR, deep)
        else:
            raise AssertionError(kind)

    return setup


VERSION = ["?"]  # the simulated driver version, set by the fixture below
MISSING_DIR = "is a symlink to a missing directory"
# What each trap must end in: None = the container starts with its GPU (the trap was
# contained inside the rootfs), else the fragment of the one gpuhook line that fails it.
TRAPS = {
    "libdir -> absolute host path": MISSING_DIR,
    "libdir -> climbing relative path": MISSING_DIR,
    "libdir -> chain to host": MISSING_DIR,
    "libdir -> loop": "Too many levels of symbolic links",
    "libdir -> in-image /etc": None,
    "usr -> host root": None,
    "bin dir -> host path": MISSING_DIR,
    "etc -> host etc": None,  # no /etc inside the rootfs: not a glibc image, no ld cache to write
    "etc -> host etc in a glibc image": "ldconfig: /etc: " + MISSING_DIR,
    "ld.so.cache -> host file": None,
    "ld.so.conf names host dirs": None,
    "firmware dir -> host path": MISSING_DIR,
    "library file is a symlink to a host file": "exists and is a symlink",
    "soname link points at a host file": None,
    "fifo where a library goes": "exists and is a FIFO",
    "socket where a binary goes": "exists and is a socket",
    "file where a directory goes": "exists and is not a directory",
    "persistenced socket path -> host": MISSING_DIR,
    "proc dir is a symlink": "RUNTIME",  # runc itself refuses before any hook runs
    "very deep library dir": None,
}


@pytest.mark.parametrize("kind", sorted(TRAPS))
def test_hostile_rootfs_never_reaches_the_host(gpus, sentinel, kind):
    VERSION[0] = gpus.version
    before = (host_mounts(), snapshot(str(sentinel)))
    result = gpus.run("hostile", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=trap(kind, sentinel),
                      paths=[f"{LIBDIR}/libcuda.so.1"])
    assert (host_mounts(), snapshot(str(sentinel))) == before, kind
    expected = TRAPS[kind]
    if expected is None:
        assert result.returncode == 0, result.stderr
        probes = result.probes()
        assert probes["/dev/nvidia0"]["read"] == "ENXIO"
        assert probes[f"{LIBDIR}/libcuda.so.1"]["type"] == "reg"  # the host driver, inside the rootfs
    elif expected == "RUNTIME":
        assert result.returncode != 0 and "gpuhook" not in result.stderr
    else:
        assert result.returncode != 0
        (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
        assert expected in line, line


def test_mount_targets_in_a_rootfs_that_keeps_changing_never_leave_it(gpus, sentinel):
    """A symlink swapped in and out during the hook (the CVE-2024-0132 race): many starts
    while another thread flips the library dir between a real directory and a link to the
    host. Each start succeeds or fails cleanly; the host never changes."""
    rootfs_box = {}

    def remember(rootfs):
        os.makedirs(rootfs + "/usr", exist_ok=True)
        rootfs_box["path"] = rootfs

    stop = threading.Event()
    flips = [0]

    def flipper():
        moved = 0
        while not stop.is_set():
            rootfs = rootfs_box.get("path")
            if not rootfs:
                time.sleep(0.001)
                continue
            target = rootfs + LIBDIR
            try:
                if os.path.islink(target):
                    os.remove(target)
                    os.mkdir(target)
                elif os.path.isdir(target):  # move what the hook made aside, put a link to the host there
                    moved += 1
                    os.rename(target, f"{target}.moved{moved}")
                    os.symlink(f"{sentinel}/lib", target)
                else:
                    os.symlink(f"{sentinel}/lib", target)
                flips[0] += 1
            except OSError:
                pass

    before = (host_mounts(), snapshot(str(sentinel)))
    thread = threading.Thread(target=flipper, daemon=True)
    thread.start()
    outcomes = []
    try:
        for i in range(12):
            result = gpus.run(f"race{i}", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=remember)
            outcomes.append(result.returncode)
            if result.returncode != 0:
                assert "gpuhook:" in result.stderr or "runc" in result.stderr
    finally:
        stop.set()
        thread.join()
    assert (host_mounts(), snapshot(str(sentinel))) == before
    assert len(outcomes) == 12
    assert flips[0] > 0  # the race was really run: the library dir did change under the hook


# The host's real ldconfig against images that aim it at the host through procfs magic links
# (before pivot_root the container's /proc/1/root is the runtime's init, whose root is the
# host's /), at special files, or at huge ones. gpuhook.apply.ldsandbox runs it where none of these
# exist; each start ends in the container's own cache or one clean failure, and the host's
# sentinel is untouched.
HOST_SECRET = "HOSTSECRET-must-never-show"


def ldconfig_trap(kind, sentinel):
    host = str(sentinel)
    magic = f"/proc/1/root{host}"

    def setup(rootfs):
        os.makedirs(rootfs + "/etc/ld.so.conf.d", exist_ok=True)
        if kind == "aux cache dir -> host dir":
            os.makedirs(rootfs + "/var/cache", exist_ok=True)
            _link(rootfs, "/var/cache/ldconfig", f"{magic}/etc")
        elif kind == "var/cache -> host dir":
            os.makedirs(rootfs + "/var", exist_ok=True)
            _link(rootfs, "/var/cache", f"{magic}/etc")
        elif kind == "etc/ld.so.cache -> host cache by magic link":
            _link(rootfs, "/etc/ld.so.cache", f"{magic}/etc/ld.so.cache")
        elif kind == "include of a host file, then ldconfig fails":
            with open(rootfs + "/etc/ld.so.conf", "w") as f:
                f.write(f"include {magic}/etc/secret.conf\ninclude /etc/ld.so.conf.d/*.conf\n")
            with open(rootfs + "/etc/ld.so.conf.d/huge.conf", "wb") as f:
                f.truncate(8 << 30)  # sparse: 8 GiB of zeros, no newline
        elif kind == "include /dev/zero":
            with open(rootfs + "/etc/ld.so.conf", "w") as f:
                f.write("include /dev/zero\n")
        elif kind == "huge sparse file in ld.so.conf.d":
            with open(rootfs + "/etc/ld.so.conf.d/huge.conf", "wb") as f:
                f.truncate(8 << 30)
        elif kind == "scanned lib dir -> host dir by magic link":
            _link(rootfs, "/usr/local/lib", f"{magic}/lib")
            with open(rootfs + "/etc/ld.so.conf", "w") as f:
                f.write("/usr/local/lib\n")
        else:
            raise AssertionError(kind)

    return setup


LDCONFIG_TRAPS = (
    "aux cache dir -> host dir",
    "var/cache -> host dir",
    "etc/ld.so.cache -> host cache by magic link",
    "include of a host file, then ldconfig fails",
    "include /dev/zero",
    "huge sparse file in ld.so.conf.d",
    "scanned lib dir -> host dir by magic link",
)


@pytest.mark.parametrize("kind", LDCONFIG_TRAPS)
def test_ldconfig_never_reaches_the_host_through_magic_links_or_special_files(gpus, sentinel, kind):
    (sentinel / "etc" / "secret.conf").write_text(f"x={HOST_SECRET}\n")
    before = (host_mounts(), snapshot(str(sentinel)))
    start = time.monotonic()
    result = gpus.run("ld-hostile", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=ldconfig_trap(kind, sentinel))
    took = time.monotonic() - start
    assert (host_mounts(), snapshot(str(sentinel))) == before, kind
    assert HOST_SECRET not in result.stderr + result.stdout
    assert HOST_SECRET not in json.dumps(gpus.log_lines())  # not even read
    assert took < 15, took  # bounded by ldconfig's limits, not by the hook's 25 s deadline
    if result.returncode != 0:
        (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
        assert "host ldconfig" in line, line
    else:
        assert result.probes()["/dev/nvidia0"]["read"] == "ENXIO"


def test_an_aborted_start_puts_back_a_magic_linked_ld_cache_without_following_it(gpus, sentinel):
    """The worker sets the image's ld.so.cache aside before installing its own, so that an
    abort (here the cgroup grant, run meanwhile, fails) can put it back. Aside and back are
    renames in the image's /etc: the link through /proc/1/root is never followed, and it is
    the same link afterwards."""
    (sentinel / "etc" / "ld.so.cache").write_text(HOST_SECRET)
    link = f"/proc/1/root{sentinel}/etc/ld.so.cache"
    with gpus_denied_parent("gpuhook-hostile", "aborted") as under_parent:
        before = (host_mounts(), snapshot(str(sentinel)))
        result = gpus.run("ld-link-aborted", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=under_parent,
                          rootfs_setup=lambda rootfs: _link(rootfs, "/etc/ld.so.cache", link))
        assert result.returncode != 0 and "cgroup: cannot allow" in result.stderr
        assert (host_mounts(), snapshot(str(sentinel))) == before
        assert os.readlink(result.rootfs + "/etc/ld.so.cache") == link
        assert sorted(os.listdir(result.rootfs + "/etc")) == ["ld.so.cache", "ld.so.conf"]
        assert HOST_SECRET not in result.stderr + json.dumps(gpus.log_lines())


def test_swapping_etc_for_a_magic_link_while_ldconfig_scans_never_reaches_the_host(gpus, sentinel):
    """A second process (a sidecar sharing the rootfs) flips the image's /etc between a
    directory and a link to the host's /etc through /proc/1/root while ldconfig scans a big
    directory, over many starts. The host's ld.so.cache never changes."""
    rootfs_box = {}
    magic_etc = f"/proc/1/root{sentinel}/etc"

    def setup(rootfs):
        many = rootfs + "/usr/local/lib"
        os.makedirs(many)
        for i in range(3000):
            with open(f"{many}/libpad{i}.so.1", "w") as f:
                f.write("not an ELF file")
        with open(rootfs + "/etc/ld.so.conf", "w") as f:
            f.write("/usr/local/lib\n")
        rootfs_box["path"] = rootfs

    stop = threading.Event()
    flips = [0]

    def ldconfig_running() -> bool:
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.readlink(f"/proc/{pid}/exe").endswith("/ldconfig"):
                    return True
            except OSError:
                pass
        return False

    def flipper():
        # The attacker's best timing: /etc is a real directory whenever the hook checks it,
        # and a link to the host the moment ldconfig runs.
        while not stop.is_set():
            rootfs = rootfs_box.get("path")
            if not rootfs:
                time.sleep(0.001)
                continue
            etc = rootfs + "/etc"
            try:
                if ldconfig_running() and not os.path.islink(etc):
                    os.rename(etc, etc + ".real")
                    os.symlink(magic_etc, etc)
                    flips[0] += 1
                elif os.path.islink(etc) and not ldconfig_running():
                    os.remove(etc)
                    os.rename(etc + ".real", etc)
            except OSError:
                pass

    before = (host_mounts(), snapshot(str(sentinel)))
    thread = threading.Thread(target=flipper, daemon=True)
    thread.start()
    outcomes = []
    try:
        for i in range(10):
            rootfs_box.clear()
            result = gpus.run(f"etc-race{i}", env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs_setup=setup)
            outcomes.append(result.returncode)
            if result.returncode != 0:
                assert "gpuhook:" in result.stderr or "runc" in result.stderr
    finally:
        stop.set()
        thread.join()
    assert (host_mounts(), snapshot(str(sentinel))) == before
    assert flips[0] > 0
