"""The /proc/driver/nvidia mask, in a private mount namespace over a fake container /proc.

On a simulated host the container's real procfs has no driver/nvidia, so container tests
only see the step skipped with a note. Here the step runs for real (tmpfs, file copies,
bind mounts of the GPU dirs, read-only remount) on a rootfs whose proc/driver/nvidia is a
plain directory, inside `unshare -m` so nothing reaches the host's mount table.
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
from gpuhook.apply import procmask, run as apply; from gpuhook.apply.target import Target
from gpuhook.plan.records import Plan, ProcMask

root = {root!r}
mask = ProcMask({source!r}, ("0000:28:00.0",))
plan = Plan("c", 1, root, "gpus", "env", frozenset(), (), (), (), (), (), mask, None, ())
work = Target(plan, time.monotonic() + 10)
work.root = os.open(root, os.O_PATH | os.O_DIRECTORY)
procmask.mask_proc(work, apply.read_proc_files(mask))
base = root + "/proc/driver/nvidia"
out = {{
    "params": open(base + "/params").read(),
    "version": open(base + "/version").read(),
    "gpus": sorted(os.listdir(base + "/gpus")),
    "gpu_info": open(base + "/gpus/0000:28:00.0/information").read(),
    "mounts": [l.split()[4:6] + [l.split(" - ")[1].split()[0]] for l in open("/proc/self/mountinfo") if base in l],
}}
try:
    open(base + "/params", "w")
    out["write"] = "OK"
except OSError as err:
    out["write"] = err.strerror
print(json.dumps(out))
"""


def test_proc_driver_nvidia_is_masked_read_only_with_only_the_containers_gpus(tmp_path, sim_host):
    require_root_tools("unshare")
    source = f"{sim_host['directory']}/proc/driver/nvidia"
    root = tmp_path / "rootfs"
    fake = root / "proc/driver/nvidia"
    for bus in ("0000:18:00.0", "0000:28:00.0"):
        (fake / "gpus" / bus).mkdir(parents=True)
        (fake / "gpus" / bus / "information").write_text(f"Bus Location: {bus}\n")
    (fake / "params").write_text("ModifyDeviceFiles: 1\n")
    before = host_mounts()
    script = SCRIPT.format(repo=REPO, root=str(root), source=source)
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "ModifyDeviceFiles: 0" in out["params"] and "ModifyDeviceFiles: 1" not in out["params"]
    assert "EnableMSI: 1" in out["params"]  # the rest of the host's params is kept
    assert out["version"].startswith("NVRM version:")
    assert out["gpus"] == ["0000:28:00.0"]  # the other GPU's directory is hidden
    assert out["gpu_info"] == "Bus Location: 0000:28:00.0\n"
    top = [m for m in out["mounts"] if m[0] == str(fake)]
    assert top and top[0][1].startswith("ro,") and top[0][2] == "tmpfs"
    gpu_dir = [m for m in out["mounts"] if m[0] == f"{fake}/gpus/0000:28:00.0"]
    # the container's own GPU dir, bound in: read-only, nosuid, nodev, noexec like the rest
    assert gpu_dir and gpu_dir[0][1].split(",")[:4] == ["ro", "nosuid", "nodev", "noexec"]
    assert out["write"] == "Read-only file system"
    assert host_mounts() == before
    assert (fake / "params").read_text() == "ModifyDeviceFiles: 1\n"  # the real tree is untouched
