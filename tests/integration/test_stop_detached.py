"""A stop through the native front and the agent, in real runc containers on the simulated
host: the front hands the stop to the agent and exits without its answer (docs/agent.md,
"Stops"). What attacker pass 15 broke, each now a test: a stop lost when the runtime's cgroup is
killed the moment runc ends (B1), a start that overtook a stop whose runtime lived on after its
hook (B2), a FIFO planted as the pending lock that held the runtime (B3)."""

import array
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from gpuhook import agent as agent_module
from gpuhook import prescan
from helpers import testbed
from helpers.runtimes import log_records, wait_for_record
from test_agent import Agent, front, stop_state, with_front  # noqa: F401  (front: the module's fixture)

pytestmark = pytest.mark.usefixtures("front")


def gpu_bundle(gpus, name, socket_path, stages):
    bundle_dir = f"{gpus.bed.workdir}/bundles/{name}"
    rootfs = gpus.bed.rootfs(f"{bundle_dir}/rootfs")
    return gpus.bed.bundle(name, ["/bin/busybox", "true"], env=["NVIDIA_VISIBLE_DEVICES=0"], rootfs=rootfs,
                           edit=with_front(gpus, gpus.front, socket_path, stages=stages))


def kill_all_in(cgroup: str) -> None:
    """What systemd does to a unit's cgroup once its main process ended (KillMode=control-group)."""
    for _ in range(50):
        with open(f"{cgroup}/cgroup.procs") as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def test_no_stop_is_lost_when_the_runtimes_cgroup_is_killed_the_moment_runc_ends(gpus, front, tmp_path):  # noqa: F811
    """B1: the front's child, which sent the request, was killed with the runtime's cgroup
    before the agent had read it, and the agent declined a request whose sender was gone: 2 to
    6 stops of 20 were lost. The front sends the request itself now, with its namespaces."""
    gpus.front = front
    running = Agent(tmp_path)
    unit = f"/sys/fs/cgroup/pids/gpuhook-test-unit-{os.getpid()}"
    os.makedirs(unit, exist_ok=True)
    names = [f"killed-{i}" for i in range(8)]
    try:
        for name in names:
            bundle = gpu_bundle(gpus, name, running.socket, ("prestart", "poststop"))
            script = (f'echo $$ > {unit}/cgroup.procs; runc --root {gpus.bed.state_root} run --bundle {bundle} {name}; '
                      f'for p in $(cat {unit}/cgroup.procs); do [ $p != $$ ] && kill -KILL $p; done; true')
            done = subprocess.run(["sh", "-c", script], capture_output=True, timeout=60, env=testbed.RUN_ENV)
            assert done.returncode == 0, done.stderr
        for name in names:
            stop = wait_for_record(gpus, "poststop", name)
            assert stop["agent"] is True and stop["decision"] != "failed", stop
        starts = {r["container"] for r in log_records(gpus, "prestart")}
        assert starts == set(names)
    finally:
        running.stop()
        kill_all_in(unit)
        os.rmdir(unit)


def test_a_start_after_a_stop_whose_runtime_lives_on_waits_for_that_stop(gpus, front, tmp_path):  # noqa: F811
    """B2: a runtime that outlives its poststop hook (more hooks after gpuhook's, a wrapper) held
    the stop in the front's child, and a start that came meanwhile reached the agent first (3
    of 3 with a stop slow to read its bundle). The stop is in the agent's queue before the front
    exits now (test_native_front_agent.py: `test_a_stop_is_in_the_agents_queue_before_the_front_
    exits` fails on the earlier front); here the agent holds it for its runtime, 100 ms, and the
    start that came meanwhile still comes after it. (With a fast stop the earlier code got this
    order too, by timing alone.)"""
    gpus.front = front
    running = Agent(tmp_path)
    try:
        with open(tmp_path / "state.json", "wb") as f:
            f.write(stop_state(tmp_path / "stopped", "lingering-stop", 0))
        bundle = gpu_bundle(gpus, "next-start", running.socket, ("prestart",))
        hook = (f"{front} {sys.executable} -I -S {REPO}/gpuhook/launch.py poststop --config {gpus.config} "
                f"< {tmp_path}/state.json")
        runtime = subprocess.Popen(["sh", "-c", f"{hook}; echo hook-done; sleep 1"], stdout=subprocess.PIPE,
                                   env={"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": running.socket})
        assert runtime.stdout.readline() == b"hook-done\n"  # the hook has exited; its runtime lives on
        started = subprocess.run([*gpus.bed.wrapper, "runc", "--root", gpus.bed.state_root, "run", "--bundle", bundle,
                                  "next-start"], capture_output=True, timeout=60, env=testbed.RUN_ENV)
        assert started.returncode == 0, started.stderr
        runtime.wait(30)
        wait_for_record(gpus, "poststop", "lingering-stop")
        order = [(r.get("stage"), r.get("container")) for r in gpus.log_lines()]
        assert order.index(("poststop", "lingering-stop")) < order.index(("prestart", "next-start")), order
    finally:
        running.stop()


