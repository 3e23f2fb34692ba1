"""Throwaway runc containers with gpuhook registered: used by `gpuhook demo` and the tests.

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
import tempfile
import threading
import time

from gpuhook.errors import GpuhookError

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
RUN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class TestbedError(GpuhookError):
    exit_code = 2


class Result:
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
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
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
        if edit is not None:
            edit(spec)
        with open(f"{path}/config.json", "w") as f:
            json.dump(spec, f, indent=2)
        return path

    def run(self, bundle: str, container_id: str, timeout: float = 60, runc_args=()) -> Result:
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
        return Result(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

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


class Podman:
    """podman with storage of its own under `workdir`, starting containers from a rootfs.

    gpuhook is registered only through `hooks_dir` (podman's --hooks-dir replaces its default
    dirs), so a test decides exactly which hooks.d file runs. Flags as in the reference doc:
    cgroupfs and a file events backend (no systemd), no network, explicit ulimits. Call
    close() to remove the run root.
    """

    def __init__(self, workdir: str, hooks_dir: str, runtime: str = "runc", podman: str = "podman"):
        self.workdir = os.path.abspath(workdir)
        self.hooks_dir = hooks_dir
        self.runtime = shutil.which(runtime) or runtime
        self.podman = shutil.which(podman) or podman
        # podman refuses a run root path longer than 50 characters; a test's tmp dir is longer.
        self.runroot = tempfile.mkdtemp(prefix="gpuhook-podman-", dir="/tmp")

    def close(self, timeout: float = 15) -> None:
        """Unmount what podman left mounted in its storage and remove the run root, once no
        podman process uses them: conmon starts `podman container cleanup` after `podman run
        --rm` has returned, and a failed start leaves the overlay driver's home mounted."""
        needle = self.runroot.encode()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._users(needle):
            time.sleep(0.1)
        for root in (f"{self.workdir}/storage", self.runroot):
            with open("/proc/self/mountinfo") as f:
                points = [line.split()[4] for line in f]
            for point in sorted((p for p in points if p == root or p.startswith(root + "/")), reverse=True):
                subprocess.run(["umount", point], env=RUN_ENV, capture_output=True, timeout=30)
        shutil.rmtree(self.runroot, ignore_errors=True)

    def wait_until_idle(self, timeout: float = 15) -> bool:
        """Wait until no process (conmon, `podman container cleanup`) works on this podman's
        run root any more; False when some still does after `timeout` seconds. What podman does
        after `podman run --rm` returned, its poststop hooks included, is then over."""
        needle = self.runroot.encode()
        deadline = time.monotonic() + timeout
        while self._users(needle):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    @staticmethod
    def _users(needle: bytes) -> list:
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if needle in f.read():
                            found.append(int(pid))
                except OSError:
                    continue
        return found

    def argv(self, rootfs: str, args: list, env=(), annotations=None, cap_add=()) -> list:
        """The `podman run --rm` command line for one container."""
        argv = [self.podman, "--root", f"{self.workdir}/storage", "--runroot", self.runroot,
                "--tmpdir", f"{self.workdir}/tmp", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                "--runtime", self.runtime, "--hooks-dir", self.hooks_dir,
                "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        for cap in cap_add:
            argv += ["--cap-add", cap]
        for item in env:
            argv += ["--env", item]
        for key, value in (annotations or {}).items():
            argv += ["--annotation", f"{key}={value}"]
        return argv + ["--rootfs", rootfs, *args]

    def run(self, rootfs: str, args: list, env=(), annotations=None, cap_add=("MKNOD",),
            timeout: float = 120) -> Result:
        """Run one container to completion (podman removes it); `cap_add` defaults to MKNOD
        because tests make device nodes inside and podman's default set lacks it."""
        try:
            done = subprocess.run(self.argv(rootfs, args, env, annotations, cap_add), env=RUN_ENV,
                                  capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")
        except FileNotFoundError:
            raise TestbedError(f"{self.podman} is not installed (apt-get install podman)") from None
        except subprocess.TimeoutExpired:
            raise TestbedError(f"podman container did not finish within {timeout}s") from None
        return Result(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


class Containerd:
    """A containerd daemon of its own: config, root, state and sockets under `workdir`.

    The config's CRI section mirrors Debian's packaged /etc/containerd/config.toml (so
    `gpuhook install containerd` edits a realistic file); every path containerd would
    otherwise share with a system daemon (sockets, /opt/containerd) is private.
    """

    def __init__(self, workdir: str, containerd: str = "containerd", ctr: str = "ctr"):
        self.workdir = os.path.abspath(workdir)
        self.containerd = shutil.which(containerd) or containerd
        self.ctr_path = shutil.which(ctr) or ctr
        self.config_path = f"{self.workdir}/config.toml"
        self.address = f"{self.workdir}/containerd.sock"
        self.log_path = f"{self.workdir}/containerd.log"
        self._process = None
        os.makedirs(self.workdir, exist_ok=True)

    def default_config(self) -> str:
        """config.toml text (version 2) for this daemon."""
        w = self.workdir
        return (
            "version = 2\n"
            f'root = "{w}/root"\n'
            f'state = "{w}/state"\n\n'
            f'[grpc]\n  address = "{self.address}"\n\n'
            f'[ttrpc]\n  address = "{self.address}.ttrpc"\n\n'
            f'[debug]\n  address = "{w}/debug.sock"\n\n'
            "[plugins]\n"
            '  [plugins."io.containerd.grpc.v1.cri"]\n'
            '    [plugins."io.containerd.grpc.v1.cri".cni]\n'
            '      bin_dir = "/usr/lib/cni"\n'
            '      conf_dir = "/etc/cni/net.d"\n'
            '  [plugins."io.containerd.internal.v1.opt"]\n'
            f'    path = "{w}/opt"\n'
        )

    def write_config(self, text: str | None = None) -> str:
        with open(self.config_path, "w") as f:
            f.write(self.default_config() if text is None else text)
        return self.config_path

    def config_dump(self) -> str:
        """The effective configuration (`containerd config dump`) of the config file."""
        done = subprocess.run([self.containerd, "--config", self.config_path, "config", "dump"], env=RUN_ENV,
                              capture_output=True, timeout=60, stdin=subprocess.DEVNULL, cwd="/")
        if done.returncode != 0:
            raise TestbedError(f"containerd config dump failed: {done.stderr.decode(errors='replace').strip()}")
        return done.stdout.decode()

    def start(self, timeout: float = 30) -> None:
        """Start the daemon and wait until it answers on its socket."""
        log = open(self.log_path, "ab")
        try:
            self._process = subprocess.Popen([self.containerd, "--config", self.config_path], env=RUN_ENV,
                                             stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd="/")
        except FileNotFoundError:
            raise TestbedError(f"{self.containerd} is not installed (apt-get install containerd)") from None
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise TestbedError(f"containerd exited with {self._process.returncode}: {self._log_tail()}")
            if os.path.exists(self.address) and self.ctr("version").returncode == 0:
                return
            time.sleep(0.1)
        self.stop()
        raise TestbedError(f"containerd did not answer within {timeout}s: {self._log_tail()}")

    def stop(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL) and reap it; a no-op when not running."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=15)
        self._process = None

    def ctr(self, *args, timeout: float = 60) -> Result:
        """Run `ctr --address <our socket> ARGS`."""
        done = subprocess.run([self.ctr_path, "--address", self.address, *args], env=RUN_ENV,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")
        return Result(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def plugin_status(self, plugin_type: str, plugin_id: str) -> str:
        """A plugin's status as `ctr plugins ls` shows it (ok, error, skip)."""
        listing = self.ctr("plugins", "ls")
        for line in listing.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[0] == plugin_type and fields[1] == plugin_id:
                return fields[-1]
        raise TestbedError(f"plugin {plugin_type} {plugin_id} not listed: {listing.stderr.strip()}")

    def run(self, spec_path: str, container_id: str, timeout: float = 60) -> Result:
        """`ctr run --rm --config SPEC ID`: a container from a full spec (absolute root.path)."""
        try:
            return self.ctr("run", "--rm", "--config", spec_path, container_id, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.ctr("task", "kill", "--signal", "SIGKILL", container_id)
            self.ctr("container", "delete", container_id)
            raise TestbedError(f"container {container_id} did not finish within {timeout}s") from None

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-3:])
        except OSError:
            return "no log"
