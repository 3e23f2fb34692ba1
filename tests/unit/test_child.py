"""Child processes: explicit minimal environment, bounded time, nothing left behind."""

import os
import time

from gpuhook.kernel import child


def test_child_gets_only_the_minimal_environment(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    monkeypatch.setenv("PYTHONPATH", "/tmp/evil")
    done = child.run(["/usr/bin/env"], 5)
    assert done.status == 0
    assert sorted(done.output.decode().splitlines()) == sorted(f"{k}={v}" for k, v in child.MINIMAL_ENV.items())


def test_explicit_empty_environment_and_cwd():
    done = child.run(["/bin/sh", "-c", "env | grep -v '^PWD=' | wc -l; pwd"], 5, env={}, cwd="/")
    assert done.output.decode().split() == ["0", "/"]


def test_timeout_kills_the_whole_process_group():
    start = time.monotonic()
    done = child.run(["/bin/sh", "-c", "sleep 30 & sleep 30; echo never"], 0.5)
    assert done.timed_out and done.status is None
    assert time.monotonic() - start < 5
    # No "sleep 30" of ours is left running.
    assert not any(open(f"/proc/{p}/cmdline", "rb").read() == b"sleep\x0030\x00"
                   for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid())


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_a_daemonised_grandchild_does_not_make_us_wait():
    start = time.monotonic()
    done = child.run(["/bin/sh", "-c", "(sleep 30 &); echo started"], 10)
    assert done.status == 0 and done.output == b"started\n" and not done.timed_out
    assert time.monotonic() - start < 5


def test_exec_by_file_descriptor():
    fd = os.open("/bin/echo", os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = child.run(["echo", "by fd"], 5, executable=fd, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert done.output == b"by fd\n" and done.status == 0


def test_missing_binary_reports_and_exits_127():
    done = child.run(["/nonexistent/tool"], 5)
    assert done.status == 127 and b"cannot run /nonexistent/tool" in done.output


def test_output_is_capped():
    done = child.run(["/bin/sh", "-c", "yes | head -c 1000000"], 10, output_cap=1000)
    assert len(done.output) == 1000 and done.status == 0
