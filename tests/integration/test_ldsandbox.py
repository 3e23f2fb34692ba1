"""The ldconfig sandbox on its own, with both ways of making the read-only copy (the new
mount API and, for kernels before 5.12, mount + remount), in a private mount namespace over
a rootfs with a real procfs mounted in it, as a runtime leaves it before pivot_root."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, host_mounts, require, require_root_tools

pytestmark = pytest.mark.root

# Each script runs in a private mount namespace over `root`, a runtime's bind of the rootfs
# onto itself with a procfs in it (sandbox_in_private_namespace).
SETUP = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
from gpuhook.apply import ldsandbox; from gpuhook.kernel import linux
root = {root!r}
linux.mount(root, root, None, linux.MS_BIND)
linux.mount("proc", root + "/proc", "proc", 0)
"""
OPEN = r"""fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
ld = os.open("/sbin/ldconfig", os.O_RDONLY | os.O_CLOEXEC)
"""

SCRIPT = SETUP + OPEN + r"""out = {{}}
try:
    data, output = ldsandbox.build_cache(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20, {new_api!r})
    out["magic"] = data[:20].decode()
except ldsandbox.SandboxError as err:
    out["error"] = str(err)
out["mounts_after"] = sorted(l.split()[4] for l in open("/proc/self/mountinfo"))
print(json.dumps(out))
"""


def sandbox_in_private_namespace(root, new_api: bool, script: str = SCRIPT) -> dict:
    """Run `script` over `root` in a private mount namespace; what it reported. The host's
    mount table must be unchanged."""
    before = host_mounts()
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                           script.format(repo=REPO, root=str(root), new_api=new_api)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert host_mounts() == before
    return json.loads(done.stdout)


@pytest.mark.parametrize("new_api", [True, False], ids=["open_tree+mount_setattr", "mount+remount"])
def test_the_sandbox_builds_a_cache_and_leaves_nothing_behind(tmp_path, new_api):
    require_root_tools("unshare", "ldconfig")
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64", "var/cache"):
        (root / d).mkdir(parents=True)
    (root / "etc" / "ld.so.conf").write_text(f"include /proc/1/root{tmp_path}/host/*.conf\n")
    (root / "var" / "cache" / "ldconfig").symlink_to(f"/proc/1/root{tmp_path}/host")
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "secret.conf").write_text("x=HOSTSECRET\n")
    out = sandbox_in_private_namespace(root, new_api)
    assert out.get("magic") == "glibc-ld.so.cache1.1", out
    assert sorted(p.name for p in (tmp_path / "host").iterdir()) == ["secret.conf"]  # no aux-cache
    # the sandbox's own namespace died with it: the caller's table shows none of its mounts
    assert not [p for p in out["mounts_after"] if p.startswith(str(root)) and p not in (str(root), f"{root}/proc")]


def test_a_rootfs_path_through_a_symlink_gets_its_cache(tmp_path):
    """attack4 N1: root.path as written may pass through a symlinked directory (runc refuses
    that; another runtime need not). The sandbox compares the mount table with the path the
    kernel resolved, so the start is not refused for a writable mount that is its own output."""
    require_root_tools("unshare", "ldconfig")
    real = tmp_path / "real" / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64", "tmp"):
        (real / d).mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    root = tmp_path / "link" / "rootfs"
    out = sandbox_in_private_namespace(root, True)
    assert out.get("magic") == "glibc-ld.so.cache1.1", out


STACKED = SETUP + r"""for i in range(2):  # two volumes on one mount point, the upper one with a mount inside it
    linux.mount("tmpfs", root + "/data", "tmpfs", 0, "size=1m")
os.mkdir(root + "/data/inner")
linux.mount("tmpfs", root + "/data/inner", "tmpfs", 0, "size=1m")
""" + OPEN + r"""try:
    data, output = ldsandbox.build_cache(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20, {new_api!r})
    print(json.dumps({{"magic": data[:20].decode()}}))
except ldsandbox.SandboxError as err:
    print(json.dumps({{"error": str(err)}}))
"""


@pytest.mark.parametrize("new_api", [True, False], ids=["open_tree+mount_setattr", "mount+remount"])
def test_volumes_stacked_on_one_mount_point_are_all_detached(tmp_path, new_api):
    """umount2 detaches the topmost mount at a path: the one beneath, on the same mount
    point, is only found by reading the table again (the sandbox reads it once less where no
    two mounts share a point)."""
    require_root_tools("unshare", "ldconfig")
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64", "data"):
        (root / d).mkdir(parents=True)
    assert sandbox_in_private_namespace(root, new_api, STACKED) == {"magic": "glibc-ld.so.cache1.1"}


