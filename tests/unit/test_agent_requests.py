"""gpuhook.agent's request parser and its order of work: stops one at a time, in order; a start
after the stops that came before it (docs/agent.md)."""

import fcntl
import os
import signal
import threading
import time

from gpuhook import agent

ENV = [b"PATH=/usr/bin:/bin", b"GPUHOOK_FRONT_PROTOCOL=1"]


def payload(args, env=ENV, magic=agent.PROTOCOL) -> bytes:
    tokens = [magic, str(len(args)).encode(), *args, str(len(env)).encode(), *env]
    return b"".join(t + b"\0" for t in tokens)


def test_a_request_is_its_args_and_kept_environment():
    assert agent.parse_request(payload([b"prestart", b"--config", b"/etc/g.toml"])) == (
        ["prestart", "--config", "/etc/g.toml"], {"PATH": "/usr/bin:/bin", "GPUHOOK_FRONT_PROTOCOL": "1"})


def test_anything_else_is_not_a_request():
    good = payload([b"prestart"])
    for bad in (b"", good[:-1], payload([b"prestart"], magic=b"gpuhook-agent/1"), payload([]),
                payload([b"prestart"], env=[b"LD_PRELOAD=/tmp/x.so"]),
                payload([b"prestart"], env=[b"PATH=/a", b"PATH=/b"]), payload([b"prestart"], env=[b"PATH"]),
                good.replace(b"\x001\x00prestart", b"\x005\x00prestart"), payload([b"\xff"]),
                good + b"extra\0"):
        assert agent.parse_request(bad) is None, bad


def jobs(*stages):
    return [agent.Job(i, None, stage, None, {}, [], 1, 0o022) for i, stage in enumerate(stages, 1)]


def launched(server, monkeypatch):
    order = []

    def hand(job):
        order.append(job.seq)
        job.pidfd = 1000 + job.seq
        server.running[job.pidfd] = job
    monkeypatch.setattr(server, "_hand", hand)
    return order


def test_a_start_waits_for_the_stops_before_it_only_so_long(monkeypatch):
    server = agent.Agent("/nonexistent/agent.sock")
    order = launched(server, monkeypatch)
    stop1, start2, stop3 = jobs("poststop", "prestart", "poststop")
    server.running[1001] = stop1  # a stop's child, at work
    server.running[1003] = stop3  # a later one: no reason to wait
    server.waiting.append(start2)
    server._launch()
    assert order == []
    server.running.pop(1001)
    server._launch()
    assert order == [2]


def test_a_stop_still_reading_its_own_bundle_holds_a_start_only_briefly(monkeypatch):
    """Attacker pass 9, S1: a start did not wait for a stop answered but not yet at its work
    (its spare not yet woken, or reading its bundle), and could check a GPU that stop had not
    cleaned. Attacker pass 8, A1: a stop whose config.json is huge is slow in its own child's
    prescan; starts of other containers wait for that only STOP_READ_WAIT."""
    server = agent.Agent("/nonexistent/agent.sock")
    order = launched(server, monkeypatch)
    stop1, start2 = jobs("poststop", "prestart")
    stop1.ready = 99  # its child has not closed the pipe yet
    server.running[1001] = stop1
    server.waiting.append(start2)
    server._launch()
    assert order == []
    start2.queued_at = time.monotonic() - agent.STOP_READ_WAIT - 0.01
    server._launch()
    assert order == [2]


def test_a_stuck_stop_holds_a_start_only_so_long(monkeypatch):
    server = agent.Agent("/nonexistent/agent.sock")
    order = launched(server, monkeypatch)
    stop1, start2 = jobs("poststop", "prestart")
    server.running[1001] = stop1
    server.waiting.append(start2)
    server._launch()
    assert order == []
    start2.queued_at = time.monotonic() - agent.STOP_WAIT - 0.1
    server._launch()
    assert order == [2]


