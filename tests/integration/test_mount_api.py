"""Both ways of making a bind mount: the new mount API and the classic mount + remount.

Run for real in a private mount namespace (`unshare -m`), over a rootfs in a temp dir: the
mount gets its flags, and a failed start takes it back. With the new API the mount is
reachable by fd, so undo works even after something renamed its directory; the classic
way can only report that it could not find it (the container's mount namespace, where the
mount lives, is discarded with the failed start anyway).
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO, host_mounts, require_root_tools

pytestmark = pytest.mark.root

SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
from gpuhook.apply import mounts; from gpuhook.apply.target import Target
from gpuhook.plan.records import BindMount, Plan

mounts.use_new_mount_api = {new_api!r}
root = {root!r}
lib = BindMount({source!r}, "/usr/lib64/libcuda.so.1", "file", ("ro", "nosuid", "nodev"))
plan = Plan("c", 1, root, "gpus", "env", frozenset(), (), (), (lib,), (), (), None, None, ())
work = Target(plan, time.monotonic() + 10)
work.open_sources()
work.root = os.open(root, os.O_PATH | os.O_DIRECTORY)
mounts.bind(work, lib)

def mounts():
    return [l.split()[4:6] for l in open("/proc/self/mountinfo") if "libcuda.so.1" in l]

out = {{"mounted": mounts(), "content": open(root + "/usr/lib64/libcuda.so.1").read()}}
try:
    open(root + "/usr/lib64/libcuda.so.1", "w")
    out["write"] = "OK"
except OSError as err:
    out["write"] = err.strerror
{before_undo}
out["problems"] = work.undo()
out["after"] = mounts()
print(json.dumps(out))
"""


MOVE_IT = 'os.rename(root + "/usr/lib64", root + "/usr/lib64.moved")'
DETACH_IT = 'from gpuhook.kernel import linux; linux.umount2(root + "/usr/lib64/libcuda.so.1", linux.MNT_DETACH)'


def bind_then_undo(tmp_path, new_api: bool, before_undo: str) -> dict:
    """Bind a host "library" into a fresh rootfs in a private mount namespace, run
    `before_undo` (Python, in the script), undo; what the script saw. The host's mount table
    must be unchanged."""
    require_root_tools("unshare")
    source = tmp_path / "libcuda.so.550"
    source.write_text("the host's library\n")
    root = tmp_path / "rootfs"
    (root / "usr").mkdir(parents=True)
    before = host_mounts()
    script = SCRIPT.format(repo=REPO, root=str(root), source=str(source), new_api=new_api, before_undo=before_undo)
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert host_mounts() == before
    return json.loads(done.stdout)


@pytest.mark.parametrize("new_api", [True, False], ids=["open_tree+move_mount", "mount+remount"])
def test_bind_mount_gets_its_flags_and_is_undone(tmp_path, new_api):
    out = bind_then_undo(tmp_path, new_api, MOVE_IT)  # something moves it before undo
    (point, options), = out["mounted"]
    assert point.endswith("/usr/lib64/libcuda.so.1") and options.startswith("ro,nosuid,nodev")
    assert out["content"] == "the host's library\n" and out["write"] == "Read-only file system"
    if new_api:  # unmounted by fd; only removing the moved directory by its old name fails
        assert out["after"] == [] and not any("unmount" in p for p in out["problems"])
    else:
        assert any("cannot unmount /usr/lib64/libcuda.so.1" in p for p in out["problems"])


def test_a_mount_already_gone_counts_as_undone(tmp_path):
    """Undo after something else detached gpuhook's mount (the runtime tearing down a failed
    start, a lazy unmount of a parent): nothing is left to take back, so no problem is
    reported and the failed start's one line names the real cause, not a false cleanup failure."""
    out = bind_then_undo(tmp_path, True, DETACH_IT)
    assert out["mounted"] and out["after"] == [] and out["problems"] == []
