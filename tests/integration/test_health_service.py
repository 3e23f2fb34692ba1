"""The health daemon as the packages run it (packaging/systemd/gpuhook-health.service,
docs/packaging.md): its ExecStart tells systemd it is ready only once its socket listens, with
NVML loaded, and a GPU start then loads no NVML; without it, a start's log line says why it
was slow. Real runc, a simulated host whose NVML takes 1.5 s to load."""

import configparser
import os
import signal
import socket
import subprocess
import sys
import time
import pytest
from conftest import REPO, GpuContainers, require_root_tools
from gpuhook.simulate import host as simhost


pytestmark = pytest.mark.root


UNIT = os.path.join(REPO, "packaging", "systemd", "gpuhook-health.service")


INIT_MS = 1500


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory):
    require_root_tools("gcc", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("service") / "host"), gpus=2, seed="service",
                         nvml_init_latency_ms=INIT_MS)


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    with open(UNIT) as f:
        parser.read_file(f)
    return parser


def exec_start(config: str) -> list:
    """The unit's ExecStart with this checkout's gpuhook for /usr/bin/gpuhook, plus --config."""
    argv = unit()["Service"]["ExecStart"].split()
    assert argv[0] == "/usr/bin/gpuhook"
    return [sys.executable, "-m", "gpuhook", *argv[1:], "--config", config]


def test_the_daemon_says_ready_only_once_its_socket_listens_and_the_next_gpu_start_loads_no_nvml(
        bed, slow_sim, probe, tmp_path):
    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    health_sock = f"{gpus.workdir}/run/health.sock"
    notify_path = f"{tmp_path}/notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(30)
    started = time.monotonic()
    served = subprocess.Popen(exec_start(gpus.config), cwd="/", stderr=subprocess.PIPE,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NOTIFY_SOCKET": notify_path})
    try:
        message = notify.recv(4096)
        ready_after = time.monotonic() - started
        assert message == b"READY=1"
        assert os.path.exists(health_sock)  # listening when systemd is told
        assert ready_after >= INIT_MS / 1000  # after NVML loaded: the runtimes wait for it
        result = gpus.run("after-ready", env=["NVIDIA_VISIBLE_DEVICES=1"])
        assert result.returncode == 0, result.stderr
        record = gpus.log_lines()[-1]
        assert record["health"]["daemon"] == "prepared by the health daemon"
        assert record["nvml"] == "not loaded" and "nvml" not in record["health"]
    finally:
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=15) == 0, served.stderr.read().decode()[-2000:]
        notify.close()


def test_without_the_daemon_the_log_line_says_why_the_start_was_slow(bed, slow_sim, probe, tmp_path):
    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    result = gpus.run("no-daemon", env=["NVIDIA_VISIBLE_DEVICES=1"])
    assert result.returncode == 0, result.stderr
    record = gpus.log_lines()[-1]
    why = record["health"]["nvml"]
    assert why.startswith(f"no health daemon at {gpus.workdir}/run/health.sock: checked the GPUs in the hook, "
                          "loading NVML (")
    assert float(why.rsplit("(", 1)[1].split()[0]) >= INIT_MS / 1000
    assert record["nvml"] == "loaded (1 init)"


def test_with_checks_forced_on_every_start_the_log_line_names_the_mode(bed, slow_sim, probe, tmp_path):
    gpus = GpuContainers(bed, slow_sim, probe, tmp_path)
    gpus.configure(**{"health.mode": "always"})
    result = gpus.run("always", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    assert gpus.log_lines()[-1]["health"]["nvml"].startswith(
        "health.mode = always: checked the GPUs in the hook, loading NVML (")
