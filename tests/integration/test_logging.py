"""The decision log an operator keeps (docs/logging.md): bounded lines, tagged, with the pod UID,
to a file and/or syslog, rotated by the packages' logrotate file."""

import json
import os
import socket
import subprocess
import pytest
from conftest import REPO, require, require_root_tools
from gpuhook import journal


K8S = {"io.kubernetes.pod.name": "trainer-0", "io.kubernetes.pod.namespace": "ml",
       "io.kubernetes.container.name": "main", "io.kubernetes.pod.uid": "6f1c0d7e-uid"}


@pytest.mark.root
def test_a_gpu_start_with_a_1_mib_annotation_logs_one_bounded_tagged_line_to_file_and_syslog(gpus, tmp_path):
    require_root_tools("runc")
    sock_path = str(tmp_path / "log.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(sock_path)
    server.settimeout(10)
    try:
        gpus.configure(**{"log-target": "both", "syslog-socket": sock_path})
        annotations = dict(K8S, **{"example.com/huge": "a" * (1 << 20)})
        result = gpus.run("bounded", env=["NVIDIA_VISIBLE_DEVICES=all"], annotations=annotations)
        assert result.returncode == 0, result.stderr
        message = server.recv(1 << 20)
    finally:
        server.close()
    with open(gpus.log, "rb") as f:
        (line,) = f.read().splitlines(keepends=True)
    assert len(line) <= journal.MAX_LINE_BYTES
    doc = json.loads(line)
    assert doc["tag"] == "gpuhook" and doc["pod_uid"] == "6f1c0d7e-uid" and doc["pod"] == "trainer-0"
    assert doc["decision"] == "gpus injected" and len(doc["gpus"]) == 4
    prefix, _, body = message.partition(b": ")
    assert prefix.startswith(b"<30>gpuhook[") and json.loads(body) == doc


@pytest.mark.root
def test_the_packaged_logrotate_file_rotates_the_log(tmp_path):
    require_root_tools()
    require(os.path.exists("/usr/sbin/logrotate"), "needs logrotate")
    with open(os.path.join(REPO, "packaging", "deb", "debian", "gpuhook.logrotate")) as f:
        text = f.read()
    log = tmp_path / "gpuhook.log"
    log.write_text('{"tag": "gpuhook"}\n')
    conf = tmp_path / "gpuhook.conf"
    conf.write_text(text.replace("/var/log/gpuhook.log", str(log)))
    os.chmod(tmp_path, 0o755)
    done = subprocess.run(["/usr/sbin/logrotate", "--force", "--state", str(tmp_path / "state"), str(conf)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gpuhook.log.1").read_text() == '{"tag": "gpuhook"}\n'
    assert log.exists() and log.stat().st_size == 0 and oct(log.stat().st_mode & 0o777) == "0o640"
