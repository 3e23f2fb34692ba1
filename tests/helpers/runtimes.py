"""GpuContainers for runtimes other than plain runc, sharing its probe script and checks.

Imported by the runtime tests as `helpers.runtimes` (tests/ is on sys.path through conftest).
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from conftest import NODE_PATHS, GpuContainers

from gpuhook.health import registry
from helpers.testbed import RUN_ENV, RunResult, TestbedError


class PodmanGpus(GpuContainers):
    """GpuContainers whose containers podman starts from a rootfs, with gpuhook registered
    only through the hooks.d file(s) in `hooks_dir`. The simulated host's config is
    self.config (GpuContainers writes it); the hooks.d file must point the hook at it."""

    def __init__(self, bed, sim, probe, workdir, hooks_dir):
        super().__init__(bed, sim, probe, workdir)
        self.podman = Podman(f"{self.workdir}/podman", hooks_dir)

    def run(self, name, env=(), annotations=None, before="", paths=(), rootfs_setup=None, devices=(),
            image_annotations=None):
        """Start container `name` with podman; it runs `before` then probes NODE_PATHS + `paths`.
        `devices` are podman --device values (HOST[:CONTAINER[:PERMISSIONS]]). With
        `image_annotations`, the container starts from an image of its rootfs whose manifest
        carries them (its files then live in podman's storage, not at result.rootfs)."""
        script = f"{before}\n/bin/probe " + " ".join(NODE_PATHS + list(paths))
        rootfs = self.bed.rootfs(f"{self.workdir}/rootfs/{name}", files={"/bin/probe": self.probe})
        if rootfs_setup is not None:
            rootfs_setup(rootfs)
        image = None if image_annotations is None else self.podman.image(rootfs, image_annotations)
        result = self.podman.run(rootfs, ["/bin/busybox", "sh", "-c", script], env=env, annotations=annotations,
                                 devices=devices, image=image)
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



def runtime_node(path: str, major: int, minor: int, access: str | None = None):
    """A spec edit: the node `path` in linux.devices, as a runtime puts it there; with
    `access`, an allow rule for it in linux.resources.devices (as podman --device or a CRI
    runtime's CDI writes one), without, only the runtime's default deny (runc's and crun's
    default spec)."""
    def edit(spec):
        linux = spec.setdefault("linux", {})
        linux.setdefault("devices", []).append({"path": path, "type": "c", "major": major, "minor": minor,
                                                "fileMode": 0o666, "uid": 0, "gid": 0})
        if access is not None:
            linux.setdefault("resources", {}).setdefault("devices", []).append(
                {"allow": True, "type": "c", "major": major, "minor": minor, "access": access})
    return edit


def assert_runtime_grant_kept(probes, path: str, access: str | None) -> None:
    """`path` (a GPU node the runtime put in linux.devices) opens exactly as the runtime's own
    rules say: ENXIO (allowed, no driver) for the letters in `access`, EPERM for the rest."""
    item = probes[path]
    assert item["exists"], item
    for letter, key in (("r", "read"), ("w", "write")):
        expected = "ENXIO" if access and letter in access else "EPERM"
        assert item[key] == expected, (path, key, item)


STRICT_POLICY = {"accept-env-when-unprivileged": False}


def start_with_runtime_node(gpus, name: str, policy: dict, access: str | None):
    """Start container `name` (GpuContainers or a subclass whose `run` takes `edit`) with
    /dev/nvidia2 in linux.devices opened by the runtime for `access` only (None: not at all)
    and the image's NVIDIA_VISIBLE_DEVICES=0, under the gpuhook `policy`; check that the hook
    opened nothing of GPU 2 the runtime did not (docs/requests.md, "Never widen the runtime's
    grant"). Returns the probes."""
    sim = gpus.sim
    gpus.configure(**policy)
    result = gpus.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"],
                      edit=runtime_node("/dev/nvidia2", sim["majors"]["nvidia"], sim["gpus"][2]["minor"], access))
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert_runtime_grant_kept(probes, "/dev/nvidia2", access)
    if access is None and not policy:
        # No grant: the image's GPU 0 is the request (default policy); the runtime's file stays shut.
        assert gpu_nodes(probes) == {"/dev/nvidia0", "/dev/nvidia2"}
        assert probes["/dev/nvidia0"]["write"] == "ENXIO"
    else:
        # The runtime's read-only grant is the grant (GPU 0 cannot be added), or nothing is.
        assert gpu_nodes(probes) == {"/dev/nvidia2"}
    return probes


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
    directory = registry.entries_dir(state_dir)
    assert os.path.isdir(directory), f"no health registry at {directory}"
    return registry.load(state_dir, container) is not None


# podman 4.3 reads CDI specs from /etc/cdi and /var/run/cdi only (no option names others). To
# give it a CDI dir of a test's own without writing the host's, `podman run` starts in a mount
# namespace of its own whose /run is a tmpfs holding the host's /run entries bound back one by
# one, plus the test's dir at /run/cdi (over the host's, if the host has one). Arguments:
# CDI_DIR OLD_RUN_MOUNTPOINT COMMAND...
PRIVATE_CDI_RUN = r"""
cdi=$1 old=$2; shift 2
mount --rbind /run "$old"
mount -t tmpfs -o mode=0755 tmpfs /run
for entry in "$old"/* "$old"/.[!.]*; do
  [ -e "$entry" ] || [ -L "$entry" ] || continue
  name=${entry##*/}
  if [ -L "$entry" ]; then cp -P "$entry" "/run/$name"
  elif [ -d "$entry" ]; then mkdir "/run/$name" && mount --rbind "$entry" "/run/$name"
  else : > "/run/$name" && mount --bind "$entry" "/run/$name"; fi
done
mkdir -p /run/cdi && mount --bind "$cdi" /run/cdi
exec "$@"
"""