def test_an_agent_that_is_stopped_hands_over_the_stops_it_holds_for_their_runtime(gpus, front, tmp_path):  # noqa: F811
    """The agent holds a stop until its runtime has ended (100 ms at most). Stopped meanwhile
    (SIGTERM: systemd's stop or restart), it hands the stop over before it ends, and the stop
    is carried out."""
    gpus.front = front
    running = Agent(tmp_path)
    with open(tmp_path / "state.json", "wb") as f:
        f.write(stop_state(tmp_path / "stopped", "held-stop", 0))
    hook = (f"{front} {sys.executable} -I -S {REPO}/gpuhook/launch.py poststop --config {gpus.config} "
            f"< {tmp_path}/state.json")
    runtime = subprocess.Popen(["sh", "-c", f"{hook}; echo hook-done; sleep 5"], stdout=subprocess.PIPE,
                               env={"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": running.socket})
    try:
        assert runtime.stdout.readline() == b"hook-done\n"
        assert running.stop() == 0
        stop = wait_for_record(gpus, "poststop", "held-stop")
        assert stop["agent"] is True, stop
    finally:
        runtime.kill()
        runtime.wait()


def test_a_fifo_planted_as_the_pending_lock_holds_neither_the_runtime_nor_the_stop(gpus, front, tmp_path):  # noqa: F811
    """B3: the front opened stops.pending without O_NONBLOCK, before its stdin and stdout were
    put aside: a FIFO there (only root can plant one: the directory is root's) held runc's
    delete. It is opened non-blocking now, and used only if it is a regular file."""
    gpus.front = front
    running = Agent(tmp_path)
    try:
        os.mkfifo(os.path.join(os.path.dirname(running.socket), "stops.pending"), 0o600)
        bundle = gpu_bundle(gpus, "fifo-stop", running.socket, ("prestart", "poststop"))
        began = time.monotonic()
        done = subprocess.run([*gpus.bed.wrapper, "runc", "--root", gpus.bed.state_root, "run", "--bundle", bundle,
                               "fifo-stop"], capture_output=True, timeout=60, env=testbed.RUN_ENV)
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - began < 10
        stop = wait_for_record(gpus, "poststop", "fifo-stop")
        assert stop["agent"] is True, stop
    finally:
        running.stop()


def _crafted_stop(socket_path: str, runtime_fd: int, client=None) -> socket.socket:
    """A stop request as the front sends it (root, the agent's namespaces), with `runtime_fd`
    where the runtime's pidfd goes (on `client`, connected already, when given)."""
    mfd = os.memfd_create("state")
    os.write(mfd, b'{"ociVersion":"1.0.2","id":"crafted","status":"stopped","pid":0,"bundle":"/nonexistent"}')
    ns = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in ("mnt", "pid", "user", "cgroup")]
    env = ["PATH=/usr/bin:/bin", f"{prescan.FRONT_VARIABLE}={prescan.FRONT_PROTOCOL}"]
    tokens = [agent_module.PROTOCOL, b"1", b"poststop", str(len(env)).encode(), *[e.encode() for e in env]]
    if client is None:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(socket_path)
    client.sendmsg([b"\0".join(tokens) + b"\0"],
                   [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [mfd, *ns, runtime_fd]))])
    for fd in (mfd, *ns):
        os.close(fd)
    client.settimeout(10)
    return client


