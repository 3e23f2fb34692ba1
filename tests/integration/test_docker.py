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
IMAGE_ALL = "gpuhook-busybox-all:test"


class Dockerd:
    """A dockerd of its own; `docker(...)` runs the matching client against it."""

    def __init__(self, bin_dir: str, root: str):
        """`root`: a directory of its own (short, for the socket path); `root`/data is the data root."""
        self.root = root
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
    root = tempfile.mkdtemp(prefix="gpuhook-docker-", dir="/tmp")  # socket paths stay short
    gpuhook_cli("install", "docker", "--bin-dir", str(bin_dir), "--config", config, "--data-root", f"{root}/data")
    daemon = Dockerd(str(bin_dir), root)
    try:
        image = work / "busybox.tar"
        with tarfile.open(image, "w") as tar:
            tar.add("/bin/busybox", "bin/busybox")
            tar.add(probe, "bin/probe")
        with open(image, "rb") as f:
            daemon.docker("import", "-", IMAGE, stdin=f.read())
        with open(image, "rb") as f:  # an image that asks for every GPU itself
            daemon.docker("import", "--change", "ENV NVIDIA_VISIBLE_DEVICES=all", "-", IMAGE_ALL, stdin=f.read())
        daemon.sim, daemon.gpuhook_log, daemon.state_dir = sim_host, work / "gpuhook.log", str(work / "run")
        yield daemon
    finally:
        daemon.stop()


def run(docker, *flags, image=IMAGE) -> dict:
    sim = docker.sim
    mknod = f"/bin/busybox mknod /dev/gpu0-by-hand c {sim['majors']['nvidia']} {sim['gpus'][0]['minor']}"
    done = docker.docker("run", "--rm", "--network", "none", *flags, image, "/bin/busybox", "sh", "-c",
                         f"{mknod}; /bin/probe /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 /dev/nvidia3 /dev/gpu0-by-hand")
    return {p["path"]: p for p in map(json.loads, done.stdout.decode().splitlines())}


def log_records(docker) -> list:
    text = docker.gpuhook_log.read_text() if docker.gpuhook_log.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


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
    before = len(log_records(docker))
    probes = run(docker, "-e", "NVIDIA_VISIBLE_DEVICES=all")
    assert present(probes) == set() and probes["/dev/gpu0-by-hand"]["read"] == "EPERM"
    # Docker registered no hook: gpuhook never ran (poststops of earlier tests' containers may come)
    assert [r for r in log_records(docker)[before:] if r["stage"] != "poststop"] == []


@pytest.mark.parametrize("flag", ["0", "count=0"])
def test_gpus_0_gives_nothing_even_when_the_image_says_all(docker, flag):
    """dockerd registers the hook for --gpus 0 but appends no NVIDIA_VISIBLE_DEVICES, so the
    image's `all` was the only value there: only the daemon's request counts."""
    before = len(log_records(docker))
    probes = run(docker, "--gpus", flag, image=IMAGE_ALL)
    assert present(probes) == set() and probes["/dev/gpu0-by-hand"]["read"] == "EPERM"
    (start,) = [r for r in log_records(docker)[before:] if r["stage"] == "prestart"]
    assert start["decision"] == "untouched" and start["gpus"] == []


def test_gpus_device_1_on_an_image_that_says_all_gives_gpu_1_only(docker):
    probes = run(docker, "--gpus", "device=1", image=IMAGE_ALL)
    assert present(probes) == {"/dev/nvidia1"} and probes["/dev/gpu0-by-hand"]["read"] == "EPERM"


def test_a_gpu_container_is_cleaned_up_after_it_stops_though_dockerd_registers_no_poststop(docker):
    from gpuhook.health import registry

    before = len(log_records(docker))
    probes = run(docker, "--gpus", "device=2")
    assert present(probes) == {"/dev/nvidia2"}
    (start,) = [r for r in log_records(docker)[before:] if r["stage"] == "prestart"]
    assert start["decision"] == "gpus injected" and isinstance(start["registered"], dict)
    deadline = time.monotonic() + 30
    stops = lambda: [r for r in log_records(docker)[before:]  # noqa: E731
                     if r["stage"] == "poststop" and r["container"] == start["container"]]
    while not stops():
        assert time.monotonic() < deadline, log_records(docker)[before:]
        time.sleep(0.2)
    (stop,) = stops()
    assert stop["container"] == start["container"] and stop["decision"] == "cleaned up", stop
    assert registry.load(docker.state_dir, start["container"]) is None


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
