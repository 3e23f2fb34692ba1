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