@pytest.mark.parametrize("kind", ["epoll chain", "pipe"])
def test_a_stop_whose_runtime_fd_is_not_a_pidfd_is_declined_and_the_agent_serves_on(tmp_path, kind):
    """Attacker pass 16, B1: the agent watched a stop's sixth fd in its own epoll; a chain of
    epoll fds (select says "not ready", epoll_ctl says ELOOP) ended the agent, and the starts
    it held failed with exit 70. Only a pidfd is taken; anything else is `run`."""
    running = Agent(tmp_path)
    try:
        if kind == "epoll chain":
            chain = [select.epoll() for _ in range(7)]
            for outer, inner in zip(chain, chain[1:]):
                try:
                    outer.register(inner.fileno(), select.EPOLLIN)
                except OSError:
                    break
            fd = chain[0].fileno()
        else:
            fd, writer = os.pipe()
        with _crafted_stop(running.socket, fd) as client:
            assert client.recv(16) == b"run"
        pidfd = os.pidfd_open(os.getpid())  # the same request with a pidfd is taken
        with _crafted_stop(running.socket, pidfd) as client:
            assert client.recv(16) == b"exit 0"
        os.close(pidfd)
        assert running.process.poll() is None
    finally:
        assert running.stop() == 0


def _crafted_start(socket_path: str) -> socket.socket:
    """A start request as the front sends it (root, the agent's namespaces): state, fds 1 and 2."""
    mfd = os.memfd_create("state")
    os.write(mfd, b'{"ociVersion":"1.0.2","id":"crafted","status":"created","pid":1,"bundle":"/nonexistent"}')
    env = ["PATH=/usr/bin:/bin", f"{prescan.FRONT_VARIABLE}={prescan.FRONT_PROTOCOL}"]
    tokens = [agent_module.PROTOCOL, b"1", b"prestart", str(len(env)).encode(), *[e.encode() for e in env]]
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(socket_path)
    client.sendmsg([b"\0".join(tokens) + b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [mfd, 1, 2]))])
    os.close(mfd)
    client.settimeout(10)
    return client


def _ended_pidfd() -> int:
    """A pidfd of a runtime that has ended."""
    done = subprocess.Popen(["true"])
    pidfd = os.pidfd_open(done.pid)
    done.wait()
    return pidfd


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """An agent in this process whose hand-over records (stage, when) and answers at once."""
    server = agent_module.Agent(str(tmp_path / "agent" / "agent.sock"))
    server.listen()
    handed = []

    def hand(job):
        handed.append((job.stage, time.monotonic()))
        agent_module._close_fds(job.fds)
        job.fds = []
        if job.conn is not None:
            agent_module._reply(job.conn, b"exit 0")
            job.conn.close()
            job.conn = None
    monkeypatch.setattr(server, "_hand", hand)
    yield server, handed
    server.close()


def _serve_until(server, handed, count, seconds=10):
    began = time.monotonic()
    server.serve(until=lambda: len(handed) >= count or time.monotonic() - began > seconds)
    return began


def test_a_stop_waits_on_the_stop_socket_while_its_runtime_finishes(recorded, monkeypatch):
    """The front sends a stop to the agent's stop socket (gpuhook.stoporder.stop_socket_path)
    and exits; its runtime is finishing the delete then. The agent does not read the stop for
    STOP_TAKE_DELAY: reading it there and then took the CPU from runc's last steps (the stop
    was 0.3 ms slower, benchmarks/README.md, "Stops")."""
    monkeypatch.setattr(agent_module, "STOP_TAKE_DELAY", 0.5)
    server, handed = recorded
    pidfd = _ended_pidfd()
    with _crafted_stop(server.stop_path, pidfd) as client:
        began = _serve_until(server, handed, 1)
        assert [stage for stage, _ in handed] == ["poststop"]
        assert 0.5 <= handed[0][1] - began < 5
        assert client.recv(16) == b"exit 0"
    os.close(pidfd)


