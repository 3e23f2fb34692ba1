"""A GPU start never outlasts its deadline by more than a second, and always ends with one
`gpuhook:` line, a documented exit code and a log record (docs/security.md, "A start that
never ends"): planning is bounded by the size of what the image controls, and whatever still
holds the hook (here an NVML that takes 20 s to initialise) meets the backstop, which ends
the start half a second after its deadline with exit 7.
"""

import time

import pytest

from conftest import GpuContainers, assert_rootfs_clean, require_root_tools

from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

pytestmark = pytest.mark.root


def hook_line(result) -> str:
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    return line[line.index("gpuhook: "):].removesuffix('"').removesuffix("\\n")


def test_a_huge_requirement_is_refused_at_once_not_parsed(gpus):
    """8 MiB of alternatives before the one that holds: parsing and checking them against
    four GPUs took minutes and gigabytes, and runc killed the hook at 30 s with no line."""
    gpus.configure(**{"deadline-seconds": 5})
    requirement = "cuda>=99.0 " * ((8 << 20) // 11) + "cuda>=1.0"
    started = time.monotonic()
    result = gpus.run("huge-require", env=["NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_REQUIRE_CUDA={requirement}"])
    took = time.monotonic() - started
    assert took < 5, took
    assert "exit status 3" in result.stderr
    assert hook_line(result).startswith("gpuhook: NVIDIA_REQUIRE_CUDA is too large (8388609 characters, "
                                        "762601 alternatives)")
    (record,) = gpus.log_lines()
    assert record["decision"] == "failed" and record["error"].startswith("NVIDIA_REQUIRE_CUDA is too large")
    assert_rootfs_clean(result.rootfs)


@pytest.fixture(scope="module")
def slow_nvml_host(tmp_path_factory):
    """A host of its own whose NVML takes 20 s to initialise (like a host without persistence
    mode, much worse)."""
    require_root_tools("gcc", "ldconfig", "runc")
    sim = simhost.build(str(tmp_path_factory.mktemp("slow-nvml") / "host"), gpus=1, seed="slow-nvml")
    simnvml.set_host(sim["nvml_state"], init_latency_ms=20000)
    return sim


def test_a_hook_held_past_its_deadline_is_ended_by_the_backstop(bed, slow_nvml_host, probe, tmp_path):
    """The image's requirement needs NVML's facts, and NVML does not answer within the
    deadline: the start ends half a second after it, exit 7, one line naming the phase and a
    log record, and nothing of the start is left."""
    (tmp_path / "work").mkdir()
    gpus = GpuContainers(bed, slow_nvml_host, probe, tmp_path / "work")
    gpus.configure(**{"deadline-seconds": 3})
    started = time.monotonic()
    result = gpus.run("slow-nvml", env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=1.0"])
    took = time.monotonic() - started
    assert took < 3 + 1 + 0.5, took  # the deadline, its second, and runc's own work
    assert "exit status 7" in result.stderr
    assert hook_line(result) == ("gpuhook: hook deadline passed during planning (the request, discovery, NVML, "
                                 "the image's requirements) (3 s): gpuhook stopped")
    (record,) = gpus.log_lines()
    assert record["decision"] == "failed" and record["backstop"] is True
    assert record["container"] == "slow-nvml" and record["error"] == hook_line(result)[len("gpuhook: "):]
    assert_rootfs_clean(result.rootfs)


WORKER_SCRIPT = r"""
import json, mmap, os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from gpuhook.apply import nsworker, order
from gpuhook.plan.records import BindMount; from gpuhook.plan.records import Plan

nsworker.COMMIT_WAIT = 0.5
root = {root!r}
subprocess.run(["mount", "--bind", root, root], check=True)  # a rootfs is a mount point
lib = BindMount({source!r}, "/usr/lib64/libcuda.so.1", "file", ("ro", "nosuid", "nodev"))
plan = Plan("c", os.getpid(), root, "gpus", "env", frozenset(), (), (), (lib,), (), (), None, None, ())
ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
out_r, out_w = os.pipe()
decide_r, decide_w = os.pipe()  # the "hook" keeps its end open and never says a word
progress = mmap.mmap(-1, order.PROGRESS_BYTES + order.JOURNAL_BYTES)
started = time.monotonic()
code = nsworker.run(plan, ns, None, {{}}, started + 0.5, out_w, progress, decide_r)
took = time.monotonic() - started
os.close(out_w)
reports = os.read(out_r, 65536).decode().splitlines()
print(json.dumps({{"code": code, "took": took, "reports": reports, "left": os.listdir(root + "/usr")}}))
"""


def test_a_worker_the_hook_never_answers_undoes_its_work_by_itself(tmp_path):
    """After its report the worker waits for COMMIT or ABORT; a hook that is alive but can no
    longer act (stuck in the kernel) never sends either. The worker waits a bounded time past
    its deadline (gpuhook.apply.order.COMMIT_WAIT), then takes its work back, as it does on ABORT."""
    import json
    import subprocess
    import sys

    from conftest import REPO, host_mounts

    require_root_tools("unshare")
    source = tmp_path / "libcuda.so.550"
    source.write_text("the host's library\n")
    root = tmp_path / "rootfs"
    (root / "usr").mkdir(parents=True)
    before = host_mounts()
    script = WORKER_SCRIPT.format(repo=REPO, root=str(root), source=str(source))
    done = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["code"] == 0 and 0.9 < out["took"] < 3, out
    assert json.loads(out["reports"][0])["ok"] is True and json.loads(out["reports"][1]) == {"undone": []}
    assert out["left"] == []  # the library's mount point and its directory are gone again
    assert host_mounts() == before