def test_a_stop_waits_for_the_lock_without_polling_and_only_so_long(tmp_path):
    """One stop at a time, each waiting in flock (woken once, when the lock is free), never
    longer than it was given; the timer that bounds the wait is gone afterwards."""
    path = str(tmp_path / "stops.lock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    handler = signal.getsignal(signal.SIGALRM)
    began = time.monotonic()
    agent._take_stop_lock(path, began + 0.3)
    waited = time.monotonic() - began
    assert 0.25 <= waited < 2, waited
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is handler
    threading.Timer(0.2, os.close, (holder,)).start()
    began = time.monotonic()
    agent._take_stop_lock(path, began + 10)
    waited = time.monotonic() - began
    assert 0.15 <= waited < 2, waited
    other = os.open(path, os.O_RDWR)
    try:  # taken: by an fd this process still has open (the stop holds it until it exits)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the lock was not taken")
        except BlockingIOError:
            pass
    finally:
        os.close(other)


def test_a_start_waiting_past_the_read_wait_does_not_spin_the_loop(monkeypatch):
    """A start waits for a stop at its work, STOP_READ_WAIT behind it: the loop sleeps until
    STOP_WAIT, not 0 s over and over."""
    server = agent.Agent("/nonexistent/agent.sock")
    launched(server, monkeypatch)
    stop1, start2 = jobs("poststop", "prestart")
    server.running[1001] = stop1
    start2.queued_at = time.monotonic() - agent.STOP_READ_WAIT - 0.1
    server.waiting.append(start2)
    server._launch()
    assert list(server.waiting) == [start2]
    assert agent.STOP_WAIT - agent.STOP_READ_WAIT - 0.5 < server._timeout() <= agent.STOP_WAIT


def test_a_starts_child_answers_the_front_with_its_output_closed_before_it_ends(monkeypatch):
    """The runtime goes on once its hook (the front) has exited and every copy of the hook's
    stdout and stderr is closed. The child closes its copies and answers before it ends: a
    process that has run the hook takes about 1 ms more to end and be reaped."""
    import socket

    monkeypatch.setattr(agent.entry, "run_stage", lambda stage, config, state: 3)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    front, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    memfd = os.memfd_create("state")
    os.write(memfd, b'{"ociVersion": "1.0.2", "id": "c", "pid": 1, "bundle": "/nonexistent"}')
    pid = os.fork()
    if pid == 0:  # the child as a spare runs it, then slow to end
        try:
            job = agent.Job(1, None, "prestart", None, {"PATH": "/bin"}, [memfd, out_w, err_w, theirs.fileno()],
                            os.getppid(), 0o022)
            code = agent._child(job)
            time.sleep(3)
        finally:
            os._exit(code if "code" in locals() else 99)
    for fd in (out_w, err_w, memfd):
        os.close(fd)
    theirs.close()
    try:
        front.settimeout(2)
        began = time.monotonic()
        assert front.recv(16) == b"exit 3"
        assert os.read(out_r, 16) == b"" and os.read(err_r, 16) == b""  # end of file: no copy left
        assert time.monotonic() - began < 1.5
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still there
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (out_r, err_r):
            os.close(fd)
        front.close()


def test_a_start_waits_for_the_stops_lock_shared_and_only_so_long(tmp_path):
    """gpuhook.stoporder: no lock file (no agent's stop ever ran) is no wait; a lock a stop
    holds is waited for until it is let go, or until the start's time is up."""
    from gpuhook import stoporder

    path = str(tmp_path / "stops.lock")
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 5) is True and time.monotonic() - began < 0.5
    assert not os.path.exists(path)  # a start never makes it
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 0.3) is False
    assert 0.25 <= time.monotonic() - began < 2
    threading.Timer(0.2, os.close, (holder,)).start()
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 10) is True
    assert 0.15 <= time.monotonic() - began < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)



def test_a_start_waits_for_a_stop_on_its_way_to_the_agent_and_two_starts_do_not_hold_each_other(tmp_path):
    """gpuhook.stoporder: the native front holds `stops.pending` shared from before it forks
    the child that sends a stop until the agent has it; a start takes it exclusive (and lets it
    go), within the same time as the stop lock; starts never hold it, so they do not wait for
    one another."""
    from gpuhook import stoporder

    path = str(tmp_path / stoporder.LOCK_NAME)
    pending = str(tmp_path / stoporder.PENDING_NAME)
    stop = os.open(pending, os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(stop, fcntl.LOCK_SH)
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 0.3) is False
    assert 0.25 <= time.monotonic() - began < 2
    another = os.open(pending, os.O_RDONLY)  # a second stop on its way: shared, never held up
    fcntl.flock(another, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(another)
    threading.Timer(0.2, os.close, (stop,)).start()
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 10) is True
    assert 0.15 <= time.monotonic() - began < 2
    # Let go: the next start, and the next stop, take it at once.
    assert stoporder.wait_for_stops(path, time.monotonic() + 5) is True
    stop = os.open(pending, os.O_RDONLY)
    fcntl.flock(stop, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(stop)
    # Both: the pending stop first, then the one at its work, all within the start's time.
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    stop = os.open(pending, os.O_RDONLY)
    fcntl.flock(stop, fcntl.LOCK_SH)
    threading.Timer(0.2, os.close, (stop,)).start()
    threading.Timer(0.4, os.close, (holder,)).start()
    began = time.monotonic()
    assert stoporder.wait_for_stops(path, began + 10) is True
    assert 0.35 <= time.monotonic() - began < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_only_a_start_without_an_ld_cache_is_answered_before_its_worker_is_reaped(monkeypatch):
    """The agent's child answers the front, then reaps the committed worker
    (hook.reap_after_answer): not where the worker installed an ld cache, which it finishes as
    it commits (the image's set-aside cache removed) before the container may start; not for a
    failed start, nor for the hook run by the runtime itself, whose exit is its answer."""
    import types

    from gpuhook import hook
    from gpuhook.kernel import caller

    static, glibc = types.SimpleNamespace(ldcache=None), types.SimpleNamespace(ldcache=object())
    monkeypatch.setattr(caller, "CALLER", [1234])  # served by the agent, for a front of pid 1234
    assert hook.reap_after_answer(0, static)
    assert not hook.reap_after_answer(0, glibc)
    assert not hook.reap_after_answer(4, static)
    assert not hook.reap_after_answer(0, None)  # no plan: a stop, or a start served before
    monkeypatch.setattr(caller, "CALLER", [0])  # the runtime ran this process
    assert not hook.reap_after_answer(0, static)