def test_a_start_takes_the_stops_queued_before_it_first(recorded, monkeypatch):
    """A start does not wait out STOP_TAKE_DELAY, nor overtake a stop queued before it: the
    agent reads the stop socket's queue before the start (the stop was queued before the front
    exited, so before its runtime went on to anything else)."""
    monkeypatch.setattr(agent_module, "STOP_TAKE_DELAY", 5.0)
    server, handed = recorded
    pidfd = _ended_pidfd()
    with _crafted_stop(server.stop_path, pidfd) as stop, _crafted_start(server.path) as start:
        began = _serve_until(server, handed, 2)
        assert [stage for stage, _ in handed] == ["poststop", "prestart"]
        assert handed[1][1] - began < 4
        assert stop.recv(16) == b"exit 0" and start.recv(16) == b"exit 0"
    os.close(pidfd)


def test_a_start_on_the_stop_socket_is_declined(recorded):
    """Only stops wait on the stop socket; a start sent there runs in the Python hook."""
    server, handed = recorded
    with _crafted_start(server.stop_path) as client:
        _serve_until(server, handed, 1, seconds=1)
        assert client.recv(16) == b"run"
    assert handed == []


class _Listener:
    """The agent's socket for starts, with a hook run before each accept."""

    def __init__(self, listener, before_accept):
        self._listener, self._before = listener, before_accept

    def accept(self):
        self._before()
        return self._listener.accept()

    def __getattr__(self, name):
        return getattr(self._listener, name)


def test_a_stop_queued_while_the_agent_accepts_starts_still_comes_first(recorded, monkeypatch):
    """Attacker pass 17, B1: the agent read the stop socket once, then accepted starts until
    none was left. A stop queued meanwhile (its front exited, its runtime went on and started a
    container) came after that start: a stream of connections kept the loop there for up to
    585 ms. Now the stops are read after each start is accepted, before it is numbered."""
    monkeypatch.setattr(agent_module, "STOP_TAKE_DELAY", 5.0)
    server, handed = recorded
    pidfd = _ended_pidfd()
    clients = []

    def between():  # on the second accept: a stop is queued, then a start connects
        calls.append(1)
        if len(calls) == 2:
            clients.append(_crafted_stop(server.stop_path, pidfd))
            clients.append(_crafted_start(server.path))
    calls = []
    first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # the stream of connections
    first.connect(server.path)
    first.send(b"not a request")
    server.listener = _Listener(server.listener, between)
    try:
        _serve_until(server, handed, 2)
        assert [stage for stage, _ in handed] == ["poststop", "prestart"]
        assert [client.recv(16) for client in clients] == [b"exit 0", b"exit 0"]
        assert first.recv(16) == b"run"
    finally:
        for client in [first, *clients]:
            client.close()
        os.close(pidfd)  # the agent closed its listeners when it ended


def test_a_stream_of_connections_does_not_hold_the_agents_loop(recorded, monkeypatch):
    """Attacker pass 17: three clients connecting in a tight loop held one accept loop for up to
    585 ms, with no stop taken, no child reaped and no spare made meanwhile. A turn of the loop
    takes ACCEPT_BATCH connections at most and comes back for the rest."""
    monkeypatch.setattr(agent_module, "UNREAD_MAX", 1000)  # the batch, not the cap on unread ones
    server, _ = recorded
    clients = []
    for _ in range(agent_module.ACCEPT_BATCH + 8):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(server.path)
        clients.append(client)
    server._accept(server.listener)
    assert len(server.unread) == agent_module.ACCEPT_BATCH  # none has sent anything yet
    server._accept(server.listener)
    assert len(server.unread) == agent_module.ACCEPT_BATCH + 8
    for conn in list(server.unread):
        server._drop(conn)
    for client in clients:
        client.close()


def test_a_stop_accepted_before_its_request_came_holds_the_starts_after_it(recorded):
    """Attacker pass 18, attempt 1: a stop was numbered when its request was read. One whose
    front was accepted between its connect and its send (a big state to copy, a preemption)
    was read after a start that connected later, numbered after it, and the start was handed
    over first. Connections are numbered when accepted now, and a start waits for a stop
    accepted before it until its request is read (READ_TIMEOUT at most)."""
    import threading

    server, handed = recorded
    pidfd = _ended_pidfd()
    stop = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stop.connect(server.stop_path)
    server._take_stops()  # accepted, nothing to read yet
    assert len(server.unread) == 1
    start = _crafted_start(server.path)
    sender = threading.Timer(0.3, _crafted_stop, (server.stop_path, pidfd, stop))
    sender.start()
    try:
        _serve_until(server, handed, 2)
        assert [stage for stage, _ in handed] == ["poststop", "prestart"]
        stop.settimeout(10)
        assert stop.recv(16) == b"exit 0" and start.recv(16) == b"exit 0"
    finally:
        sender.join()
        stop.close()
        start.close()
        os.close(pidfd)


