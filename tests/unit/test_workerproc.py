"""gpuhook.apply.worker: the namespace worker forked ahead of the planning never outlives the
hook, whether it was used or not. (Its work in a real container: tests/integration.)"""

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from gpuhook.apply import nsworker, order, worker as apply_worker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gone(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_an_unused_early_worker_is_killed_and_reaped():
    apply_worker.start_early()
    pid = apply_worker._early.pid
    apply_worker.discard()
    assert apply_worker._early is None and gone(pid)
    apply_worker.discard()  # nothing left to end: a no-op


def test_take_hands_out_the_early_worker_once():
    apply_worker.start_early()
    early = apply_worker._early.pid
    first = apply_worker.take()
    second = apply_worker.take()  # none forked early any more: a new one
    try:
        assert first.pid == early and second.pid != early
    finally:
        first.close()
        second.close()
    assert gone(first.pid) and gone(second.pid)


def test_a_worker_whose_order_never_comes_exits_by_itself():
    """The hook died, or closed the pipe: the worker ends with status 0, having done nothing."""
    worker = apply_worker.start()
    os.close(worker.order_w)
    worker.order_w = -1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pid, status = os.waitpid(worker.pid, os.WNOHANG)
        if pid:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the worker kept waiting for an order that could not come")
    worker.reaped = True
    worker.close()


def test_the_hook_leaves_no_worker_behind_when_the_start_fails_before_applying(tmp_path):
    """A GPU request (so the worker is forked early) with a state the hook refuses."""
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["true"], "cwd": "/", "env": ["NVIDIA_VISIBLE_DEVICES=0"]}}))
    config = tmp_path / "config.toml"
    config.write_text(f'log-file = "{tmp_path}/gpuhook.log"\nstate-dir = "{tmp_path}/state"\n')
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "running", "pid": os.getpid(),
                        "bundle": str(bundle)})
    probe = (
        "import io, os, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from gpuhook import entry\n"
        f"sys.stdin = io.TextIOWrapper(io.BytesIO({state.encode()!r}))\n"
        f"code = entry.run_stage('prestart', {str(config)!r})\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG)\n"
        "    print('a child is left', code)\n"
        "except ChildProcessError:\n"
        "    print('no child left', code)\n"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "no child left 2", done.stdout + done.stderr
    assert "status 'running'" in done.stderr


def test_no_fork_ahead_of_the_planning_is_not_an_internal_error(tmp_path):
    """fork failing (EAGAIN) where the worker is forked early: the start goes on, and a
    problem is reported inside the hook's error boundary with its own exit code, never 70."""
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["true"], "cwd": "/", "env": ["NVIDIA_VISIBLE_DEVICES=void", "CUDA_VERSION=12.0"]}}))
    config = tmp_path / "config.toml"
    config.write_text(f'log-file = "{tmp_path}/gpuhook.log"\nstate-dir = "{tmp_path}/state"\n')
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": os.getpid(),
                        "bundle": str(bundle)})
    probe = (
        "import errno, io, os, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "def no_fork():\n"
        "    raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "os.fork = no_fork\n"
        "from gpuhook import entry\n"
        f"sys.stdin = io.TextIOWrapper(io.BytesIO({state.encode()!r}))\n"
        f"print('exit', entry.run_stage('prestart', {str(config)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "exit 0", done.stdout + done.stderr  # past the prescan (CUDA_VERSION), then void
    assert "internal error" not in done.stderr


def test_the_worker_refuses_a_namespace_other_than_the_one_the_hook_checked():
    """The worker opens the container's namespaces again by pid; a pid that names another
    process by then (another namespace) is refused, never joined."""
    st = os.stat(f"/proc/{os.getpid()}/ns/mnt")
    fd = nsworker._open_same_namespace(os.getpid(), "mnt", (st.st_dev, st.st_ino))
    os.close(fd)
    with pytest.raises(OSError) as refused:
        nsworker._open_same_namespace(os.getpid(), "mnt", (st.st_dev, st.st_ino + 1))
    assert refused.value.errno == errno.ESRCH and "no longer the container" in refused.value.strerror


def test_the_journal_lists_exactly_what_is_made_and_not_undone(tmp_path):
    """The worker's journal, in the memory it shares with the hook: what a worker killed or
    stuck in the kernel leaves is what it lists, each with its identity."""
    import mmap

    from gpuhook.apply import rootfs

    memory = mmap.mmap(-1, order.PROGRESS_BYTES + apply_worker.JOURNAL_BYTES)
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    changes = rootfs.Changes(apply_worker.Journal(memory))
    try:
        lib = rootfs.make_dirs(root, "/usr/lib64", changes)
        os.close(os.open("libcuda.so.1", os.O_CREAT | os.O_WRONLY, dir_fd=lib))
        changes.add("file", lib, "libcuda.so.1", "/usr/lib64/libcuda.so.1")
        made = os.stat(tmp_path / "usr/lib64/libcuda.so.1")
        entries, overflowed = apply_worker.Journal(memory).entries()
        assert [e[:2] for e in entries] == [["dir", "/usr"], ["dir", "/usr/lib64"], ["file", "/usr/lib64/libcuda.so.1"]]
        assert entries[-1][4:] == [made.st_dev, made.st_ino, made.st_ctime_ns] and not overflowed
        assert changes.undo(since=2) == []  # the file only
        assert [e[1] for e in apply_worker.Journal(memory).entries()[0]] == ["/usr", "/usr/lib64"]
        changes.forget()  # kept: nothing is left over
        assert apply_worker.Journal(memory).entries() == ([], False)
        journal = apply_worker.Journal(memory)
        while journal.add("file", "/x" * 200, lib, "nothing", "") is not None:
            pass
        assert journal.entries()[1] is True  # full: the reader is told that more was made
    finally:
        os.close(lib)
        os.close(root)
        memory.close()


def test_a_worker_that_does_not_die_is_given_up_on_not_waited_for(monkeypatch):
    """A process stuck in the kernel does not end on SIGKILL; the hook waits REAP_GRACE for
    it, never without bound, and says so (`stuck`; `unsettled`: it had an order and may have
    changed the container). A SIGKILL that does not take effect stands for one the kernel
    holds (tests/integration/test_volumes.py has the real one, on a stalled FUSE)."""
    monkeypatch.setattr(apply_worker, "REAP_GRACE", 0.2)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        worker = apply_worker.Worker(sleeper.pid, -1, -1, None)
        worker.ordered = True
        monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # SIGKILL that does not take effect
        started = time.monotonic()
        worker._reap(kill=True)
        assert time.monotonic() - started < 1
        assert worker.stuck and worker.unsettled and not worker.reaped
    finally:
        monkeypatch.undo()
        sleeper.kill()
        sleeper.wait()
