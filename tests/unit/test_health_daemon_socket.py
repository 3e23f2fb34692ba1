"""The health daemon (`gpuhook plugin --standalone`, docs/health.md): on a host whose NVML.

The tests of it that need no root; those that do are in tests/integration/test_health_daemon.py.
"""

import os
import socket
import subprocess
import sys
from gpuhook import config as cfg
from gpuhook.health import daemon


def test_only_a_root_only_socket_is_asked(tmp_path):
    config = cfg.from_mapping({"state-dir": str(tmp_path / "run")})
    os.makedirs(tmp_path / "run", mode=0o700)
    path = daemon.socket_path(config)
    assert daemon.ask_start(config, ["GPU-a"], "c", 1.0).answer() == ([], "no health daemon")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        os.chmod(path, 0o666)  # anyone could connect and, had they made it, answer "clean"
        assert daemon.ask_start(config, ["GPU-a"], "c", 1.0).answer() == ([], "no health daemon")
        os.chmod(path, 0o600)
        os.chmod(tmp_path / "run", 0o777)
        assert daemon.ask_start(config, ["GPU-a"], "c", 1.0).answer() == ([], "no health daemon")
        os.chmod(tmp_path / "run", 0o700)
        stamped, why = daemon.ask_start(config, ["GPU-a"], "c", 0.2).answer()  # trusted but never answers
        assert stamped == [] and why.startswith("health daemon did not answer")
    finally:
        listener.close()


def test_a_socket_directory_others_can_write_is_refused_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # anyone could put their own socket there and answer "clean"
    config = tmp_path / "config.toml"
    config.write_text(f'state-dir = "{tmp_path}/run"\nlog-file = "{tmp_path}/log"\n'
                      f'[health]\ndaemon-socket = "{shared}/health.sock"\n')
    done = subprocess.run([sys.executable, "-m", "gpuhook", "plugin", "--standalone", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 4
    assert done.stderr == (f"gpuhook: the health daemon's socket directory {shared} is not usable: not a directory "
                           "owned by root and writable only by it\n")
    assert os.listdir(shared) == []


def test_the_request_goes_out_when_asked_and_the_answer_is_read_later(tmp_path):
    """The hook asks the daemon before it grants the cgroup rules and reads the answer after
    (gpuhook.apply.run: the daemon prepares the GPUs meanwhile): `ask_start` returns once the
    request is out, before any answer; `answer` reads it; `close` gives it up."""
    config = cfg.from_mapping({"state-dir": str(tmp_path / "run")})
    os.makedirs(tmp_path / "run", mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(daemon.socket_path(config))
    os.chmod(daemon.socket_path(config), 0o600)
    listener.listen(2)
    try:
        asked = daemon.ask_start(config, ["GPU-a", "GPU-b"], "c1", 2.0)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2)
            request = conn.recv(4096)  # already there: nothing was answered yet
            assert b'"op":"prepare"' in request and b'"GPU-a"' in request and b'"c1"' in request
            conn.sendall(b'{"ok": true, "prepared": ["GPU-b", "GPU-x"]}\n')
            assert asked.answer() == (["GPU-b"], "prepared by the health daemon")
        given_up = daemon.ask_start(config, ["GPU-a"], "c2", 2.0)
        conn, _ = listener.accept()
        with conn:
            given_up.close()
            conn.settimeout(2)
            conn.recv(4096)
            assert conn.recv(4096) == b""  # the asker hung up: nobody reads an answer
        assert given_up.answer() == ([], "")
    finally:
        listener.close()
