"""Throwaway runc containers with gpuhook registered: the runner of `gpuhook demo` and the tests.

It lives with the simulated host (gpuhook.simulate): the one home of the harness that runs
real containers against simulated GPUs; tests/conftest.py and tests/helpers/runtimes.py
build on it.

A testbed is a directory holding busybox root filesystems, OCI bundles (config.json from
`runc spec`, adjusted) and a private runc state root. Containers are real: runc creates the
namespaces and cgroups and runs gpuhook as a prestart hook exactly as it would in production,
with the interpreter flags the shipped hooks.d file uses.
"""

import json
import os
import shutil
import subprocess
import sys
import threading

from gpuhook.errors import InputError

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
RUN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class TestbedError(InputError):
    """The testbed could not be set up or a runc call failed."""


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


def find_busybox() -> str:
    for path in BUSYBOX_CANDIDATES:
        if os.path.exists(path):
            with open(path, "rb") as f:
                head = f.read(4096)
            if b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head:
                return path
    raise TestbedError("a static busybox is needed (apt-get install busybox-static)")


def hook_entry(config_path: str, stage: str = "prestart", python: str | None = None,
               timeout: int = 30) -> dict:
    """A runc hook entry that runs gpuhook the way hooks.d/gpuhook.json does."""
    launcher = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch.py")
    # sys.executable as is (not resolved), also as argv[0]: a venv's bin/python3 is how
    # Python finds the venv, and a bare "python3" argv[0] would be looked up in PATH instead.
    python = python or sys.executable
    return {
        "path": python,
        "args": [python, "-I", "-S", launcher, stage, "--config", config_path],
        "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        "timeout": timeout,
    }


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
            return self._read_template()

    def _read_template(self) -> dict:
        if self._template is None:
            tmp = f"{self.workdir}/.spec-template"
            os.makedirs(tmp, exist_ok=True)
            if not os.path.exists(f"{tmp}/config.json"):
                self._call([self.runc, "spec", "--bundle", tmp], "runc spec")
            with open(f"{tmp}/config.json") as f:
                self._template = json.load(f)
        return json.loads(json.dumps(self._template))

    def rootfs(self, path: str, files: dict | None = None) -> str:
        """A busybox root filesystem at `path`; `files` maps container paths to host files."""
        os.makedirs(f"{path}/bin", exist_ok=True)
        shutil.copy2(find_busybox(), f"{path}/bin/busybox")
        for name in ("sh", "ls", "cat"):
            link = f"{path}/bin/{name}"
            if not os.path.lexists(link):
                os.symlink("busybox", link)
        for target, source in (files or {}).items():
            dest = path + target
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(source, dest)
        return path

    def bundle(self, name: str, args: list, env=(), mounts=(), annotations=None, hooks=None,
               rootfs: str | None = None, privileged: bool = False, edit=None) -> str:
        """Write bundle `name` (config.json plus a busybox rootfs unless `rootfs` is given)."""
        path = f"{self.workdir}/bundles/{name}"
        os.makedirs(path, exist_ok=True)
        spec = self.template()
        spec["process"]["terminal"] = False
        spec["process"]["args"] = list(args)
        spec["process"]["env"] = spec["process"].get("env", []) + list(env)
        # Docker's default set has CAP_MKNOD (tests make device nodes inside); runc's lacks it.
        extra = {"CAP_MKNOD", "CAP_SYS_ADMIN"} if privileged else {"CAP_MKNOD"}
        caps = spec["process"]["capabilities"]
        for kind in ("bounding", "effective", "permitted"):
            caps[kind] = sorted(set(caps.get(kind, [])) | extra)
        spec["mounts"] = spec.get("mounts", []) + list(mounts)
        if annotations:
            spec["annotations"] = dict(annotations)
        if hooks:
            spec["hooks"] = hooks
        if rootfs is None:
            rootfs = self.rootfs(f"{path}/rootfs")
        spec["root"] = {"path": rootfs, "readonly": False}
        spec.setdefault("linux", {})["cgroupsPath"] = self.cgroup_path(name)
        if edit is not None:
            edit(spec)
        with open(f"{path}/config.json", "w") as f:
            json.dump(spec, f, indent=2)
        return path

    def cgroup_path(self, name: str) -> str:
        """The cgroupsPath bundle `name` gets (its edit may set another)."""
        return f"/{self.cgroup_prefix}-{name}"

    def run(self, bundle: str, container_id: str, timeout: float = 60, runc_args=()) -> RunResult:
        """`runc run` the bundle to completion; always deletes the container afterwards."""
        argv = [*self.wrapper, self.runc, "--root", self.state_root, *runc_args, "run", "--bundle", bundle,
                container_id]
        try:
            done = subprocess.run(argv, env=RUN_ENV, capture_output=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, cwd="/")
        except subprocess.TimeoutExpired:
            self.delete(container_id)
            raise TestbedError(f"container {container_id} did not finish within {timeout}s") from None
        finally:
            self.delete(container_id)
        return RunResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def delete(self, container_id: str) -> None:
        subprocess.run([*self.wrapper, self.runc, "--root", self.state_root, "delete", "--force", container_id],
                       env=RUN_ENV, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)

    def _call(self, argv, what):
        try:
            subprocess.run(argv, env=RUN_ENV, check=True, capture_output=True, timeout=60, cwd="/")
        except FileNotFoundError:
            raise TestbedError(f"{what}: {argv[0]} is not installed (apt-get install runc)") from None
        except subprocess.CalledProcessError as err:
            raise TestbedError(f"{what} failed: {err.stderr.decode(errors='replace').strip()}") from None
