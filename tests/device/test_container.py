"""A real runc container through the hook on the real NVIDIA driver, as a GPU host runs one.

Three containers from one busybox image that also holds the host's C library and the CUDA
driver-API probe (tests/device/cudatest.c): with NVIDIA_VISIBLE_DEVICES=0 and the hook, the
container lists the GPU with `nvidia-smi -L` and the probe creates a context and allocates
64 MiB; with `none` it gets the driver's files but no GPU; without the hook it gets nothing.
Then the hook's latency: starts with and without it, figures written to
$GPUHOOK_DEVICE_FIGURES (tests/device/run-on-device.sh runs all of this in one go).

Read-only towards the GPU: the config's reset command does not exist and kill-orphans is off,
so nothing is killed or reset and persistence mode is never touched (tests/device/target.py).
Against a simulated host (GPUHOOK_DEVICE_SIMULATED) the same containers run; the simulated
driver has no CUDA, so there the probe stops after loading libcuda.so.1.
"""

import json
import os
import re
import statistics
import time

import pytest

from gpuhook import config as cfg
from gpuhook.discover import nvml
from helpers import testbed as runner

import target

pytestmark = pytest.mark.device

INSIDE = """
echo "nodes: $(ls /dev | grep -E '^nvidia[0-9]+$' | tr '\\n' ' ')"
nvidia-smi -L; echo "nvidia-smi -L rc=$?"
[ -n "$SIMULATED" ] && nvidia-smi
/usr/local/bin/cudatest; echo "cudatest rc=$?"
"""
GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


class Host:
    """The containers' host: config, runc testbed, image."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.config_path = target.config_path(f"{workdir}/conf")
        self.config = cfg.load(self.config_path, use_cache=False)
        self.bed = runner.Testbed(f"{workdir}/bed", runc=target.runc())
        probe = target.cudatest(workdir)
        self.image = f"{workdir}/image"
        files = {"/usr/local/bin/cudatest": probe}
        for path in target.glibc_files(probe):
            files[path] = path  # the host's own loader and C library, at their own paths
        os.makedirs(f"{self.image}/bin", exist_ok=True)
        import shutil

        shutil.copy2(target.busybox(), f"{self.image}/bin/busybox")
        for name in ("sh", "ls", "grep", "tr", "echo", "cat"):
            os.symlink("busybox", f"{self.image}/bin/{name}")
        for inside, source in files.items():
            os.makedirs(os.path.dirname(self.image + inside), exist_ok=True)
            shutil.copy2(source, self.image + inside)
        # A glibc image: the hook updates its ld cache with the driver's libraries.
        os.makedirs(f"{self.image}/etc", exist_ok=True)
        with open(f"{self.image}/etc/ld.so.conf", "w") as f:
            f.write("/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n/lib64\n/usr/lib64\n")
        with nvml.Session(nvml.library_path(self.config)) as session:
            self.gpu0 = session.gpu(0)

    def run(self, name: str, env, hooked: bool, script: str = INSIDE) -> runner.RunResult:
        import shutil

        rootfs = f"{self.workdir}/rootfs/{name}"
        shutil.copytree(self.image, rootfs, symlinks=True)
        hooks = {"prestart": [runner.hook_entry(self.config_path, "prestart")],
                 "poststop": [runner.hook_entry(self.config_path, "poststop")]} if hooked else None
        extra = ["SIMULATED=1"] if target.simulated() else []
        bundle = self.bed.bundle(name, ["/bin/sh", "-c", script], env=list(env) + extra, hooks=hooks, rootfs=rootfs)
        return self.bed.run(bundle, name, timeout=120)

    def log(self) -> list:
        try:
            with open(self.config.log_file) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    target.require_driver()
    return Host(str(tmp_path_factory.mktemp("device-containers")))


def nodes(result) -> list:
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("nodes:")]
    return line.split()[1:]


def test_a_gpu_container_through_the_hook_lists_its_gpu_and_runs_cuda(host):
    result = host.run("gpu", GPU_ENV, hooked=True)
    assert result.returncode == 0, result.stderr
    assert nodes(result) == [f"nvidia{host.gpu0.minor}"], result.stdout
    if target.simulated():
        assert "dlopen           libcuda.so.1 ok" in result.stdout, result.stdout
    else:
        # nvidia-smi -L: "GPU 0: NVIDIA H200 (UUID: GPU-...)"; the probe: a context and 64 MiB.
        assert re.search(rf"GPU 0: .*\(UUID: {re.escape(host.gpu0.uuid)}\)", result.stdout), result.stdout
        assert "nvidia-smi -L rc=0" in result.stdout
        assert "CUDATEST OK" in result.stdout and "cudatest rc=0" in result.stdout, result.stdout
    (record,) = [r for r in host.log() if r.get("container") == "gpu" and r.get("stage") in ("prestart",
                                                                                             "createRuntime")]
    assert record["decision"] == "gpus injected" and record["health"]["ok"] is True, record


def test_none_gets_the_driver_but_no_gpu(host):
    result = host.run("none", ["NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
                      hooked=True)
    assert result.returncode == 0, result.stderr
    assert nodes(result) == []
    assert host.gpu0.uuid not in result.stdout and "CUDATEST OK" not in result.stdout
    assert "nvidia-smi -L rc=127" not in result.stdout  # the driver's tools are there


def test_without_the_hook_a_container_gets_nothing(host):
    result = host.run("nohook", GPU_ENV, hooked=False)
    assert result.returncode == 0, result.stderr
    assert nodes(result) == [] and "nvidia-smi -L rc=127" in result.stdout  # no node, no tool
    assert "CUDATEST OK" not in result.stdout


def test_the_hooks_latency_is_measured(host):
    """Starts of one short container with and without the hook, interleaved; the figures go
    to $GPUHOOK_DEVICE_FIGURES. Every start must succeed; the times are not judged here
    (targets live in benchmarks/)."""
    rounds = int(os.environ.get("GPUHOOK_DEVICE_ROUNDS", "5"))
    walls = {"hook": [], "plain": []}
    for i in range(rounds):
        for kind in ("hook", "plain"):
            started = time.monotonic()
            result = host.run(f"lat-{kind}-{i}", GPU_ENV, hooked=kind == "hook", script="true")
            walls[kind].append(round(time.monotonic() - started, 4))
            assert result.returncode == 0, result.stderr
    records = [r for r in host.log() if str(r.get("container", "")).startswith("lat-hook-")]
    prestart = [r["seconds"] for r in records if r.get("stage") in ("prestart", "createRuntime")]
    poststop = [r["seconds"] for r in records if r.get("stage") == "poststop"]
    assert len(prestart) == rounds and len(poststop) == rounds
    figures = {
        "rounds": rounds, "wall_s": walls,
        "median_wall_hook_s": round(statistics.median(walls["hook"]), 4),
        "median_wall_plain_s": round(statistics.median(walls["plain"]), 4),
        "median_hook_prestart_s": round(statistics.median(prestart), 4),
        "median_hook_poststop_s": round(statistics.median(poststop), 4),
        "poststop_nvml": sorted({r.get("nvml", "?") for r in records if r.get("stage") == "poststop"}),
        "gpu": host.gpu0.model, "simulated": bool(target.simulated()),
    }
    print(json.dumps(figures))
    out = os.environ.get("GPUHOOK_DEVICE_FIGURES")
    if out:
        with open(out, "w") as f:
            json.dump(figures, f, indent=1)
