"""Docker's `--gpus` runs gpuhook (docs/docker.md): a real dockerd (Debian's docker.io) on a
private socket, data root and exec root, vfs storage and no network set-up, running an image
imported from a busybox tarball, with the launcher `gpuhook install docker` wrote on its PATH.

--gpus device=1 gives GPU 1 only (a GPU 0 node made inside gives EPERM), --gpus all gives
all, and no flag gives nothing even when the image says NVIDIA_VISIBLE_DEVICES=all.
"""

import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time

import pytest

from conftest import require_root_tools, sim_config_values, write_config
from helpers.runtimes import gpuhook_cli

pytestmark = pytest.mark.root

IMAGE = "gpuhook-busybox:test"


class Dockerd:
    """A dockerd of its own; `docker(...)` runs the matching client against it."""

    def __init__(self, bin_dir: str):
        self.root = tempfile.mkdtemp(prefix="gpuhook-docker-", dir="/tmp")  # socket paths stay short
        self.socket = f"{self.root}/docker.sock"
        env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}
        self.log = open(f"{self.root}/dockerd.log", "wb")
        self.process = subprocess.Popen(
            ["dockerd", "--host", f"unix://{self.socket}", "--data-root", f"{self.root}/data",
             "--exec-root", f"{self.root}/exec", "--pidfile", f"{self.root}/docker.pid", "--storage-driver", "vfs",
             "--iptables=false", "--ip6tables=false", "--bridge", "none", "--ip-masq=false", "--ip-forward=false"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while self.docker("version", check=False).returncode != 0:
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise AssertionError("dockerd did not start: " + open(f"{self.root}/dockerd.log").read()[-2000:])
            time.sleep(0.2)

    def docker(self, *args, check=True, stdin=None, timeout=120) -> subprocess.CompletedProcess:
        done = subprocess.run(["/usr/bin/docker", "-H", f"unix://{self.socket}", *args], input=stdin,
                              capture_output=True, timeout=timeout)
        if check:
            assert done.returncode == 0, done.stderr.decode(errors="replace")
        return done

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4] for line in f]
        for point in sorted((p for p in points if p.startswith(self.root + "/")), reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def docker(sim_host, probe, tmp_path_factory):
    require_root_tools("dockerd")
    work = tmp_path_factory.mktemp("docker")
    config = write_config(str(work / "config.toml"), sim_config_values(sim_host, str(work / "gpuhook.log")))
    bin_dir = work / "bin"
    gpuhook_cli("install", "docker", "--bin-dir", str(bin_dir), "--config", config)
    daemon = Dockerd(str(bin_dir))
    try:
        image = work / "busybox.tar"
        with tarfile.open(image, "w") as tar:
            tar.add("/bin/busybox", "bin/busybox")
            tar.add(probe, "bin/probe")
        with open(image, "rb") as f:
            daemon.docker("import", "-", IMAGE, stdin=f.read())
        daemon.sim, daemon.gpuhook_log = sim_host, work / "gpuhook.log"
        yield daemon
    finally:
        daemon.stop()


def run(docker, *flags) -> dict:
    sim = docker.sim
    mknod = f"/bin/busybox mknod /dev/gpu0-by-hand c {sim['majors']['nvidia']} {sim['gpus'][0]['minor']}"
    done = docker.docker("run", "--rm", "--network", "none", *flags, IMAGE, "/bin/busybox", "sh", "-c",
                         f"{mknod}; /bin/probe /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 /dev/nvidia3 /dev/gpu0-by-hand")
    return {p["path"]: p for p in map(json.loads, done.stdout.decode().splitlines())}


def present(probes) -> set:
    return {path for path, p in probes.items() if path[11:].isdigit() and p["exists"]}


def test_gpus_device_1_gives_gpu_1_only(docker):
    probes = run(docker, "--gpus", "device=1")
    assert present(probes) == {"/dev/nvidia1"} and probes["/dev/nvidia1"]["read"] == "ENXIO"
    assert probes["/dev/gpu0-by-hand"]["read"] == "EPERM"


def test_gpus_all_gives_all(docker):
    probes = run(docker, "--gpus", "all")
    assert present(probes) == {f"/dev/nvidia{i}" for i in range(4)}
    assert all(probes[f"/dev/nvidia{i}"]["read"] == "ENXIO" for i in range(4))


def test_no_flag_gives_nothing_whatever_the_image_says(docker):
    before = docker.gpuhook_log.read_text() if docker.gpuhook_log.exists() else ""
    probes = run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=all")
    assert present(probes) == set() and probes["/dev/gpu0-by-hand"]["read"] == "EPERM"
    after = docker.gpuhook_log.read_text() if docker.gpuhook_log.exists() else ""
    assert after == before  # Docker registered no hook: gpuhook never ran


def test_install_docker_keeps_a_foreign_hook_and_uninstall_restores_it(tmp_path, sim_host):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    theirs = bin_dir / "nvidia-container-runtime-hook"
    theirs.write_text("#!/bin/sh\n# NVIDIA's\n")
    os.chmod(theirs, 0o755)
    gpuhook_cli("install", "docker", "--bin-dir", str(bin_dir), "--config", sim_host["config"])
    assert "gpuhook install docker" in theirs.read_text() and os.stat(theirs).st_mode & 0o777 == 0o755
    assert (bin_dir / "nvidia-container-runtime-hook.gpuhook-bak").read_text() == "#!/bin/sh\n# NVIDIA's\n"
    gpuhook_cli("uninstall", "docker", "--bin-dir", str(bin_dir))
    assert theirs.read_text() == "#!/bin/sh\n# NVIDIA's\n" and sorted(os.listdir(bin_dir)) == [theirs.name]
    fresh = tmp_path / "fresh"
    gpuhook_cli("install", "docker", "--bin-dir", str(fresh), "--config", sim_host["config"])
    assert os.stat(fresh / "nvidia-container-runtime-hook").st_mode & 0o777 == 0o755
    done = subprocess.run([str(fresh / "nvidia-container-runtime-hook"), "bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown stage 'bogus'" in done.stderr
    gpuhook_cli("uninstall", "docker", "--bin-dir", str(fresh))
    assert os.listdir(fresh) == []
