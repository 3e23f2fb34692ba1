"""native/prescan.c as the client of the resident agent (gpuhook agent, protocol
gpuhook.agent.PROTOCOL): a plain hook invocation its prescan could not rule out goes to a root-owned
agent socket when there is one; "run" sends it back to the Python hook here, "exit N" ends it
with N, anything else after the request went out is exit 70 with one line (never a second
run). A socket anyone but root could have placed, an empty GPUHOOK_AGENT_SOCKET, Docker's
launcher path and the no-GPU path never talk to the agent.

Integration, not unit: its sockets and their directories must be root's (the tests chown
them), and the unit suite passes as an unprivileged user with nothing skipped."""

import array
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, require
from gpuhook import agent as gpuhook_agent
from gpuhook import prescan, stoporder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "unit"))
from test_native_prescan import HANDED_OFF, MAY_REQUEST_CASES, native, state_for  # noqa: F401

NOBODY = 65534
LAUNCHER = "/usr/lib/python3/dist-packages/gpuhook/launch.py"
GPU_STATE = state_for("/nonexistent-bundle", annotations={"cdi.k8s.io/a": "nvidia.com/gpu=1"})


def _pidfd_target(fd):
    """The pid a pidfd refers to (its fdinfo's `Pid:`), or None for any other fd."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return None


def _own_namespaces():
    return [(os.stat(f"/proc/self/ns/{kind}").st_dev, os.stat(f"/proc/self/ns/{kind}").st_ino)
            for kind in ("mnt", "pid", "user", "cgroup")]


class Agent:
    """A SOCK_SEQPACKET server standing in for gpuhook agent: records the one request it gets
    (tokens, the memfd's bytes, the identities of the other two fds) and answers `reply`
    (bytes to send, or None to close without an answer)."""

    def __init__(self, directory, reply, answer_after=None, stops=False):
        self.path = os.path.join(directory, "agent.sock")  # what GPUHOOK_AGENT_SOCKET names
        # Where it listens: a stop goes to the agent's stop socket (gpuhook.stoporder).
        self.listening = stoporder.stop_socket_path(self.path) if stops else self.path
        self.reply = reply
        self.answer_after = answer_after  # a threading.Event the answer waits for
        self.received = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.listening)
        self.sock.listen(4)
        self.sock.settimeout(20)
        self.request = None
        self.thread = None

    def serve(self):
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            data, ancdata, flags, _ = conn.recvmsg(1 << 17, socket.CMSG_SPACE(8 * 4))
            fds = array.array("i")
            for level, kind, payload in ancdata:
                assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            try:
                state = os.pread(fds[0], 1 << 20, 0) if fds else None
                ids = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds]
                pids = [_pidfd_target(fd) for fd in fds]
            finally:
                for fd in fds:
                    os.close(fd)
            self.request = {"tokens": data.split(b"\0"), "state": state, "fds": ids, "pidfds": pids, "flags": flags,
                            "peer": conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)}
            self.received_at = time.monotonic()
            self.received.set()
            if self.answer_after is not None:
                self.answer_after.wait(20)
            if self.reply is not None:
                try:
                    conn.send(self.reply)
                except BrokenPipeError:  # a stop's front, and its child, gone (as the real agent allows)
                    pass

    def connected(self):
        """Whether anyone connected (the front has exited by now)."""
        if self.thread is not None:
            self.thread.join(10)
            return self.request is not None
        self.sock.setblocking(False)
        try:
            self.sock.accept()[0].close()
            return True
        except BlockingIOError:
            return False

    def close(self):
        self.sock.close()


@pytest.fixture
def agent_dir(tmp_path):
    require(os.geteuid() == 0, "the agent's socket must be root-owned: needs root")
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    return str(d)


def front(native, state, env, stage_args=("prestart",)):  # noqa: F811
    binary, recorder = native
    for suffix in (".stdin", ".env"):
        if os.path.exists(recorder + suffix):
            os.unlink(recorder + suffix)
    proc = subprocess.Popen([binary, recorder, "-I", "-S", LAUNCHER, *stage_args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ids = [(os.fstat(f.fileno()).st_dev, os.fstat(f.fileno()).st_ino) for f in (proc.stdout, proc.stderr)]
    try:
        out, err = proc.communicate(state, timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()  # a front waiting for an answer that never comes (the agent below does not serve)
        proc.communicate()
        raise
    python_stdin = open(recorder + ".stdin", "rb").read() if os.path.exists(recorder + ".stdin") else None
    return proc.returncode, out, err, python_stdin, ids


def test_a_gpu_request_goes_to_the_agent_with_exact_tokens_and_fds(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3").serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path, "PYTHONPATH": "/tmp/evil",
           "GPUHOOK_CONFIG": "/etc/gpuhook/config.toml"}
    code, out, err, python_stdin, ids = front(native, GPU_STATE, env, ("prestart", "--config", "/etc/g.toml"))
    agent.close()
    assert (code, out, err, python_stdin) == (3, b"", b"", None)
    req = agent.request
    assert req["tokens"][-1] == b""  # every token ends with its NUL
    tokens = [t.decode() for t in req["tokens"][:-1]]
    assert tokens[:5] == [gpuhook_agent.PROTOCOL.decode(), "3", "prestart", "--config", "/etc/g.toml"]
    assert int(tokens[5]) == len(tokens) - 6
    assert sorted(tokens[6:]) == sorted([
        "PATH=/usr/bin:/bin", f"GPUHOOK_AGENT_SOCKET={agent.path}", "GPUHOOK_CONFIG=/etc/gpuhook/config.toml",
        f"{prescan.FRONT_VARIABLE}={prescan.FRONT_PROTOCOL}",
    ])
    assert req["state"] == GPU_STATE
    assert len(req["fds"]) == 3 and req["fds"][1:] == ids  # the memfd, then the front's fd 1 and fd 2


def test_a_stop_goes_to_the_agent_with_the_state_its_namespaces_and_its_runtime(native, agent_dir):  # noqa: F811
    """runc waits for its hook's stdout and stderr to close; the agent answers a stop before
    carrying it out, so the front must not hand those over. It sends its namespaces instead
    (the agent checks a stop by them: the front has exited by then) and a pidfd of the runtime
    that ran it, here this process (gpuhook.agent.STOP_FDS)."""
    agent = Agent(agent_dir, b"exit 0", stops=True).serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, ids = front(native, GPU_STATE, env, ("poststop",))
    assert agent.connected()
    agent.close()
    assert (code, out, err, python_stdin) == (0, b"", b"", None)
    assert agent.request["tokens"][:3] == [gpuhook_agent.PROTOCOL, b"1", b"poststop"]
    assert agent.request["state"] == GPU_STATE
    assert len(agent.request["fds"]) == gpuhook_agent.STOP_FDS == 6
    assert agent.request["fds"][1:5] == _own_namespaces()
    assert agent.request["pidfds"][5] == os.getpid()
    assert not set(agent.request["fds"]) & set(ids)  # not the front's stdout or stderr


def _wait_for(path, seconds=20):
    until = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < until, f"{path} never appeared"
        time.sleep(0.02)


def _children_waiting(binary):
    """The front's detached children still alive (the front itself has exited)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/exe") == binary:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_stop_does_not_wait_for_the_agents_answer_but_starts_wait_for_the_stop(native, agent_dir):  # noqa: F811
    """The runtime's delete waits for nothing of the stop (docs/agent.md, "Stops"): the front
    exits 0 with its stdout and stderr closed while the agent has not answered. A child of the
    front sent the request and holds `stops.pending` until the answer: a start waits for it
    (gpuhook.stoporder), and goes on once the agent has the stop."""
    from gpuhook import stoporder

    binary, _ = native
    answer = threading.Event()
    agent = Agent(agent_dir, b"exit 0", answer_after=answer, stops=True).serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    try:
        began = time.monotonic()
        code, out, err, python_stdin, _ = front(native, GPU_STATE, env, ("poststop",))
        assert (code, out, err, python_stdin) == (0, b"", b"", None)
        assert time.monotonic() - began < 5
        assert agent.received.wait(10)
        (child,) = _children_waiting(binary)
        lock = os.path.join(agent_dir, stoporder.LOCK_NAME)
        assert stoporder.wait_for_stops(lock, time.monotonic() + 0.3) is False  # the stop is on its way
        assert os.stat(os.path.join(agent_dir, stoporder.PENDING_NAME)).st_mode & 0o777 == 0o600
        # The child is in a session of its own, holding none of the runtime's fds.
        assert os.getsid(child) == child
        for fd in (0, 1, 2):
            assert os.readlink(f"/proc/{child}/fd/{fd}") == "/dev/null"
    finally:
        answer.set()
    began = time.monotonic()
    assert stoporder.wait_for_stops(lock, began + 10) is True
    assert time.monotonic() - began < 5
    assert agent.connected()
    agent.close()
    assert agent.request["state"] == GPU_STATE and len(agent.request["fds"]) == gpuhook_agent.STOP_FDS


def test_a_stop_is_in_the_agents_queue_before_the_front_exits(native, agent_dir):  # noqa: F811
    """The front sends the stop itself, then exits: a runtime (or its supervisor) that kills
    everything left in its cgroup the moment it ends cannot lose it (attacker pass 15, B1).
    Here the agent takes the request only once the front has exited and its child was
    killed: the request was there all the same, with the runtime's pidfd."""
    binary, recorder = native
    agent = Agent(agent_dir, b"exit 0", stops=True)
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, _ = front(native, GPU_STATE, env, ("poststop",))
    assert (code, out, err, python_stdin) == (0, b"", b"", None)
    for pid in _children_waiting(binary):
        os.kill(pid, signal.SIGKILL)
    agent.serve()
    assert agent.connected()
    agent.close()
    assert agent.request["state"] == GPU_STATE and agent.request["pidfds"][5] == os.getpid()


def _lock_recorder(tmp_path, lock: str, tail: str):
    """A stand-in for the Python hook that records its stdin, whether `lock` is held (a shared
    flock refused: "1") and what its fd 3 is, then runs `tail`."""
    recorder = tmp_path / "python3"
    recorder.write_text(f'#!/bin/sh\ncat > "$0.stdin"\nflock -n -s {lock} true; echo $? > "$0.locked"\n'
                        f'readlink /proc/$$/fd/3 > "$0.fd3"\n{tail}')
    recorder.chmod(0o755)
    return recorder


def test_a_declined_stop_runs_the_python_hook_in_the_background_holding_the_stop_lock(native, agent_dir, tmp_path):  # noqa: F811
    """`run` for a stop: the front has exited already; its child runs the Python hook with the
    state, and holds `stops.lock` for it (fd 3), as the agent's stops hold it: starts wait."""
    from gpuhook import stoporder

    binary, _ = native
    lock = os.path.join(agent_dir, stoporder.LOCK_NAME)
    recorder = _lock_recorder(tmp_path, lock, 'ls /proc/$$/fd > "$0.fds"\ntouch "$0.done"\n')
    agent = Agent(agent_dir, b"run", stops=True).serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, _ = front((binary, str(recorder)), GPU_STATE, env, ("poststop",))
    assert (code, out, err) == (0, b"", b"")
    _wait_for(f"{recorder}.done")
    assert agent.connected()
    agent.close()
    assert open(f"{recorder}.stdin", "rb").read() == GPU_STATE
    assert open(f"{recorder}.locked").read().strip() == "1"  # held: a shared flock is refused
    assert open(f"{recorder}.fd3").read().strip() == lock
    fds = {int(fd) for fd in open(f"{recorder}.fds").read().split()}
    assert not fds - {0, 1, 2, 3, 10, 11}  # 10, 11: dash's own (its script, a saved fd 1)
    assert stoporder.wait_for_stops(lock, time.monotonic() + 5) is True  # let go when the hook ended


@pytest.mark.parametrize("how", ["no answer", "not an answer"])
def test_a_stop_the_agent_does_not_answer_runs_the_python_hook_in_the_background(native, agent_dir, how):  # noqa: F811
    """An agent that ends without an answer (killed with the stop in its queue) or answers
    nonsense: the front has exited; its child runs the Python hook with the state. A stop
    that may never run otherwise runs here (test_agent.py: the agent killed with stops in its
    queue)."""
    binary, recorder = native
    agent = Agent(agent_dir, {"no answer": None, "not an answer": b"exit 256"}[how], stops=True).serve()
    for suffix in (".stdin", ".env"):
        if os.path.exists(recorder + suffix):
            os.unlink(recorder + suffix)
    code, out, err, _, _ = front(native, GPU_STATE, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path},
                                 ("poststop",))
    assert (code, out, err) == (0, b"", b"")
    _wait_for(recorder + ".env")
    assert open(recorder + ".stdin", "rb").read() == GPU_STATE
    assert agent.connected()
    agent.close()


