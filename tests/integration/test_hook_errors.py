"""The hook as runc calls it, fed bad input: one line on stderr, the right exit code, no change."""

import json
import os
import subprocess

import pytest

from conftest import host_mounts, run_hook_process, sim_config_values, write_config


@pytest.fixture
def hook_env(tmp_path, sim_host):
    config = write_config(tmp_path / "config.toml", sim_config_values(sim_host, str(tmp_path / "log")))
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}
    (bundle / "config.json").write_text(json.dumps(spec))
    return config, bundle


def run(config, state) -> subprocess.CompletedProcess:
    raw = state if isinstance(state, bytes) else json.dumps(state).encode()
    return run_hook_process(["prestart", "--config", config], raw)


def one_line(done) -> str:
    err = done.stderr.decode()
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and err.startswith("gpuhook: ")
    return err


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("state,code,message", [
    (b"", 2, "state is empty"),
    (b"{", 2, "state is not valid JSON"),
    (b'{"id": "x"}', 2, "missing 'bundle'"),
    ({"id": "x", "bundle": "/nonexistent-bundle", "pid": 1}, 2, "has no config.json"),
    ("BUNDLE", 2, None),
])
def test_malformed_states(hook_env, state, code, message):
    config, bundle = hook_env
    if state == "BUNDLE":
        state = {"id": "x", "status": "running", "pid": 1, "bundle": str(bundle)}
        message = "status 'running'"
    done = run(config, state)
    assert done.returncode == code
    assert message in one_line(done)


def test_vanished_container_process(hook_env):
    config, bundle = hook_env
    pid = dead_pid()
    done = run(config, {"id": "x", "status": "creating", "pid": pid, "bundle": str(bundle)})
    assert done.returncode == 4
    assert f"container process {pid} is gone" in one_line(done)


def test_a_process_in_the_hooks_own_mount_namespace_is_refused(hook_env):
    config, bundle = hook_env
    before = host_mounts()
    done = run(config, {"id": "x", "status": "creating", "pid": os.getpid(), "bundle": str(bundle)})
    assert done.returncode == 4
    assert "shares the hook's mount namespace" in one_line(done)
    assert host_mounts() == before
    assert os.listdir(bundle / "rootfs") == []


def test_missing_pid_for_a_real_run(hook_env):
    config, bundle = hook_env
    done = run(config, {"id": "x", "status": "creating", "bundle": str(bundle)})
    assert done.returncode == 2
    assert "no container pid" in one_line(done)


def test_broken_config_file(hook_env, tmp_path):
    _, bundle = hook_env
    bad = tmp_path / "bad.toml"
    bad.write_text("driver-root = [\n")
    done = run(str(bad), {"id": "x", "status": "creating", "pid": 1, "bundle": str(bundle)})
    assert done.returncode == 2
    assert "invalid TOML" in one_line(done)


def test_errors_are_logged_too(hook_env, tmp_path):
    config, bundle = hook_env
    run(config, {"id": "bad-one", "status": "creating", "pid": dead_pid(), "bundle": str(bundle)})
    (line,) = [json.loads(x) for x in (tmp_path / "log").read_text().splitlines()]
    assert line["container"] == "bad-one" and line["decision"] == "failed" and "is gone" in line["error"]
