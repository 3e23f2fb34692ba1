"""A corpus of malformed and hostile inputs fed to the hook exactly as a runtime would.

Every case must end with one line on stderr starting ``gpuhook:``, the documented exit code,
no traceback, and no change to the host: the mount table, the simulated host's files and the
bundle's rootfs are compared before and after. (Issue 7, item 3.)
"""

import json
import os
import subprocess
import pytest
from conftest import PRIVATE_VAR_LOG, host_mounts, run_hook_process, sim_config_values, write_config


GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0"]


def snapshot(*roots) -> list:
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                found.append((path, st.st_mode, st.st_size, st.st_mtime_ns))
    return sorted(found)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


from helpers.bad_inputs import CASES, Case  # noqa: E402  (the corpus, shared with tests/unit)


def test_config_json_without_any_request_marker_is_left_alone(world):
    run, _ = world
    for raw in (b"", b"garbage", b"[]"):
        done = run(Case("no marker", 0, "", raw_spec=raw))
        assert done.returncode == 0 and done.stderr == b""


@pytest.fixture
def world(tmp_path, sim_host):
    """A bundle and a config on the simulated host; returns a function that runs a case."""
    config = write_config(tmp_path / "config.toml", sim_config_values(sim_host, str(tmp_path / "gpuhook.log")))
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)

    def run(case: Case):
        spec = case.spec or {"root": {"path": "rootfs"}, "process": {"env": case.env if case.env is not None else GPU_ENV}}
        if case.setup == "config-dir":
            (bundle / "config.json").mkdir()
        elif case.setup == "config-fifo":
            os.mkfifo(bundle / "config.json")
        else:
            raw_spec = case.raw_spec if case.raw_spec is not None else json.dumps(spec).encode()
            (bundle / "config.json").write_bytes(raw_spec)
        state = {"ociVersion": "1.0.2", "id": "bad-input", "status": "creating", "pid": 1, "bundle": str(bundle)}
        for key, value in case.state.items():
            if value is ...:
                del state[key]
            else:
                state[key] = {"DEAD": dead_pid(), "SELF": os.getpid()}.get(value, value) if isinstance(value, str) else value
        raw_state = case.raw_state if case.raw_state is not None else json.dumps(state).encode()
        config_path = config
        if case.config == "MISSING":
            config_path = str(tmp_path / "missing.toml")
        elif case.config == "DRIVERLESS":
            config_path = write_config(tmp_path / "c2.toml", sim_config_values(sim_host, str(tmp_path / "l")),
                                       **{"driver-root": str(tmp_path)})
        elif case.config is not None:
            config_path = str(tmp_path / "c2.toml")
            data = case.config if isinstance(case.config, bytes) else case.config.encode()
            # What the hook writes goes under this test's own dir (never /run/gpuhook, /var/log).
            own = f'state-dir = "{tmp_path}/run"\nlog-file = "{tmp_path}/c2.log"\n'.encode()
            (tmp_path / "c2.toml").write_bytes(own + data)
        wrapper = PRIVATE_VAR_LOG if case.config is not None and case.config != "DRIVERLESS" else ()
        return run_hook_process(["prestart", "--config", config_path], raw_state, wrapper=wrapper)

    return run, bundle


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_bad_input_gets_one_line_the_right_code_and_no_host_change(world, sim_host, case):
    run, bundle = world
    before = (host_mounts(), snapshot(sim_host["directory"], bundle / "rootfs"))
    done = run(case)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == case.code, err
    assert err.count("\n") == 1 and err.startswith("gpuhook: "), err[:500]
    assert "Traceback" not in err and len(err) < 4096
    assert case.message in err, err[:500]
    assert (host_mounts(), snapshot(sim_host["directory"], bundle / "rootfs")) == before
