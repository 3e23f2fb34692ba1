"""GpuContainers for runtimes other than plain runc, sharing its probe script and checks.

Imported by the runtime tests as `helpers.runtimes` (tests/ is on sys.path through conftest).
"""

import json
import os
import subprocess
import sys
import time

from conftest import NODE_PATHS, GpuContainers

from gpuhook import testbed
from gpuhook.health import registry


class PodmanGpus(GpuContainers):
    """GpuContainers whose containers podman starts from a rootfs, with gpuhook registered
    only through the hooks.d file(s) in `hooks_dir`. The simulated host's config is
    self.config (GpuContainers writes it); the hooks.d file must point the hook at it."""

    def __init__(self, bed, sim, probe, workdir, hooks_dir):
        super().__init__(bed, sim, probe, workdir)
        self.podman = testbed.Podman(f"{self.workdir}/podman", hooks_dir)

    def run(self, name, env=(), annotations=None, before="", paths=(), rootfs_setup=None):
        """Start container `name` with podman; it runs `before` then probes NODE_PATHS + `paths`."""
        script = f"{before}\n/bin/probe " + " ".join(NODE_PATHS + list(paths))
        rootfs = self.bed.rootfs(f"{self.workdir}/rootfs/{name}", files={"/bin/probe": self.probe})
        if rootfs_setup is not None:
            rootfs_setup(rootfs)
        result = self.podman.run(rootfs, ["/bin/busybox", "sh", "-c", script], env=env, annotations=annotations)
        result.rootfs = rootfs
        return result


def gpuhook_cli(*args, python=None, env=None, check=True, timeout=120):
    """Run the gpuhook command (`python -m gpuhook ARGS`, this source tree) from /."""
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
    done = subprocess.run([python or sys.executable, "-m", "gpuhook", *args], capture_output=True, text=True,
                          env=run_env, timeout=timeout, cwd="/")
    if check and done.returncode != 0:
        raise AssertionError(f"gpuhook {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def read_json(path):
    with open(path) as f:
        return json.load(f)


def gpu_nodes(probes) -> set:
    """Paths of /dev/nvidiaN nodes that exist in the container."""
    return {p for p, item in probes.items() if p.startswith("/dev/nvidia") and p[11:].isdigit() and item["exists"]}


def other_gpu_node(minor: int) -> str:
    """Shell that makes a node for another GPU inside the container (opening it must give EPERM)."""
    return f"busybox mknod /dev/other-gpu c 195 {minor}"



def log_records(gpus, stage) -> list:
    """The hook's log records (GpuContainers.log_lines) of one stage."""
    return [line for line in gpus.log_lines() if line.get("stage") == stage]


def wait_for_record(gpus, stage, container, timeout=30) -> dict:
    """The log record of `stage` for `container` (its id), waiting up to `timeout` seconds for
    it: podman runs poststop hooks while it cleans up a stopped container, which conmon's
    `podman container cleanup` may also do; podman 4.3 has done it by the time `podman run
    --rm` returns, but the tests do not depend on which podman process runs the hook."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in log_records(gpus, stage) if line.get("container") == container]
        if found:
            (record,) = found
            return record
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {stage} record for container {container} in {gpus.log} after {timeout}s: "
                                 f"{gpus.log_lines()}")
        time.sleep(0.1)


def registered(gpus, container) -> bool:
    """Whether the health registry of `gpus` (the state-dir conftest.sim_config_values sets)
    holds `container`. The registry's directory must exist, so that a wrong path cannot pass
    for a registry the poststop hook emptied."""
    state_dir = f"{os.path.dirname(gpus.log)}/run"
    directory = os.path.dirname(registry.entry_path(state_dir, container))
    assert os.path.isdir(directory), f"no health registry at {directory}"
    return registry.load(state_dir, container) is not None