def _out_of_fds(times: int | None = None):
    """An accept hook that fails as a process out of fds does, the first `times` calls (every
    call with None). Returns it and the list of (when) of each call."""
    import errno

    calls = []

    def hook():
        calls.append(time.monotonic())
        if times is None or len(calls) <= times:
            raise OSError(errno.EMFILE, "Too many open files")
    return hook, calls


def test_out_of_fds_the_agent_pauses_its_socket_instead_of_spinning(recorded, monkeypatch):
    """Attacker pass 18, attempt 2: with every fd taken by connections that send nothing, the
    socket stayed readable, accept failed with EMFILE on every turn, and the loop spun a CPU. It
    stops watching the socket for ACCEPT_PAUSE instead. Stopped, it tries its queue again every
    ACCEPT_PAUSE, up to FINISH_ACCEPT_WAIT, then ends."""
    monkeypatch.setattr(agent_module, "FINISH_ACCEPT_WAIT", 0.3)
    server, handed = recorded
    out_of_fds, calls = _out_of_fds()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(server.path)  # the socket is readable, and stays so
    server.listener = _Listener(server.listener, out_of_fds)
    try:
        began = time.monotonic()
        server.serve(until=lambda: time.monotonic() - began > 0.5)
        ended = time.monotonic()
        serving = [at for at in calls if at - began <= 0.5]
        assert 3 <= len(serving) <= 0.5 / agent_module.ACCEPT_PAUSE + 3
        assert len(calls) - len(serving) <= 0.3 / agent_module.ACCEPT_PAUSE + 3
        assert ended - began < 0.5 + 0.3 + 1
    finally:
        client.close()
    assert handed == [] and not server.selector.get_map()  # no request came: nothing is watched


def test_a_start_taking_the_last_fd_before_the_stops_is_declined_and_the_agent_lives(recorded, monkeypatch):
    """Attacker pass 19: a start and a stop came in one turn of the loop, the start's accept
    took the last fd, and the stop socket's accept failed. A: the agent stopped watching the
    stop socket (out of fds), then handled its event and unregistered it again: KeyError, and
    the agent died with exit 70. C: the start was numbered before the stop still queued. Now
    the event is skipped, and the start is declined: the Python hook that runs it waits for
    the stops on their way (stops.pending). The stop is taken ACCEPT_PAUSE later."""
    monkeypatch.setattr(agent_module, "STOP_TAKE_DELAY", 5.0)
    server, handed = recorded
    out_of_fds, calls = _out_of_fds(times=1)
    server.stop_listener = _Listener(server.stop_listener, out_of_fds)
    pidfd = _ended_pidfd()
    # The start first: its event comes first in the loop's turn, the stop's after it.
    with _crafted_start(server.path) as start, _crafted_stop(server.stop_path, pidfd) as stop:
        _serve_until(server, handed, 1, seconds=5)
        assert start.recv(16) == b"run"
        assert [stage for stage, _ in handed] == ["poststop"]
        assert stop.recv(16) == b"exit 0"
    assert len(calls) >= 2
    os.close(pidfd)


def test_a_stopped_agent_out_of_fds_serves_the_starts_queued_instead_of_resetting_them(recorded):
    """Attacker pass 19, B1: an agent stopped while out of fds failed to accept the starts
    queued, closed its socket and reset them, and their fronts failed the starts. It tries
    again every ACCEPT_PAUSE (fds come back as connections that send nothing are dropped), up
    to FINISH_ACCEPT_WAIT. B2: nothing of its sockets is left watched once it has ended."""
    server, handed = recorded
    out_of_fds, calls = _out_of_fds(times=3)
    server.listener = _Listener(server.listener, out_of_fds)
    with _crafted_start(server.path) as start:
        server.serve(until=lambda: True)  # stopped from the first turn
        assert [stage for stage, _ in handed] == ["prestart"]
        assert start.recv(16) == b"exit 0"
    assert len(calls) == 5  # three out of fds, the start, the empty queue
    assert server.listener is None and server.stop_listener is None
    assert not [key for key in server.selector.get_map().values() if key.data in ("listen", "stops")]


