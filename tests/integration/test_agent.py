"""The agent (gpuhook.agent, docs/agent.md) behind the native front, in real runc starts on
the simulated host: it serves GPU starts and stops as the Python hook would, with the front's
fds, exit status and cgroup; it serves nothing outside its namespaces; without it the front
runs the Python hook."""

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, GpuContainers, require, require_root_tools
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
    st = os.stat(agent.socket)
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    parent = os.stat(os.path.dirname(agent.socket))
    assert parent.st_uid == 0 and parent.st_mode & 0o777 == 0o700