def test_a_stop_goes_to_the_stop_socket_only(native, agent_dir):  # noqa: F811
    """A stop is sent to the agent's stop socket, which the agent reads only once the runtime is
    done (docs/agent.md, "Stops"); never to the socket for starts. Where only that one listens
    (an agent of an earlier version), the stop runs here as before."""
    starts = Agent(agent_dir, b"exit 0")
    code, _, err, python_stdin, _ = front(native, GPU_STATE, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": starts.path},
                                          ("poststop",))
    assert (code, err, python_stdin) == (HANDED_OFF, b"", GPU_STATE)
    assert not starts.connected()
    starts.close()


@pytest.mark.parametrize("how", ["no socket", "others may write", "refused"])
def test_a_stop_without_a_usable_agent_socket_runs_here_as_before(native, agent_dir, how):  # noqa: F811
    """Nothing detached where the stop could not be handed to an agent (no socket, one the front
    must not use, one nobody listens on: an agent that was killed): the runtime waits for the
    Python hook, as without the front."""
    agent = Agent(agent_dir, b"exit 3", stops=True)
    if how == "no socket":
        agent.close()
        os.unlink(agent.listening)
    elif how == "refused":
        agent.sock.close()
    else:
        os.chmod(agent_dir, 0o777)
    code, _, err, python_stdin, _ = front(native, GPU_STATE, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path},
                                          ("poststop",))
    assert (code, err, python_stdin) == (HANDED_OFF, b"", GPU_STATE)
    if how == "others may write":
        assert not agent.connected()
        agent.close()


