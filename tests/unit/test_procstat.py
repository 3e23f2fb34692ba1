"""gpuhook.kernel.procstat against psutil, an independent reading of the same /proc files.

gpuhook reads /proc/<pid>/stat itself instead of importing psutil: the reads are a few lines,
and psutil's import costs about 27 ms on a GPU start (README, "Why not psutil"). psutil stays
the oracle here.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpuhook.kernel import procstat

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def assert_agrees(pid: int) -> None:
    mine = procstat.read_stat(pid)
    theirs = psutil.Process(pid)
    assert mine.ppid == theirs.ppid()
    assert mine.zombie == (theirs.status() == psutil.STATUS_ZOMBIE)
    # psutil's create time is boot time plus the same start-time field, in seconds.
    assert abs(psutil.boot_time() + mine.start_time / CLOCK_TICKS - theirs.create_time()) < 0.02


def test_live_processes_agree_with_psutil():
    for pid in (1, os.getpid(), os.getppid()):
        assert_agrees(pid)


def test_a_command_name_with_spaces_and_parentheses():
    # A process may name itself anything (up to 15 bytes): here ") S 1 (x", which a parser
    # that splits at the first ")" would misread. The child stops itself, so its state is a
    # stable "T" when read (a child about to block on input could still be "R": a CI flake).
    rename = "import os, signal; open('/proc/self/comm', 'w').write(') S 1 (x'); os.kill(os.getpid(), signal.SIGSTOP)"
    child = subprocess.Popen([sys.executable, "-c", rename])
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        assert psutil.Process(child.pid).name() == ") S 1 (x"
        assert_agrees(child.pid)
        assert procstat.read_stat(child.pid).state == "T"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def test_a_zombie_and_a_vanished_process():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while not procstat.read_stat(child.pid).zombie and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_agrees(child.pid)
    assert not procstat.is_alive(child.pid, procstat.read_stat(child.pid).start_time)
    child.wait()
    assert procstat.read_stat(child.pid) is None and not psutil.pid_exists(child.pid)


def test_a_cgroup_name_cannot_forge_a_line_of_the_cgroup_file():
    """The kernel writes a cgroup's name into /proc/<pid>/cgroup as it is. A carriage return
    no longer splits a line (it did, split as text); a newline that makes a line repeat a
    hierarchy or a controller makes the file ambiguous, and it is refused rather than read
    with the forged path (attacker pass 21 forged the mount table that way)."""
    from gpuhook.kernel import procstat

    assert procstat.parse_cgroups(b"11:devices:/ctr\r0::/victim\n0::/ctr\n") == {
        "devices": "/ctr\r0::/victim", "": "/ctr"}
    for forged in (b"11:devices:/ctr\n0::/mine/x\n0::/victim\n", b"11:devices:/a\n12:devices:/victim\n0::/a\n",
                   b"1:name=systemd:/x\n1:name=systemd:/y\n"):
        with pytest.raises(ValueError):
            procstat.parse_cgroups(forged)
    assert procstat.parse_cgroups(b"12:pids:/ctr\n11:devices:/ctr\n1:name=systemd:/\n0::/ctr\n") == {
        "pids": "/ctr", "devices": "/ctr", "name=systemd": "/", "": "/ctr"}


def test_an_ambiguous_cgroup_file_reads_as_an_os_error(tmp_path):
    from gpuhook.kernel import procstat

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_bytes(b"0::/mine/x\n0::/victim\n")
    with pytest.raises(OSError) as raised:
        procstat.read_cgroups(42, str(tmp_path))
    assert "victim" not in str(raised.value)
