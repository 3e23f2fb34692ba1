"""`gpuhook demo` (README, "Try it"): a real runc container with simulated GPUs."""

import re
import shutil
import subprocess
import sys

import pytest

from conftest import require_root_tools

pytestmark = pytest.mark.root


def test_two_demos_at_once_each_get_their_gpus_in_their_own_directory():
    """Two people (or two test runs) on one host: each demo has its own directory, runc state,
    container id and cgroup, so neither clobbers the other."""
    require_root_tools("runc", "gcc", "busybox")
    argv = [sys.executable, "-m", "gpuhook", "demo"]
    demos = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for _ in range(2)]
    outputs = [demo.communicate(timeout=300) for demo in demos]
    dirs = []
    try:
        for demo, (out, err) in zip(demos, outputs):
            dirs += re.findall(r"everything is in (\S+);", out)
            assert demo.returncode == 0, (out, err)
            assert "nvidia0" in out and "nvidia1" in out and "Operation not permitted" in out, out
            # the start's decision-log line and the stop's (gpuhook is registered for both)
            assert '"stage": "prestart"' in out and '"stage": "poststop"' in out, out
            assert out.index('"gpus injected"') < out.index('"cleaned up"'), out
        assert len(dirs) == 2 and dirs[0] != dirs[1] and all(d.startswith("/tmp/gpuhook-demo-") for d in dirs)
    finally:
        for directory in dirs:
            shutil.rmtree(directory, ignore_errors=True)
