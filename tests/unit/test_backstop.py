"""gpuhook.hook.Backstop: whatever holds the hook's main thread, the hook ends half a second
after its deadline with one `gpuhook:` line, exit 7 and a log record; and once the hook has
returned, the backstop does nothing at all (tests and the CLI call run_hook in-process).
The same in a real runc start: tests/integration/test_deadline.py."""

import json
import subprocess
import sys
import time

from conftest import REPO

SCRIPT = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
from gpuhook import hook
if {stall!r}:
    def read_container(*args):  # the main thread is held (as by a call that never returns)
        time.sleep(30)
    hook.read_container = read_container
state = json.dumps({{"ociVersion": "1.0.2", "id": "held", "status": "creating", "pid": 1,
                    "bundle": "/nonexistent"}}).encode()
code = hook.run_hook("prestart", state, {config!r})
print("returned", code, flush=True)
time.sleep(1.2)  # past the backstop's moment (deadline 0.5 s + grace 0.5 s)
print("still alive", flush=True)
"""


def run(tmp_path, stall: bool):
    config = tmp_path / "config.toml"
    config.write_text(f'deadline-seconds = 0.5\nlog-file = "{tmp_path}/log"\nstate-dir = "{tmp_path}/state"\n')
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=REPO, stall=stall, config=str(config))],
                          capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


def test_a_held_hook_ends_half_a_second_after_its_deadline_with_one_line_exit_7_and_a_record(tmp_path):
    done, took = run(tmp_path, stall=True)
    assert done.returncode == 7 and took < 0.5 + 1 + 1, (done, took)  # plus the interpreter's start
    assert done.stdout == ""
    assert done.stderr.splitlines() == ["gpuhook: hook deadline passed during reading the container's state and "
                                        "bundle (0.5 s): gpuhook stopped"]
    (record,) = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    assert record["decision"] == "failed" and record["backstop"] is True and record["stage"] == "prestart"


def test_once_the_hook_has_returned_the_backstop_does_nothing(tmp_path):
    done, _ = run(tmp_path, stall=False)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == ["returned 2", "still alive"]
    assert done.stderr.splitlines() == ["gpuhook: bundle /nonexistent has no config.json"]