def test_a_stop_that_did_not_go_out_runs_here_holding_the_stop_lock(native, agent_dir, tmp_path):  # noqa: F811
    """Attacker pass 22: a stop the agent dropped unread before its send came (past
    UNREAD_MAX, silent 0.25 s), or one whose connect was refused, ran here after the front had
    let `stops.pending` go, holding nothing: a start waiting on that lock (one the agent had
    declined because this stop was queued unread) went on while the stop cleaned up. It runs
    here holding `stops.lock` (fd 3), taken before `stops.pending` is let go."""
    from gpuhook import stoporder

    binary, _ = native
    lock = os.path.join(agent_dir, stoporder.LOCK_NAME)
    recorder = _lock_recorder(tmp_path, lock, "exit 7\n")
    agent = Agent(agent_dir, b"exit 0", stops=True)
    agent.sock.close()  # the stop socket is there, nobody takes the connection
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, _ = front((binary, str(recorder)), GPU_STATE, env, ("poststop",))
    assert (code, out, err, python_stdin) == (7, b"", b"", GPU_STATE)  # here: the runtime waits for it
    assert open(f"{recorder}.locked").read().strip() == "1"  # held: a shared flock is refused
    assert open(f"{recorder}.fd3").read().strip() == lock
    assert stoporder.wait_for_stops(lock, time.monotonic() + 5) is True  # let go when the hook ended