def _cap_unread(monkeypatch, most: int, evict_after: float) -> None:
    """The agent's cap on unread connections per socket, and how long the oldest may be silent
    past it, small for a test."""
    monkeypatch.setattr(agent_module, "UNREAD_MAX", most)
    monkeypatch.setattr(agent_module, "UNREAD_EVICT", evict_after)


def _idle(path: str, count: int) -> list:
    """`count` connections to `path` that send nothing (each holds one of the agent's fds)."""
    clients = []
    for _ in range(count):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(path)
        clients.append(client)
    return clients


def test_a_flood_on_the_stop_socket_holds_a_few_fds_and_the_starts_go_on(recorded, monkeypatch):
    """Attacker pass 20, B4: connections to the stop socket that send nothing (each kept
    READ_TIMEOUT), dropped and made again, took every fd the agent had: the socket for starts
    got none, and starts waited 30 to 77 s, past the runtime's hook timeout. The agent now
    holds at most UNREAD_MAX unread connections per socket; a start that comes meanwhile is
    declined (stops are left unread behind the flood) and runs in the Python hook at once."""
    monkeypatch.setattr(agent_module, "UNREAD_MAX", 4)
    monkeypatch.setattr(agent_module, "STOP_TAKE_DELAY", 0.0)
    server, handed = recorded
    flood = _idle(server.stop_path, 8)
    most = []
    read = server._read

    def counted(conn):
        most.append(server._unread_of(True))
        return read(conn)
    monkeypatch.setattr(server, "_read", counted)
    try:
        began = time.monotonic()
        with _crafted_start(server.path) as start:
            server.serve(until=lambda: time.monotonic() - began > 0.5)
            assert start.recv(16) == b"run"
        assert max(most) <= 4 and handed == []
    finally:
        for client in flood:
            client.close()


def test_a_socket_that_waited_for_its_unread_connections_is_watched_again(recorded, monkeypatch):
    """The other half of the cap: once an unread connection has been silent UNREAD_EVICT, it
    is dropped for the next one, and the start queued behind the flood is served."""
    _cap_unread(monkeypatch, 2, 0.3)
    server, handed = recorded
    flood = _idle(server.path, 2)
    try:
        with _crafted_start(server.path) as start:
            began = _serve_until(server, handed, 1, seconds=5)
            assert [stage for stage, _ in handed] == ["prestart"]
            assert 0.3 <= handed[0][1] - began < 4
            assert start.recv(16) == b"exit 0"
        assert [client.recv(16) for client in flood] == [b"run", b"run"]  # given up on: run the hook yourself
    finally:
        for client in flood:
            client.close()


def test_a_stopped_agent_whose_stop_socket_is_out_of_fds_still_answers_its_starts(recorded, monkeypatch):
    """Attacker pass 20, B2: a stopped agent took the socket for starts only once the stop
    socket's queue was empty; with that queue flooded and the agent out of fds, it never got
    there, and closed the socket on the starts queued: their fronts failed them. Both queues are
    tried each time; a start accepted while stops are left is declined (`run`)."""
    monkeypatch.setattr(agent_module, "FINISH_ACCEPT_WAIT", 0.3)
    server, handed = recorded
    out_of_fds, _ = _out_of_fds()
    server.stop_listener = _Listener(server.stop_listener, out_of_fds)
    flood = _idle(server.stop_path, 1)
    try:
        with _crafted_start(server.path) as start:
            server.serve(until=lambda: True)
            assert start.recv(16) == b"run"
        assert handed == []
    finally:
        for client in flood:
            client.close()


