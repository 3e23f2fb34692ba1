"""The health daemon (`gpuhook plugin --standalone`, docs/health.md): on a host whose NVML
takes 1.5 s to load, a GPU start asks the daemon, which keeps NVML loaded, and loads no NVML
itself; without the daemon it does its own checks. Only a root-only socket is asked."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import GpuContainers, require_root_tools
from gpuhook import config as cfg
from gpuhook.health import daemon
from gpuhook.simulate import host as simhost

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory):
    require_root_tools("gcc", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("daemon") / "host"), gpus=2, seed="daemon",
                         nvml_init_latency_ms=1500)


def wait(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_start_asks_the_daemon_and_loads_no_nvml_and_falls_back_without_it(bed, slow_sim, probe, tmp_path):
    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    sock = f"{gpus.workdir}/run/health.sock"
    served = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--standalone", "--config", gpus.config],
                              cwd="/", stderr=subprocess.PIPE)
    try:
        assert wait(lambda: os.path.exists(sock)), served.stderr.read1(2000) if served.poll() is not None else ""
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        result = gpus.run("with-daemon", env=["NVIDIA_VISIBLE_DEVICES=1"])
        assert result.returncode == 0, result.stderr
        (record,) = gpus.log_lines()[-1:]
        assert record["container"] == "with-daemon"
        assert record["health"]["daemon"] == "prepared by the health daemon"
        assert record["health"]["skipped"] == {slow_sim["gpus"][1]["uuid"]: "prepared by the health daemon"}
        assert record["nvml"] == "not loaded"  # the 1.5 s NVML load happened in the daemon, not here
    finally:
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=15) == 0
    assert not os.path.exists(sock)
    result = gpus.run("without-daemon", env=["NVIDIA_VISIBLE_DEVICES=1"])
    assert result.returncode == 0, result.stderr
    record = gpus.log_lines()[-1]
    assert record["health"]["daemon"] == "no health daemon" and record["nvml"] == "loaded (1 init)"
    assert record["seconds"] >= 1.5  # the NVML load the daemon saved


def test_only_a_root_only_socket_is_asked(tmp_path):
    config = cfg.from_mapping({"state-dir": str(tmp_path / "run")})
    os.makedirs(tmp_path / "run", mode=0o700)
    path = daemon.socket_path(config)
    assert daemon.ask(config, ["GPU-a"], "c", 1.0) == ([], "no health daemon")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        os.chmod(path, 0o666)  # anyone could connect and, had they made it, answer "clean"
        assert daemon.ask(config, ["GPU-a"], "c", 1.0) == ([], "no health daemon")
        os.chmod(path, 0o600)
        os.chmod(tmp_path / "run", 0o777)
        assert daemon.ask(config, ["GPU-a"], "c", 1.0) == ([], "no health daemon")
        os.chmod(tmp_path / "run", 0o700)
        stamped, why = daemon.ask(config, ["GPU-a"], "c", 0.2)  # trusted but never answers
        assert stamped == [] and why.startswith("health daemon did not answer")
    finally:
        listener.close()


def start_daemon(config_path: str, sock: str) -> subprocess.Popen:
    served = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--standalone", "--config", config_path],
                              cwd="/", stderr=subprocess.PIPE)
    assert wait(lambda: os.path.exists(sock)), served.stderr.read1(2000) if served.poll() is not None else ""
    return served


def stop_daemon(served) -> None:
    served.send_signal(signal.SIGTERM)
    assert served.wait(timeout=15) == 0


def test_a_stop_that_needs_nvml_is_done_by_the_daemon_and_loads_none_itself(bed, slow_sim, probe, tmp_path):
    from gpuhook.simulate import nvml as simnvml
    from gpuhook.simulate import runner as testbed

    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    gpus.configure(health={"reset-on-release": True})
    served = start_daemon(gpus.config, f"{gpus.workdir}/run/health.sock")
    try:
        def both_hooks(spec):
            spec["hooks"]["poststop"] = [testbed.hook_entry(gpus.config, "poststop")]

        result = gpus.run("released", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=both_hooks)
        assert result.returncode == 0, result.stderr
        (record,) = [line for line in gpus.log_lines() if line.get("stage") == "poststop"]
        assert (record["decision"], record["daemon"]) == ("cleaned up", "cleaned up by the health daemon")
        assert record["nvml"] == "not loaded"  # the 1.5 s NVML load a stop would cost happened in the daemon
        assert [(a["action"], a["ok"]) for a in record["health"]["gpus"][0]["actions"]] == [("reset", True)]
        assert simnvml.load(slow_sim["nvml_state"])["gpus"][0]["reset_count"] >= 1
    finally:
        stop_daemon(served)


def test_a_reset_in_another_process_gets_the_daemon_to_close_its_nvml(bed, slow_sim, probe, tmp_path):
    from gpuhook.health import engine
    from gpuhook.simulate import nvml as simnvml

    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    served = start_daemon(gpus.config, f"{gpus.workdir}/run/health.sock")
    try:
        state = slow_sim["nvml_state"]
        before = simnvml.load(state)["gpus"][1]["reset_count"]
        simnvml.set_gpu(state, 1, ecc_volatile_uncorrected=1)
        (result,) = engine.prepare([slow_sim["gpus"][1]["uuid"]], cfg.load(gpus.config, use_cache=False)).gpus
        assert result.status is engine.Status.REPAIRED, result.failure()
        assert simnvml.load(state)["gpus"][1]["reset_count"] == before + 1
    finally:
        stop_daemon(served)
