"""The agent (gpuhook.agent, docs/agent.md) behind the native front, in real runc starts on
the simulated host: it serves GPU starts and stops as the Python hook would, with the front's
fds, exit status and cgroup; it serves nothing outside its namespaces; without it the front
runs the Python hook."""

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import REPO, GpuContainers, assert_rootfs_clean, require, require_root_tools
from gpuhook import agent as agent_module
from gpuhook import stoporder
from gpuhook.simulate import nvml as simnvml
from helpers import testbed
from helpers.runtimes import log_records, wait_for_record

pytestmark = pytest.mark.usefixtures("front")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """The native front, built from native/ as the packages build it."""
    require_root_tools("gcc")
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_build", os.path.join(REPO, "native", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.build(str(tmp_path_factory.mktemp("front")))


class Agent:
    def __init__(self, directory, cgroup: str | None = None):
        self.socket = f"{directory}/agent/agent.sock"
        prefix = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "agent"] if cgroup else []
        self.process = subprocess.Popen([*prefix, sys.executable, "-m", "gpuhook", "agent", "--socket", self.socket],
                                        stderr=subprocess.PIPE, cwd=REPO)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            assert self.process.poll() is None, self.process.stderr.read()
            assert time.monotonic() < deadline, "the agent did not listen within 30 s"
            time.sleep(0.02)

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(30)


@pytest.fixture
def agent(tmp_path):
    running = Agent(tmp_path)
    yield running
    assert running.stop() == 0