def with_private_cdi_dir(argv: list, cdi_dir: str) -> list:
    """`argv` run where /var/run/cdi is `cdi_dir` and the host's /run is otherwise as it is."""
    old = f"{cdi_dir}.host-run"
    os.makedirs(old, exist_ok=True)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", PRIVATE_CDI_RUN, "sh", cdi_dir, old, *argv]


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

    def image(self, rootfs: str, annotations: dict) -> str:
        """An image of `rootfs` whose OCI manifest carries `annotations`, pulled into this
        podman's storage from an OCI layout; returns its id. podman up to 4.5 copies such
        annotations into the container's spec, beside its own."""
        import hashlib
        import io
        import tarfile

        os.makedirs(self.workdir, exist_ok=True)
        # A name podman takes as an image reference: mkdtemp's may end in "_" (invalid there).
        layout = f"{self.workdir}/image-{os.urandom(4).hex()}"
        os.mkdir(layout, 0o700)
        os.makedirs(f"{layout}/blobs/sha256")

        def blob(data: bytes) -> dict:
            digest = hashlib.sha256(data).hexdigest()
            with open(f"{layout}/blobs/sha256/{digest}", "wb") as f:
                f.write(data)
            return {"digest": f"sha256:{digest}", "size": len(data)}

        layer = io.BytesIO()
        with tarfile.open(fileobj=layer, mode="w") as tar:
            for name in sorted(os.listdir(rootfs)):
                tar.add(os.path.join(rootfs, name), arcname=name)
        layer = layer.getvalue()
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                             "rootfs": {"type": "layers",
                                        "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]}}).encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(layer)}],
            "annotations": annotations}).encode()
        with open(f"{layout}/index.json", "w") as f:
            json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                          **blob(manifest)}]}, f)
        with open(f"{layout}/oci-layout", "w") as f:
            json.dump({"imageLayoutVersion": "1.0.0"}, f)
        done = subprocess.run([self.podman, *self._storage(), "pull", "-q", f"oci:{layout}"], env=RUN_ENV,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd="/")
        shutil.rmtree(layout, ignore_errors=True)
        if done.returncode != 0:
            raise TestbedError(f"podman pull of an OCI layout failed: {done.stderr.strip()}")
        return done.stdout.split()[-1]

    def _storage(self) -> list:
        return ["--root", f"{self.workdir}/storage", "--runroot", self.runroot, "--tmpdir", f"{self.workdir}/tmp"]

    def argv(self, rootfs: str, args: list, env=(), annotations=None, cap_add=(), devices=(), image=None) -> list:
        """The `podman run --rm` command line for one container: from `rootfs`, or from the
        image `image` (an id from image()) when given."""
        argv = [self.podman, *self._storage(), "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                "--runtime", self.runtime, "--hooks-dir", self.hooks_dir,
                "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        for cap in cap_add:
            argv += ["--cap-add", cap]
        for device in devices:
            argv += ["--device", device]
        for item in env:
            argv += ["--env", item]
        for key, value in (annotations or {}).items():
            argv += ["--annotation", f"{key}={value}"]
        return argv + ([image] if image else ["--rootfs", rootfs]) + list(args)

    def run(self, rootfs: str, args: list, env=(), annotations=None, cap_add=("MKNOD",),
            timeout: float = 120, devices=(), image=None) -> RunResult:
        """Run one container to completion (podman removes it); `cap_add` defaults to MKNOD
        because tests make device nodes inside and podman's default set lacks it."""
        try:
            done = subprocess.run(self.argv(rootfs, args, env, annotations, cap_add, devices, image), env=RUN_ENV,
                                  capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")
        except FileNotFoundError:
            raise TestbedError(f"{self.podman} is not installed (apt-get install podman)") from None
        except subprocess.TimeoutExpired:
            raise TestbedError(f"podman container did not finish within {timeout}s") from None
        return RunResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


class Containerd:
    """A containerd daemon of its own: config, root, state and sockets under `workdir`.

    The config's CRI section mirrors Debian's packaged /etc/containerd/config.toml (so
    `gpuhook install containerd` edits a realistic file); every path containerd would
    otherwise share with a system daemon (sockets, /opt/containerd) is private.
    """

    def __init__(self, workdir: str, containerd: str = "containerd", ctr: str = "ctr", nofile: int | None = None):
        """`nofile`: the daemon's RLIMIT_NOFILE (soft and hard), which its containers inherit
        unless their spec sets one."""
        self.workdir = os.path.abspath(workdir)
        self.containerd = shutil.which(containerd) or containerd
        self.ctr_path = shutil.which(ctr) or ctr
        self.nofile = nofile
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
            limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))) \
                if self.nofile else None
            self._process = subprocess.Popen([self.containerd, "--config", self.config_path], env=RUN_ENV,
                                             stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd="/",
                                             preexec_fn=limit)
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

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

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

    def ctr(self, *args, timeout: float = 60) -> RunResult:
        """Run `ctr --address <our socket> ARGS`."""
        done = subprocess.run([self.ctr_path, "--address", self.address, *args], env=RUN_ENV,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")
        return RunResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def plugin_status(self, plugin_type: str, plugin_id: str) -> str:
        """A plugin's status as `ctr plugins ls` shows it (ok, error, skip)."""
        listing = self.ctr("plugins", "ls")
        for line in listing.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[0] == plugin_type and fields[1] == plugin_id:
                return fields[-1]
        raise TestbedError(f"plugin {plugin_type} {plugin_id} not listed: {listing.stderr.strip()}")

    def run(self, spec_path: str, container_id: str, timeout: float = 60) -> RunResult:
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
