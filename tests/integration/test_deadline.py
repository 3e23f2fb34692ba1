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