AHEAD = SETUP + OPEN + r"""ahead = ldsandbox.prepare(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20)
# Made after the fork, as the worker makes its mounts while the sandbox sets itself up.
point = root + "/usr/lib64/libz.so.1"
open(point, "w").close()
linux.mount({library!r}, point, None, linux.MS_BIND)
try:
    data, output = ldsandbox.build_cache(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20, True, {{point}}, ahead)
    print(json.dumps({{"magic": data[:20].decode(), "listed": b"/usr/lib64/libz.so.1" in data}}))
except ldsandbox.SandboxError as err:
    print(json.dumps({{"error": str(err)}}))
"""


def test_a_sandbox_forked_ahead_holds_the_mounts_made_after_it(tmp_path):
    """The worker forks the sandbox before it makes its mounts (ldsandbox.prepare): the
    sandbox takes its copy of the mount namespace only at the go, so a library bound in
    after the fork (over an empty mount point, which ldconfig would skip) is in the cache,
    and the sandbox keeps it (own mounts)."""
    require_root_tools("unshare", "ldconfig")
    # Any libz.so.1 the host's own ld cache lists (zlib: every Debian has it).
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    found = [line.rsplit(" => ", 1)[1] for line in listed if line.strip().startswith("libz.so.1 ") and " => " in line]
    require(bool(found), "a libz.so.1 in the host's ld cache to bind in")
    library = found[0]
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64"):
        (root / d).mkdir(parents=True)
    script = AHEAD.replace("{library!r}", repr(library))
    assert sandbox_in_private_namespace(root, True, script) == {"magic": "glibc-ld.so.cache1.1", "listed": True}


UNUSED = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
from gpuhook.apply import ldsandbox
from gpuhook.kernel import child
root = {root!r}
fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
ld = os.open("/sbin/ldconfig", os.O_RDONLY | os.O_CLOEXEC)
out = {{}}
taken_back = ldsandbox.prepare(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20)
out["left"] = taken_back.end()
try:
    os.waitpid(taken_back.pid, os.WNOHANG)
    out["reaped"] = False
except ChildProcessError:
    out["reaped"] = True
forgotten = ldsandbox.prepare(root, fd, ld, ["/usr/lib64"], time.monotonic() + 0.3)
began = time.monotonic()
out["ended_alone"] = child.reap(forgotten.pid, 5)
out["waited"] = round(time.monotonic() - began, 2)
out["said"] = forgotten.channel.recv(4096).decode()
print(json.dumps(out))
"""


def test_a_sandbox_forked_ahead_and_not_used_ends(tmp_path):
    """A start that fails before its ld cache takes its sandbox back (Prepared.end: killed
    and reaped, nothing stuck); one that nobody hands a rootfs ends at the deadline on its
    own, saying why, instead of waiting without bound."""
    require_root_tools("unshare")
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64"):
        (root / d).mkdir(parents=True)
    out = sandbox_in_private_namespace(root, True, UNUSED)
    assert out["left"] == [] and out["reaped"] and out["ended_alone"], out
    assert out["waited"] < 3, out
    assert out["said"] == "the ldconfig sandbox got no rootfs before the deadline", out


NO_MEMFD = SETUP + OPEN + r"""import errno
ahead = ldsandbox.prepare(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20)
def no_memfd(*args):
    raise OSError(errno.EMFILE, "Too many open files")
os.memfd_create = no_memfd
out = {{}}
try:
    ldsandbox.build_cache(root, fd, ld, ["/usr/lib64"], time.monotonic() + 20, True, set(), ahead)
except ldsandbox.SandboxError as err:
    out["error"], out["left"] = str(err), err.left
try:
    os.waitpid(ahead.pid, os.WNOHANG)
    out["reaped"] = False
except ChildProcessError:
    out["reaped"] = True
print(json.dumps(out))
"""


def test_a_go_that_cannot_be_sent_ends_the_waiting_sandbox(tmp_path):
    """Out of fds for the go's memfd, the start fails with the sandbox's own error (not a bare
    OSError past the step's reporting) and the sandbox waiting for it is killed and reaped."""
    require_root_tools("unshare", "ldconfig")
    root = tmp_path / "rootfs"
    for d in ("etc", "proc", "dev", "usr/lib64"):
        (root / d).mkdir(parents=True)
    out = sandbox_in_private_namespace(root, True, NO_MEMFD)
    assert out == {"error": "ldconfig sandbox: Too many open files", "left": [], "reaped": True}, out