def test_run_sends_the_hook_back_to_python_with_the_state_and_the_socket_variable(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"run").serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, _, err, python_stdin, _ = front(native, GPU_STATE, env)
    assert agent.connected()
    agent.close()
    assert (code, python_stdin, err) == (HANDED_OFF, GPU_STATE, b"")
    python_env = open(native[1] + ".env").read().splitlines()
    assert f"GPUHOOK_AGENT_SOCKET={agent.path}" in python_env


def test_a_killed_hook_process_is_one_line_and_exit_70(native, agent_dir):  # noqa: F811
    """The agent answers `signal N` when the hook's process there was killed: it holds none of
    the front's output (the runtime would wait for it), so the front writes the line."""
    agent = Agent(agent_dir, b"signal 9").serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, _ = front(native, GPU_STATE, env)
    agent.close()
    assert (code, out, python_stdin) == (70, b"", None)
    assert err == b"gpuhook: internal error: the hook's process ended on signal 9\n"


@pytest.mark.parametrize("reply", [None, b"", b"exit 256", b"exit", b"run\n", b"exit 03", b"signal 0", b"signal 65",
                                   b"signal", b"signal 09", b"signal x"])
def test_no_valid_answer_after_the_request_is_exit_70_with_one_line_and_no_python(native, agent_dir, reply):  # noqa: F811
    agent = Agent(agent_dir, reply).serve()
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    code, out, err, python_stdin, _ = front(native, GPU_STATE, env)
    assert agent.connected()
    agent.close()
    assert (code, out, python_stdin) == (70, b"", None)
    assert err == b"gpuhook: the gpuhook agent ended without an answer\n"


def _unused(native, env, agent, state=GPU_STATE, expected=HANDED_OFF):  # noqa: F811
    code, _, err, python_stdin, _ = front(native, state, env)
    assert not agent.connected()
    agent.close()
    assert code == expected and err == b""
    if expected == HANDED_OFF:
        assert python_stdin == state


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_socket_in_a_directory_others_may_write_is_not_used(native, agent_dir, mode):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    os.chmod(agent_dir, mode)
    _unused(native, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path}, agent)


def test_a_socket_in_a_directory_not_owned_by_root_is_not_used(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    os.chown(agent_dir, NOBODY, NOBODY)
    _unused(native, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path}, agent)