def front_entry(front: str, config: str, stage: str, socket_path: str) -> dict:
    python, launcher = sys.executable, f"{REPO}/gpuhook/launch.py"
    return {"path": front, "args": [front, python, "-I", "-S", launcher, stage, "--config", config],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", f"GPUHOOK_AGENT_SOCKET={socket_path}"], "timeout": 30}


def with_front(gpus, front, socket_path, stages=("prestart", "poststop"), cgroups_path=None):
    def edit(spec):
        spec["hooks"] = {stage: [front_entry(front, gpus.config, stage, socket_path)] for stage in stages}
        if cgroups_path is not None:
            spec["linux"]["cgroupsPath"] = cgroups_path
    return edit


def test_a_gpu_start_and_stop_through_the_agent_are_the_hooks(gpus, front, agent):
    result = gpus.run("via-agent", env=["NVIDIA_VISIBLE_DEVICES=1"], hook=False,
                      edit=with_front(gpus, front, agent.socket))
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert probes["/dev/nvidia1"]["read"] == "ENXIO" and probes["/dev/nvidia0"]["exists"] is False
    (start,) = log_records(gpus, "prestart")
    assert start["agent"] is True and start["decision"] == "gpus injected", start
    assert start["gpus"] == [gpus.uuid(1)]
    stop = wait_for_record(gpus, "poststop", "via-agent")
    assert stop["agent"] is True, stop


def test_the_agents_child_writes_the_hooks_line_to_the_runtime_and_exits_as_the_hook(gpus, front, agent):
    result = gpus.run("no-such-gpu", env=["NVIDIA_VISIBLE_DEVICES=77"], hook=False,
                      edit=with_front(gpus, front, agent.socket))
    assert result.returncode != 0
    assert "exit status 3" in result.stderr and "gpuhook: requested GPU '77'" in result.stderr, result.stderr
    (start,) = log_records(gpus, "prestart")
    assert start["agent"] is True and start["decision"] == "failed"


def test_a_front_in_another_mount_namespace_runs_the_python_hook_itself(sim_host, probe, tmp_path, front, agent):
    """Paths, pids and cgroups mean what they mean to the agent only in its own namespaces."""
    require_root_tools("unshare")
    wrapper = ["unshare", "--mount", "--propagation", "private"]
    gpus = GpuContainers(testbed.Testbed(str(tmp_path / "bed"), wrapper=wrapper), sim_host, probe, tmp_path)
    result = gpus.run("elsewhere", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                      edit=with_front(gpus, front, agent.socket))
    assert result.returncode == 0, result.stderr
    (start,) = log_records(gpus, "prestart")
    assert "agent" not in start and start["decision"] == "gpus injected", start


def test_without_the_agent_the_front_runs_the_python_hook(gpus, front, tmp_path):
    result = gpus.run("no-agent", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                      edit=with_front(gpus, front, str(tmp_path / "nobody-listens" / "agent.sock")))
    assert result.returncode == 0, result.stderr
    (start,) = log_records(gpus, "prestart")
    assert "agent" not in start and start["decision"] == "gpus injected", start


def test_the_runtimes_own_cgroup_is_the_fronts_not_the_agents(sim_host, probe, tmp_path, front):
    """A container runc puts in the cgroup runc itself runs in (cgroupsPath = the caller's)
    has no cgroup of its own: gpuhook grants nothing there. The agent's child lives in the
    agent's cgroup; the question must be asked of the front's."""
    require_root_tools("sh")
    devices = "/sys/fs/cgroup/devices"
    require(os.path.isdir(devices), "needs the cgroup v1 devices controller")
    service = f"{devices}/gpuhook-agent-caller-{os.getpid()}"
    elsewhere = f"{devices}/gpuhook-agent-home-{os.getpid()}"
    os.makedirs(service)
    os.makedirs(elsewhere)
    running = None
    try:
        running = Agent(tmp_path, cgroup=elsewhere)
        wrapper = ["sh", "-c", f'echo $$ > {service}/cgroup.procs && exec "$@"', "in-service"]
        gpus = GpuContainers(testbed.Testbed(str(tmp_path / "bed"), wrapper=wrapper), sim_host, probe, tmp_path)
        result = gpus.run("callers-cgroup", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                          edit=with_front(gpus, front, running.socket,
                                          cgroups_path="/" + os.path.basename(service)))
        assert result.returncode == 0, result.stderr
        (start,) = log_records(gpus, "prestart")
        assert start["agent"] is True, start
        assert not start.get("rules_added") and any("no cgroup grant" in n for n in start["notes"]), start
    finally:
        if running is not None:
            running.stop()
        for cgroup in (service, elsewhere):
            with open(f"{cgroup}/cgroup.procs") as f:
                for pid in f.read().split():
                    with open(f"{devices}/cgroup.procs", "w") as root:
                        root.write(pid)
            os.rmdir(cgroup)


def test_the_agents_socket_is_roots_alone(agent):
    for path in (agent.socket, stoporder.stop_socket_path(agent.socket)):  # starts, stops
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    parent = os.stat(os.path.dirname(agent.socket))
    assert parent.st_uid == 0 and parent.st_mode & 0o777 == 0o700


def test_an_agent_that_ends_takes_its_socket_away(tmp_path):
    """Attacker pass 10, M1: it compared the socket file's inode with its socket fd's (never
    the same), and left the file behind."""
    running = Agent(tmp_path)
    assert running.stop() == 0
    assert os.listdir(os.path.dirname(running.socket)) == []


def test_a_sigterm_right_after_ready_still_ends_the_agent_cleanly(tmp_path):
    """systemd may stop the agent the moment it said READY=1: the signal handlers are in place
    before that (it used to die of the default action, its socket file left behind; seen as
    this file's test above failing under load)."""
    path = f"{tmp_path}/run/agent.sock"
    code = ("import os, signal, sys; from gpuhook import agent; "
            "agent.run(sys.argv[1], ready=lambda: os.kill(os.getpid(), signal.SIGTERM))")
    done = subprocess.run([sys.executable, "-c", code, path], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert os.listdir(os.path.dirname(path)) == []


def test_a_socket_path_too_long_is_one_line_and_makes_nothing(tmp_path):
    """Attacker pass 10, M2: the directory was made before bind failed on the path's length."""
    directory = tmp_path / ("d" * 100)
    result = subprocess.run([sys.executable, "-m", "gpuhook", "agent", "--socket", f"{directory}/agent.sock"],
                            capture_output=True, text=True, cwd=REPO, timeout=30)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "longer than 101 bytes" in result.stderr and not directory.exists()  # 107 with ".stops"


def stop_state(directory, name: str, escapes: int) -> bytes:
    """A stopped container's state whose config.json asks for GPU 0 behind `escapes` \\u
    escapes (each one the prescan must decode)."""
    bundle = f"{directory}/{name}"
    os.makedirs(bundle, exist_ok=True)
    with open(f"{bundle}/config.json", "w") as f:
        f.write('{"ociVersion":"1.0.2","process":{"env":["NVIDIA_VISIBLE_DEVICES=0","X=%s"]}}' % ("\\u007a" * escapes))
    return json.dumps({"ociVersion": "1.0.2", "id": name, "status": "stopped", "pid": 0,
                       "bundle": bundle}).encode()


def run_front(front, stage, state: bytes, config: str, socket_path: str, timeout=60):
    python, launcher = sys.executable, f"{REPO}/gpuhook/launch.py"
    return subprocess.Popen([front, python, "-I", "-S", launcher, stage, "--config", config],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "GPUHOOK_AGENT_SOCKET": socket_path})


def test_no_stop_holds_up_the_agent_for_another_container(gpus, front, agent, tmp_path):
    """Attacker pass 8, A1: the agent read each stop's config.json and ran its prescan in its
    own loop before it answered anyone else; stops with big config.json files held every
    other container's request back for seconds (and a start past its deadline: the time it
    waits in the agent now counts in it, gpuhook.kernel.caller.SINCE). A stop's child reads
    them now, and the loop answers the next request at once."""
    stops = [run_front(front, "poststop", b"", gpus.config, agent.socket) for _ in range(4)]
    for i, process in enumerate(stops):
        process.stdin.write(stop_state(tmp_path / "bundles", f"big-{i}", 6 << 20))
        process.stdin.close()
    time.sleep(0.2)
    began = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:  # a request it declines
        client.connect(agent.socket)
        client.send(agent_module.PROTOCOL + b"\0" + b"1\0nostage\0" + b"0\0")
        client.settimeout(30)
        assert client.recv(16) == b"run"
    took = time.monotonic() - began
    assert [process.wait(60) for process in stops] == [0] * 4
    # One stop's prescan alone takes about 0.5 s here; in the agent's loop, one after the
    # other, the four held the answer back 2 s and more.
    assert took < 0.3, took


def test_every_stop_the_agent_answered_is_carried_out_even_when_the_agent_dies(gpus, front, tmp_path):
    """Attacker pass 8, A5: stops were answered at once and queued in the agent; killed, it
    took them with it. Each stop is a child of its own from the moment it comes."""
    running = Agent(tmp_path)
    names = [f"stop-{i}" for i in range(6)]
    fronts = [run_front(front, "poststop", b"", gpus.config, running.socket) for _ in names]
    for process, name in zip(fronts, names):
        process.stdin.write(stop_state(tmp_path / "bundles", name, 1 << 20))
        process.stdin.close()
    assert [process.wait(60) for process in fronts] == [0] * 6
    running.process.kill()
    running.process.wait(10)
    deadline = time.monotonic() + 30
    while {r.get("container") for r in log_records(gpus, "poststop")} < set(names):
        assert time.monotonic() < deadline, log_records(gpus, "poststop")
        time.sleep(0.1)


def _blocked_in_read(pid: int) -> bool:
    """`pid` sleeps in read(2) (x86-64 and arm64 number it 0 and 63): a spare waiting to be
    woken, a worker waiting for its order."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            number = f.read().split()[0]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state == "S" and number in ("0", "63")


def _children(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def children_once_idle(agent) -> list:
    """(pid, fds) of the agent's children once the requests' children have ended and the next
    spare is set up: one child, waiting to be woken, whose worker waits for its order. (The
    child counted while a stop's child was still ending, or a spare still setting up, made
    this test fail now and then.)"""
    deadline = time.monotonic() + 10
    while True:
        children = _children(agent.process.pid)
        if len(children) == 1 and _blocked_in_read(children[0]):
            workers = _children(children[0])
            if len(workers) == 1 and _blocked_in_read(workers[0]):
                break
        assert time.monotonic() < deadline, children
        time.sleep(0.01)
    return [(pid, sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))) for pid in children]


def test_a_spare_waits_holding_nothing_of_the_agents_but_its_channel(gpus, front, agent):
    """Requests go to a child forked ahead of time. It must hold no other request's fds: runc
    waits until its hook's stdout and stderr are closed by every process that has them, and
    a spare may wait for minutes."""
    result = gpus.run("before-spare", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                      edit=with_front(gpus, front, agent.socket))
    assert result.returncode == 0, result.stderr
    wait_for_record(gpus, "poststop", "before-spare")
    (spare, fds), = children_once_idle(agent)
    kinds = sorted(os.readlink(f"/proc/{spare}/fd/{fd}").split(":")[0] for fd in fds[3:])
    # Its channel, the pipe it waits on, and the two pipes of the worker it forked for a start.
    assert fds[:3] == [0, 1, 2] and kinds == ["pipe", "pipe", "pipe", "socket"], fds
    with open(f"/proc/{spare}/task/{spare}/children") as f:
        (worker,) = [int(pid) for pid in f.read().split()]
    kinds = sorted(os.readlink(f"/proc/{worker}/fd/{fd}").split(":")[0] for fd in os.listdir(f"/proc/{worker}/fd"))
    assert kinds == ["/dev/null"] * 3 + ["pipe", "pipe"], kinds


def test_a_stop_is_answered_before_its_work_and_done_after(gpus, front, agent):
    """runc's delete goes on once the agent holds the stop; the stop's work waits for the
    stops before it (here: the lock this test holds shared, which holds stops back and not
    starts) and then happens."""
    import fcntl

    lock = os.open(os.path.join(os.path.dirname(agent.socket), "stops.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        began = time.monotonic()
        result = gpus.run("held-stop", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                          edit=with_front(gpus, front, agent.socket))
        took = time.monotonic() - began
        assert result.returncode == 0, result.stderr
        assert took < agent_module.STOP_LOCK_WAIT / 2, took
        time.sleep(0.3)
        assert "held-stop" not in {r.get("container") for r in log_records(gpus, "poststop")}
    finally:
        os.close(lock)
    stop = wait_for_record(gpus, "poststop", "held-stop")
    assert stop["agent"] is True and stop["grants"] != "no cgroup grant recorded", stop


def test_a_stop_reading_a_huge_bundle_holds_the_next_start_only_briefly(gpus, front, agent, tmp_path):
    """Attacker pass 10, B1: a start waits for a stop still reading its bundle only
    STOP_READ_WAIT; the spare closed the channel that tells the agent so as soon as it took
    the request, and the start waited for the whole of that stop (up to STOP_WAIT): any
    container could hold back the next start by its own config.json."""
    start_behind_stop(gpus, front, agent, stop_state(tmp_path / "bundles", "huge", 8 << 20), "huge")  # 50 MB


def start_behind_stop(gpus, front, agent, state: bytes, name: str) -> None:
    """A stop of container `name`, answered; then a GPU start through the agent, which must be
    done while that stop still reads or parses its bundle; then the stop, carried out."""
    stop = run_front(front, "poststop", b"", gpus.config, agent.socket)
    stop.stdin.write(state)
    stop.stdin.close()
    assert stop.wait(60) == 0
    result = gpus.run(f"after-{name}", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                      edit=with_front(gpus, front, agent.socket, stages=("prestart",)))
    assert result.returncode == 0, result.stderr
    assert name not in {r.get("container") for r in log_records(gpus, "poststop")}  # still at its bundle
    (start,) = log_records(gpus, "prestart")
    assert start["agent"] is True
    wait_for_record(gpus, "poststop", name)


def hold_stops_lock(socket_path: str, seconds: float) -> float:
    """Hold stops.lock beside `socket_path` as a stop at its work does, for `seconds` from
    now (a thread lets it go); returns when it will be free."""
    import fcntl
    import threading

    os.makedirs(os.path.dirname(socket_path), mode=0o700, exist_ok=True)
    lock = os.open(os.path.join(os.path.dirname(socket_path), "stops.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    threading.Timer(seconds, os.close, (lock,)).start()
    return time.monotonic() + seconds


@pytest.mark.parametrize("served", ["a new agent", "no agent"])
def test_a_start_waits_for_a_stop_the_agent_serving_it_does_not_know(gpus, front, tmp_path, served):
    """Attacker pass 10, B2 and B3: a stop of an agent that ended (or restarted) is still at
    its work, or the agent declined the start (MAX_CHILDREN) and the Python hook ran it; the
    start did not wait for that stop. Every start now waits for stops.lock, which a stop at
    its work holds."""
    socket_path = f"{tmp_path}/agent/agent.sock"
    free_at = hold_stops_lock(socket_path, 1.0)
    running = Agent(tmp_path) if served == "a new agent" else None
    try:
        result = gpus.run("after-old-stop", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                          edit=with_front(gpus, front, socket_path, stages=("prestart",)))
        assert result.returncode == 0, result.stderr
        assert time.monotonic() >= free_at - 0.05
        (start,) = log_records(gpus, "prestart")
        assert start.get("agent") is (True if running else None), start
    finally:
        if running:
            assert running.stop() == 0


def test_a_stop_parsing_a_huge_config_holds_the_next_start_only_briefly(gpus, front, agent, tmp_path):
    """Attacker pass 11, B2: a config.json the prescan reads at once (one GPU request, then
    ~30 MB of mounts) but the full parser takes a second and more over: the stop parsed it
    for its log line's pod names while holding stops.lock, and every later start waited for
    it. It is parsed now while starts count the stop as reading its bundle."""
    bundle = tmp_path / "bundles" / "many-mounts"
    bundle.mkdir(parents=True)
    mount = '{"destination":"/m","type":"bind","source":"/tmp","options":["rbind"]}'
    with open(bundle / "config.json", "w") as f:
        f.write('{"ociVersion":"1.0.2","process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]},"root":{"path":"rootfs"},'
                '"mounts":[%s]}' % ",".join([mount] * 400000))
    state = json.dumps({"ociVersion": "1.0.2", "id": "many-mounts", "status": "stopped", "pid": 0,
                        "bundle": str(bundle)}).encode()
    start_behind_stop(gpus, front, agent, state, "many-mounts")


def with_timeout(gpus, front, socket_path, seconds: int):
    """Only a prestart hook, through the front, that the runtime kills past `seconds`."""
    edit = with_front(gpus, front, socket_path, stages=("prestart",))

    def short(spec):
        edit(spec)
        spec["hooks"]["prestart"][0]["timeout"] = seconds
    return short


GAVE_UP = "the runtime ended the hook before it was done (its timeout): gpuhook stopped"


def test_a_start_the_runtime_gave_up_on_ends_with_its_front(gpus, front, agent):
    """Attacker pass 11, B3: runc kills a hook past its `timeout`; the front died, but the
    agent's child went on (here: waiting for a stop at its work, then injecting GPUs) and held
    runc's pipes, so runc failed only seconds later, and a start it had given up on was
    carried out. The start now ends with its front: a failed record, nothing injected."""
    hold_stops_lock(agent.socket, 4.0)
    began = time.monotonic()
    result = gpus.run("given-up", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                      edit=with_timeout(gpus, front, agent.socket, 1))
    took = time.monotonic() - began
    assert result.returncode != 0 and "timeout" in result.stderr, result.stderr
    assert took < 3, took
    time.sleep(3.5)  # past the stop's lock: nothing of the start happens then
    (record,) = log_records(gpus, "prestart")
    assert record["decision"] == "failed" and record["error"] == GAVE_UP, record
    assert_rootfs_clean(result.rootfs)


def test_a_start_killed_by_the_runtime_mid_apply_takes_back_its_mounts(gpus, front, agent):
    """Attacker pass 12, A1: the agent killed the child of a start whose front died; the
    namespace worker died with it (its parent-death signal) and left its mounts, files and
    links in the rootfs. The child now ends as at its deadline: worker stopped, its journal
    taken back. Here the worker has done its steps and waits for the commit while the health
    step waits for NVML (4 s to initialise); runc gives up after 1 s."""
    simnvml.set_host(gpus.sim["nvml_state"], init_latency_ms=4000)
    gpus.configure(health={"mode": "always"})
    try:
        began = time.monotonic()
        result = gpus.run("killed-mid-apply", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False,
                          edit=with_timeout(gpus, front, agent.socket, 1))
        took = time.monotonic() - began
    finally:
        simnvml.set_host(gpus.sim["nvml_state"], init_latency_ms=0)
    assert result.returncode != 0 and "timeout" in result.stderr, result.stderr
    assert took < 3, took
    (record,) = [r for r in log_records(gpus, "prestart") if r.get("container") == "killed-mid-apply"]
    assert record["decision"] == "failed" and record["error"] == GAVE_UP, record
    assert_rootfs_clean(result.rootfs)


def test_requests_queued_when_the_agent_stops_are_answered_not_reset(tmp_path):
    """Attacker pass 11, B1: on SIGTERM the agent closed its listener with connections still in
    its backlog; their fronts had sent their request, and failed the start (exit 70). Those
    are served now (here: declined, `run`), and no new one can connect."""
    server = agent_module.Agent(str(tmp_path / "agent" / "agent.sock"))
    server.listen()
    clients = []
    for i in range(6):  # on both sockets: the stop socket's queue too
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(server.path if i % 2 else server.stop_path)
        client.send(agent_module.PROTOCOL + b"\0" + b"1\0nostage\0" + b"0\0")
        clients.append(client)
    server.stopping = True  # SIGTERM came before the loop took them
    server.serve()
    for client in clients:
        client.settimeout(5)
        assert client.recv(16) == b"run"
        client.close()
    assert not os.path.exists(server.path) and not os.path.exists(server.stop_path)


def test_serving_leaves_the_signal_handlers_as_they_were(tmp_path):
    """serve() handles SIGTERM to finish what was accepted; after it returns, SIGTERM means
    what it meant before. A handler left behind made pool workers forked later by the same
    process (the test run) ignore the pool's SIGTERM, and the run hung."""
    import signal as signal_module

    before = signal_module.getsignal(signal_module.SIGTERM), signal_module.getsignal(signal_module.SIGINT)
    server = agent_module.Agent(str(tmp_path / "agent" / "agent.sock"))
    server.listen()
    server.serve(until=lambda: True)
    assert (signal_module.getsignal(signal_module.SIGTERM), signal_module.getsignal(signal_module.SIGINT)) == before


def test_a_second_agent_on_the_same_socket_is_refused_and_leaves_the_first_serving(agent):
    """Newcomer run (helper-58): a second `gpuhook agent` on the same path took the running
    agent's socket files away (unlinked, bound anew) and removed them when it ended; the first
    agent went on listening on paths that no longer existed, and every start went to Python."""
    before = {path: os.stat(path).st_ino for path in (agent.socket, stoporder.stop_socket_path(agent.socket))}
    second = subprocess.run([sys.executable, "-m", "gpuhook", "agent", "--socket", agent.socket],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert "another agent listens on" in second.stderr
    assert {path: os.stat(path).st_ino for path in before} == before
    assert agent.process.poll() is None


def test_an_empty_socket_variable_is_refused(tmp_path):
    """The front reads an empty $GPUHOOK_AGENT_SOCKET as "never use an agent"; an agent started
    with it listened on the default path instead (newcomer run, helper-58)."""
    env = {**os.environ, agent_module.SOCKET_VARIABLE: ""}
    done = subprocess.run([sys.executable, "-m", "gpuhook", "agent"], capture_output=True, text=True, cwd=REPO,
                          timeout=60, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "is empty" in done.stderr


@pytest.mark.parametrize("how", ["--socket", "variable"])
def test_a_relative_socket_path_is_refused(tmp_path, how):
    """The front uses only an absolute socket path; an agent listening on a relative one served
    nothing, and said nothing of it (newcomer run, helper-58). It is one line, exit 2, and
    nothing is made."""
    env = {**os.environ}
    args = [sys.executable, "-m", "gpuhook", "agent"]
    if how == "--socket":
        args += ["--socket", "run/agent.sock"]
    else:
        env[agent_module.SOCKET_VARIABLE] = "run/agent.sock"
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "must be absolute" in done.stderr
    assert list(tmp_path.iterdir()) == []
