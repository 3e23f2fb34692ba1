"""gpuhook acts only on the container being created, and only inside it.

- A state whose pid names a process that already pivoted into its root (a stale or wrong
  pid, or one of another running container) is refused: in that namespace "/sbin/ldconfig"
  or a host library path would be the image's files.
- A rootfs that is not the one mounted in the pid's namespace is refused.
- gpuhook never mounts into a shared mount: a mount made there would propagate to the
  host's mount table.
"""

import json
import os
import sys
import subprocess
import time

import pytest

from conftest import LIBDIR, REPO, host_mounts, run_hook_process

from helpers import testbed
from test_bad_input import snapshot

pytestmark = pytest.mark.root


def start_detached(gpus, name, script="sleep 60"):
    """A runc container left running (its init pivoted long ago); returns (pid, process)."""
    bundle = gpus.bed.bundle(name, ["/bin/busybox", "sh", "-c", script])
    proc = subprocess.Popen([gpus.bed.runc, "--root", gpus.bed.state_root, "run", "--bundle", bundle, name],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=testbed.RUN_ENV, cwd="/")
    for _ in range(200):
        done = subprocess.run([gpus.bed.runc, "--root", gpus.bed.state_root, "state", name],
                              capture_output=True, text=True, env=testbed.RUN_ENV)
        if done.returncode == 0 and json.loads(done.stdout)["status"] == "running":
            return json.loads(done.stdout)["pid"], proc
        time.sleep(0.05)
    raise AssertionError("the container did not start")


def gpu_bundle(gpus, name, tmp_path):
    bundle = tmp_path / name
    rootfs = bundle / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "ld.so.conf").write_text("")
    spec = gpus.bed.template()
    spec["root"] = {"path": str(rootfs)}
    spec["process"]["env"] = ["NVIDIA_VISIBLE_DEVICES=0"]
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


@pytest.mark.parametrize("whose", ["a running container's pid", "a running container's pid, its own bundle"])
def test_a_pid_that_already_pivoted_is_refused(gpus, tmp_path, whose):
    pid, proc = start_detached(gpus, "running")
    try:
        if whose == "a running container's pid":
            bundle = gpu_bundle(gpus, "other", tmp_path)
        else:
            bundle = f"{gpus.bed.workdir}/bundles/running"
            with open(f"{bundle}/config.json") as f:
                spec = json.load(f)
            spec["process"]["env"].append("NVIDIA_VISIBLE_DEVICES=0")
            with open(f"{bundle}/config.json", "w") as f:
                json.dump(spec, f)
        before = (host_mounts(), snapshot(str(bundle)))
        state = {"ociVersion": "1.0.2", "id": "wrong-pid", "status": "creating", "pid": pid, "bundle": str(bundle)}
        done = run_hook_process(["prestart", "--config", gpus.config], json.dumps(state).encode())
        assert done.returncode == 5, done.stderr
        assert b"already pivoted" in done.stderr
        assert (host_mounts(), snapshot(str(bundle))) == before
    finally:
        gpus.bed.delete("running")
        proc.wait(timeout=30)


def test_a_rootfs_that_is_not_the_containers_is_refused(gpus, tmp_path):
    """The state's pid is the container being created; the bundle it names plans against a
    directory that is not mounted as its root (what a parser differential with the runtime,
    or a wrong bundle, would cause)."""
    elsewhere = gpu_bundle(gpus, "elsewhere", tmp_path)
    config = str(elsewhere / "config.json")
    hook = {"path": "/bin/sh", "args": ["sh", "-c", f"{sys.executable} -I -S "
                                                    f"{REPO}/gpuhook/launch.py prestart "
                                                    f"--config {gpus.config} <&0 >/dev/null 2>{tmp_path}/err; "
                                                    f"echo $? > {tmp_path}/rc"]}

    def swap_bundle(spec):
        spec["hooks"] = {"prestart": [hook]}
    # The hook gets runc's real state (the real pid); we point its bundle elsewhere.
    hook["args"][2] = (f"sed 's#\"bundle\":\"[^\"]*\"#\"bundle\":\"{elsewhere}\"#' | " + hook["args"][2])
    before = (host_mounts(), snapshot(str(elsewhere)))
    gpus.run("identity", env=["NVIDIA_VISIBLE_DEVICES=0"], hook=False, edit=swap_bundle)
    assert (tmp_path / "rc").read_text().strip() == "5", (tmp_path / "err").read_text()
    assert "is not mounted in the container's namespace" in (tmp_path / "err").read_text()
    assert (host_mounts(), snapshot(str(elsewhere))) == before
    assert os.path.exists(config)


def test_nothing_is_mounted_into_a_shared_mount(gpus, tmp_path):
    """A library dir that is a bidirectional (rshared) volume: a mount made under it would
    appear in the host's mount table. The start is refused (the mount point would have to be
    made in the volume, which gpuhook never writes to); the host's table is unchanged.
    tests/integration/test_propagation.py has the shared mounts gpuhook would not write into."""
    shared = tmp_path / "shared-libs"
    shared.mkdir()
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True)
    subprocess.run(["mount", "--make-shared", str(shared)], check=True)
    try:
        before = host_mounts()
        volume = {"destination": LIBDIR, "type": "bind", "source": str(shared), "options": ["rbind", "rshared"]}
        result = gpus.run("shared", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=[volume])
        assert result.returncode != 0
        (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
        assert f"{LIBDIR}: lies on another mount than the container's rootfs" in line
        assert host_mounts() == before
        assert os.listdir(shared) == []
    finally:
        subprocess.run(["umount", "-l", str(shared)], check=False)