def test_a_socket_not_owned_by_root_is_not_used(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    os.chown(agent.path, NOBODY, NOBODY)
    _unused(native, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path}, agent)


def test_a_symlink_to_the_socket_is_not_used(native, agent_dir, tmp_path):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    os.symlink(agent.path, os.path.join(agent_dir, "link.sock"))
    _unused(native, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": os.path.join(agent_dir, "link.sock")}, agent)


def test_docker_launchers_path_stays_with_python(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    env = {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path, "GPUHOOK_DOCKER_DATA_ROOT": "/var/lib/docker"}
    _unused(native, env, agent)


def test_the_no_gpu_path_exits_0_without_connecting(native, agent_dir, tmp_path):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    env = {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path}
    _unused(native, env, agent, state=state_for(str(tmp_path)), expected=0)


def test_a_request_over_64_kib_goes_to_python_here(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    env = {"PATH": "/usr/bin:" + "/x" * 33000, "GPUHOOK_AGENT_SOCKET": agent.path}
    _unused(native, env, agent)


def test_a_refused_connection_goes_to_python_here(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 3")
    agent.sock.close()  # the socket file stays, nobody listens: ECONNREFUSED
    code, _, err, python_stdin, _ = front(native, GPU_STATE, {"PATH": "/usr/bin", "GPUHOOK_AGENT_SOCKET": agent.path})
    assert (code, err, python_stdin) == (HANDED_OFF, b"", GPU_STATE)


def _in_private_run(native, agent_dir, env):  # noqa: F811
    """The front run with agent_dir bind-mounted on /run/gpuhook in a private mount namespace
    (the default socket path), so that the host's /run is never touched."""
    require(shutil.which("unshare") is not None, "needs unshare")
    binary, recorder = native
    script = ('mount --make-rprivate / && mount -t tmpfs tmpfs /run && mkdir -m 755 /run/gpuhook && '
              'mount --bind "$1" /run/gpuhook && shift && exec "$@"')
    done = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", agent_dir, binary, recorder, "-I", "-S",
                           LAUNCHER, "prestart"], input=GPU_STATE, capture_output=True, env=env, timeout=60)
    return done.returncode, done.stderr


def test_without_the_variable_the_default_socket_is_used(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 5").serve()
    code, err = _in_private_run(native, agent_dir, {"PATH": "/usr/bin:/bin"})
    agent.close()
    assert (code, err) == (5, b"")
    assert agent.request["tokens"][:3] == [gpuhook_agent.PROTOCOL, b"1", b"prestart"]


def test_an_empty_gpuhook_agent_socket_never_uses_the_agent(native, agent_dir):  # noqa: F811
    agent = Agent(agent_dir, b"exit 5")
    code, err = _in_private_run(native, agent_dir, {"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": ""})
    assert not agent.connected()
    agent.close()
    assert (code, err) == (HANDED_OFF, b"")


def test_protocol_prints_the_front_protocol(native):  # noqa: F811
    done = subprocess.run([native[0], "--protocol"], capture_output=True, timeout=10)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{prescan.FRONT_PROTOCOL}\n".encode(), b"")


@pytest.mark.parametrize("kept", [True, False])
def test_the_stop_lock_the_front_hands_over_stays_with_the_stop(tmp_path, kept):
    """Attacker pass 23, B2: the front hands a stop it runs itself `stops.lock` as fd 3,
    inheritable across its exec into Python; every program the stop ran (a reset, systemctl)
    inherited it, and one left stuck in the kernel held the lock after the stop ended. The
    poststop hook keeps fd 3 to itself (`gpuhook.hook.keep_stop_lock_to_self`); without that
    call (the control case) a child still holds it."""
    lock = tmp_path / "stops.lock"
    lock.write_bytes(b"")
    script = (
        "import fcntl, os, subprocess, sys\n"
        "from gpuhook import hook\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
        "if fd != 3:\n    os.dup2(fd, 3); os.close(fd)\n"
        "os.set_inheritable(3, True)\n"  # as hand_off_keeping leaves it
        "fcntl.flock(3, fcntl.LOCK_EX)\n"
        f"{'hook.keep_stop_lock_to_self()' if kept else 'pass'}\n"
        "child = subprocess.Popen(['sleep', '30'], close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(child.pid)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    child = int(done.stdout)
    try:
        fd = os.open(lock, os.O_RDWR)
        try:
            free = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free = False
        finally:
            os.close(fd)
        assert free is kept  # the stop (the Python process) has ended; only a child could hold it
    finally:
        os.kill(child, signal.SIGKILL)
