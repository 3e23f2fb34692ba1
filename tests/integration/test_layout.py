"""The test suite's own promise: tests/unit runs as an ordinary user, with nothing skipped,
so `pytest tests/unit` is a complete inner loop on a developer's machine (conftest.py)."""

import os
import re
import subprocess
import sys
from conftest import REPO, require_root_tools


def test_the_unit_tests_pass_as_an_unprivileged_user_with_nothing_skipped():
    require_root_tools("runuser")
    done = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-m", "pytest", "tests/unit", "-q", "-n", "2",
                           "-p", "no:cacheprovider", "-W", "ignore"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"PATH": os.environ["PATH"], "HOME": "/tmp", "LANG": "C.UTF-8"})
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.fullmatch(r"=* ?\d+ passed in [\d.]+s ?=*", summary), summary
