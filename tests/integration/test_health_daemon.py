"""The health daemon (`gpuhook plugin --standalone`, docs/health.md): on a host whose NVML
takes 1.5 s to load, a GPU start asks the daemon, which keeps NVML loaded, and loads no NVML
itself; without the daemon it does its own checks. Only a root-only socket is asked."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import pytest
from conftest import GpuContainers, gpus_denied_parent, require_root_tools
from gpuhook import config as cfg
from gpuhook.health import daemon
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml


pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory):
    require_root_tools("gcc", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("daemon") / "host"), gpus=2, seed="daemon",
                         nvml_init_latency_ms=1500)


@pytest.fixture
def pristine(slow_sim):
    """The module's host, put back as it was after the test (these tests slow and break GPUs)."""
    saved = simnvml.load(slow_sim["nvml_state"])
    yield slow_sim
    simnvml.save(slow_sim["nvml_state"], saved)


@contextlib.contextmanager
def standalone_daemon(gpus):
    """`gpuhook plugin --standalone` for `gpus` (GpuContainers), until SIGTERM; yields its socket."""
    sock = f"{gpus.workdir}/run/health.sock"
    served = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--standalone", "--config", gpus.config],
                              cwd="/", stderr=subprocess.PIPE)
    try:
        assert wait(lambda: os.path.exists(sock)), served.stderr.read1(2000) if served.poll() is not None else ""
        yield sock
    finally:
        served.send_signal(signal.SIGTERM)
        assert served.wait(timeout=15) == 0


def connect(path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    return client


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


def test_an_answer_the_hook_stopped_waiting_for_lets_no_later_start_skip_its_checks(bed, pristine, probe, tmp_path):
    gpus = GpuContainers(bed, pristine, probe, tmp_path)
    state, uuid = pristine["nvml_state"], gpus.uuid(1)
    with standalone_daemon(gpus):
        # A start asks for GPU 1 and gives up before the daemon is done (checking it takes 0.8 s).
        simnvml.set_gpu(state, 1, handle_latency_ms=800)
        config = cfg.load(gpus.config, {})
        prepared, why = daemon.ask_start(config, [uuid], "gave-up", 0.2).answer()
        assert prepared == [], why
        time.sleep(1.5)  # the daemon's work, whatever it is, is over
        # GPU 1 breaks; the next start on it must not ride on the answer nobody took.
        simnvml.set_gpu(state, 1, handle_latency_ms=0, ecc_volatile_uncorrected=1)
        result = gpus.run("later", env=["NVIDIA_VISIBLE_DEVICES=1"])
        assert result.returncode == 0, result.stderr
        record = gpus.log_lines()[-1]
        assert record["container"] == "later"
        assert record["health"].get("skipped", {}).get(uuid) in (None, "prepared by the health daemon")
        assert simnvml.load(state)["gpus"][1]["reset_count"] == 1  # checked and repaired for this start
        assert not os.path.exists(f"{gpus.workdir}/run/health/stamps")  # the daemon leaves none


def test_a_request_that_trickles_in_is_cut_off_at_its_deadline(bed, pristine, probe, tmp_path):
    gpus = GpuContainers(bed, pristine, probe, tmp_path)
    with standalone_daemon(gpus) as path:
        client = connect(path)
        client.setblocking(False)
        started, closed_after = time.monotonic(), None
        request = b'{"op": "prepare", "gpus": ["' + pristine["gpus"][0]["uuid"].encode() + b'"]}'
        for byte in request:  # one byte every half second: each recv alone is quick
            try:
                client.send(bytes([byte]))
                if client.recv(4096) == b"":
                    closed_after = time.monotonic() - started
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_after = time.monotonic() - started
                break
            if time.monotonic() - started > 10:
                break
            time.sleep(0.5)
        client.close()
    # The daemon gives a whole request 2 s; a client dribbling a byte at a time gets no more.
    assert closed_after is not None and closed_after < 8, closed_after


def test_one_client_cannot_hold_every_connection_and_a_start_still_gets_its_answer(bed, pristine, probe, tmp_path):
    gpus = GpuContainers(bed, pristine, probe, tmp_path)
    with standalone_daemon(gpus) as path:
        held = [connect(path) for _ in range(12)]  # one process, saying nothing
        try:
            time.sleep(0.5)
            refused = []
            for client in held:
                client.settimeout(0.2)
                try:
                    answer = client.recv(4096)
                except TimeoutError:
                    continue
                refused.append(json.loads(answer))
            # Four are served (and wait for their request), the others are told at once.
            assert refused == [{"ok": False, "prepared": [], "error": "health daemon busy"}] * 8
            result = gpus.run("served", env=["NVIDIA_VISIBLE_DEVICES=0"])
            assert result.returncode == 0, result.stderr
            assert gpus.log_lines()[-1]["health"]["daemon"] == "prepared by the health daemon"
        finally:
            for client in held:
                client.close()


@pytest.mark.parametrize("gpus_asked", [["GPU-00000000-dead-beef-0000-000000000000"], "all of them, 2000 times"])
def test_gpus_this_host_does_not_have_are_refused_without_any_work(bed, pristine, probe, tmp_path, gpus_asked):
    gpus = GpuContainers(bed, pristine, probe, tmp_path)
    if gpus_asked == "all of them, 2000 times":
        gpus_asked = [g["uuid"] for g in pristine["gpus"]] * 1000
    with standalone_daemon(gpus) as path:
        client = connect(path)
        client.settimeout(10)
        client.sendall((json.dumps({"op": "prepare", "gpus": gpus_asked, "seconds": 2}) + "\n").encode())
        answer = client.recv(65536)
        client.close()
    # No check ran: no lock, report or stamp for any GPU, real or made up.
    health = f"{gpus.workdir}/run/health"
    # (nvml.lock is the daemon's own, made when it opened NVML at its start.)
    assert not os.path.exists(health) or [name for _, _, files in os.walk(health) for name in files
                                          if name != "nvml.lock"] == []
    answer = json.loads(answer)
    assert answer["ok"] is False and answer["prepared"] == []
    assert answer["error"] in ("not a GPU of this host", "not one request line of at most 8192 bytes")


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
    from helpers import testbed

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


def test_a_start_whose_grant_fails_after_it_asked_the_daemon_says_so(bed, pristine, probe, tmp_path):
    """Attacker pass 25: the hook asks the daemon before it grants the cgroup rules. A pod
    whose cgroupsPath sits under a parent that denies the GPUs fails its grant after the
    daemon was asked: the start fails as before, and its log line says the daemon was asked
    (the daemon may have cleaned or reset the GPU for it; the daemon's own line says what it
    did) instead of nothing."""
    gpus = GpuContainers(bed, pristine, probe, tmp_path)
    with gpus_denied_parent("gpuhook-asked", "asked") as under_parent, standalone_daemon(gpus):
        result = gpus.run("asked", env=["NVIDIA_VISIBLE_DEVICES=1"], edit=under_parent)
    assert result.returncode != 0 and "cgroup: cannot allow" in result.stderr
    record = gpus.log_lines()[-1]
    assert record["container"] == "asked" and record["decision"] == "failed"
    assert record["health"]["daemon"].startswith("asked to prepare the GPUs; the start failed"), record