def test_handing_over_a_stop_takes_no_new_fd(tmp_path, monkeypatch):
    """Attacker pass 20, A1: handing a stop to its spare dup'ed the spare's channel (the fd the
    agent watches for the bundle read); out of fds, the dup failed and ended the agent, and the
    starts it held failed. It keeps the channel itself."""
    import errno

    server = agent_module.Agent(str(tmp_path / "agent.sock"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    go_r, go_w = os.pipe()
    sleeper = subprocess.Popen(["sleep", "30"])
    spare = agent_module.Spare(sleeper.pid, os.pidfd_open(sleeper.pid), ours, go_w)
    server.spare = spare
    front_end, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mfd = os.memfd_create("state")
    job = agent_module.Job(1, conn, "poststop", None, {}, [mfd], 0, 0o022)

    def no_fd(*args):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(os, "dup", no_fd)
    try:
        server._hand(job)
        assert front_end.recv(16) == b"exit 0"
        assert job.ready >= 0 and job.pidfd in server.running
        data, ancdata, _, _ = theirs.recvmsg(4096, socket.CMSG_SPACE(4))
        assert data.startswith(b"1 0 18 ") and len(ancdata) == 1
        theirs.close()  # the spare read the bundle: its end of file reaches the agent
        assert select.select([job.ready], [], [], 5)[0]
    finally:
        monkeypatch.undo()
        sleeper.kill()
        sleeper.wait()
        for fd in (go_r, job.ready, job.pidfd):
            if fd >= 0:
                os.close(fd)
        for s in (front_end, theirs):
            s.close()
        for level, kind, payload in locals().get("ancdata", ()):
            os.close(int.from_bytes(payload[:4], "little"))


def test_a_stopped_agent_serves_a_start_queued_behind_many_silent_connections(recorded, monkeypatch):
    """Attacker pass 21, B1: with at most UNREAD_MAX unread connections, each dropped only after
    READ_TIMEOUT, a stopped agent took 32 connections per 2 s and closed its socket after 3 s: a
    start queued behind 120 silent connections was reset, and its front failed it (without a
    stop, it waited 6 s). The oldest silent one is dropped for the next once it has been silent
    UNREAD_EVICT."""
    _cap_unread(monkeypatch, 4, 0.1)
    # Past FINISH_ACCEPT_WAIT: dropped only then, the silent ones held the start until its socket
    # was closed (the agent then waits that long for the last ones it accepted, and ends).
    monkeypatch.setattr(agent_module, "READ_TIMEOUT", agent_module.FINISH_ACCEPT_WAIT + 1)
    server, handed = recorded
    flood = _idle(server.path, 20)
    try:
        with _crafted_start(server.path) as start:
            began = time.monotonic()
            server.serve(until=lambda: True)  # stopped from the first turn
            assert [stage for stage, _ in handed] == ["prestart"]
            assert handed[0][1] - began < agent_module.FINISH_ACCEPT_WAIT
            assert start.recv(16) == b"exit 0"
    finally:
        for client in flood:
            client.close()


def test_a_request_sent_as_its_silent_connection_is_given_up_on_is_served_or_refused_never_reset(recorded, monkeypatch):
    """Attacker pass 22: the agent read a silent connection once more and then closed it; a
    request sent between the two was reset with no answer, and its front failed the start. The
    reading side is shut first now: the send fails (EPIPE) and the front runs the hook itself."""
    _cap_unread(monkeypatch, 1, 0.0)
    server, _ = recorded
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    slow.connect(server.path)
    server._accept(server.listener, most=1)  # accepted; its request has not come
    (target,) = server.unread
    read, sent = server._read, []

    def read_then_send(conn):
        read(conn)
        if conn is target and conn in server.unread and not sent:  # the request lands now
            sent.append(slow.send(b"a request"))
    monkeypatch.setattr(server, "_read", read_then_send)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    other.connect(server.path)
    try:
        server._accept(server.listener, most=1)  # past UNREAD_MAX: the silent one is given up on
        assert target not in server.unread
        slow.settimeout(2)
        if sent:  # its send was taken: it must get an answer
            assert slow.recv(16) in (b"run", b"exit 0")
        else:  # or the send fails, and the front runs the hook itself
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                slow.send(b"a request")
    finally:
        slow.close()
        other.close()
        for conn in list(server.unread):
            server._drop(conn)
