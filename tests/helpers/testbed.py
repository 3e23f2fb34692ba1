"""Throwaway runc containers with gpuhook registered: the tests' harness.

A testbed is a directory holding busybox root filesystems, OCI bundles (config.json from
`runc spec`, adjusted) and a private runc state root. It builds on what `gpuhook demo` ships
(gpuhook.simulate.demo: the busybox, bundle and hook rules) and adds what tests need: a
cgroup of the testbed's own per container, runc behind a wrapper (nsenter, unshare), bundles
made from threads, and the probe helper's output (tests/helpers/probe.c). tests/conftest.py
and tests/helpers/runtimes.py build on it.
"""

import json
import os
import shutil
import threading

from gpuhook.simulate import demo
from gpuhook.simulate.demo import RUN_ENV, find_busybox, hook_entry  # noqa: F401 (the tests' names)
from gpuhook.simulate.demo import RuncError as TestbedError  # noqa: F401


class RunResult:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    def probes(self) -> dict:
        """Lines printed by the probe helper (one JSON object each), keyed by path."""
        found = {}
        for line in self.stdout.splitlines():
            if line.startswith('{"path":'):
                item = json.loads(line)
                found[item["path"]] = item
        return found


class Testbed:
    def __init__(self, workdir: str, runc: str = "runc", wrapper=()):
        """`wrapper` is an argv prefix for every runc command that touches a container
        (run, delete), e.g. nsenter into the mount namespace where cgroup2 is mounted."""
        self.workdir = os.path.abspath(workdir)
        self.runc = shutil.which(runc) or runc
        self.wrapper = list(wrapper)
        self.state_root = f"{self.workdir}/runc-state"
        os.makedirs(self.state_root, exist_ok=True)
        # Each container's cgroup is this testbed's own (runc's default is /<id>, which two
        # test runs, or two demos, on one host would share): a leaf runc removes on delete.
        self.cgroup_prefix = f"gpuhook-{os.path.basename(self.workdir)[:40]}-{os.urandom(4).hex()}"
        self._template = None
        self._lock = threading.Lock()

    def template(self) -> dict:
        """runc's own default spec (`runc spec`), read once (tests start containers from threads)."""
        with self._lock:
            if self._template is None:
                self._template = demo.runc_spec(self.runc, f"{self.workdir}/.spec-template")
            return json.loads(json.dumps(self._template))

    def rootfs(self, path: str, files: dict | None = None) -> str:
        """A busybox root filesystem at `path`; `files` maps container paths to host files."""
        return demo.busybox_rootfs(path, files)

    def bundle(self, name: str, args: list, env=(), mounts=(), annotations=None, hooks=None,
               rootfs: str | None = None, privileged: bool = False, edit=None) -> str:
        """Write bundle `name` (config.json plus a busybox rootfs unless `rootfs` is given)."""
        return demo.write_bundle(f"{self.workdir}/bundles/{name}", self.template(), args, env, mounts, annotations,
                                 hooks, rootfs, privileged, self.cgroup_path(name), edit)

    def cgroup_path(self, name: str) -> str:
        """The cgroupsPath bundle `name` gets (its edit may set another)."""
        return f"/{self.cgroup_prefix}-{name}"

    def run(self, bundle: str, container_id: str, timeout: float = 60, runc_args=()) -> RunResult:
        """`runc run` the bundle to completion; always deletes the container afterwards."""
        return RunResult(*demo.run(self.runc, self.state_root, bundle, container_id, timeout, self.wrapper,
                                   runc_args))

    def delete(self, container_id: str) -> None:
        demo.delete(self.runc, self.state_root, container_id, self.wrapper)
