"""What `gpuhook demo` needs to start a real runc container on a simulated GPU host: a busybox
root filesystem, a bundle made from runc's own spec, gpuhook registered as its hook the way
hooks.d/gpuhook.json registers it, and one `runc run`.

Containers are real: runc creates the namespaces and cgroups and runs gpuhook as a prestart
hook exactly as it would in production. The test harness (tests/helpers/testbed.py: Testbed)
builds on these functions, so the busybox and bundle rules have one home; what only tests
need (their probes, wrappers around runc, containers started from threads) stays there.
"""

import json
import os
import shutil
import subprocess
import sys

from gpuhook.errors import InputError

BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
RUN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class RuncError(InputError):
    """A container could not be set up, or a runc call failed."""


def find_busybox() -> str:
    for path in BUSYBOX_CANDIDATES:
        if os.path.exists(path):
            with open(path, "rb") as f:
                head = f.read(4096)
            if b"/lib64/ld-linux" not in head and b"/lib/ld-linux" not in head:
                return path
    raise RuncError("a static busybox is needed (apt-get install busybox-static)")


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


def runc_spec(runc: str, directory: str) -> dict:
    """runc's own default spec (`runc spec`), made once in `directory`."""
    os.makedirs(directory, exist_ok=True)
    if not os.path.exists(f"{directory}/config.json"):
        call([runc, "spec", "--bundle", directory], "runc spec")
    with open(f"{directory}/config.json") as f:
        return json.load(f)


def busybox_rootfs(path: str, files: dict | None = None) -> str:
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


def write_bundle(path: str, spec: dict, args: list, env=(), mounts=(), annotations=None, hooks=None,
                 rootfs: str | None = None, privileged: bool = False, cgroups_path: str | None = None,
                 edit=None) -> str:
    """Write the bundle at `path`: `spec` (runc's, a copy) running `args`, with a busybox
    rootfs of its own unless `rootfs` is given."""
    os.makedirs(path, exist_ok=True)
    spec["process"]["terminal"] = False
    spec["process"]["args"] = list(args)
    spec["process"]["env"] = spec["process"].get("env", []) + list(env)
    # Docker's default set has CAP_MKNOD (tests make device nodes inside); runc's lacks it.
    extra = {"CAP_MKNOD", "CAP_SYS_ADMIN"} if privileged else {"CAP_MKNOD"}
    caps = spec["process"]["capabilities"]
    for kind in ("bounding", "effective", "permitted"):
        caps[kind] = sorted(set(caps.get(kind, [])) | extra)
    if privileged:  # as docker --privileged: every device allowed (gpuhook's Spec.privileged)
        spec.setdefault("linux", {}).setdefault("resources", {})["devices"] = [{"allow": True, "access": "rwm"}]
    spec["mounts"] = spec.get("mounts", []) + list(mounts)
    if annotations:
        spec["annotations"] = dict(annotations)
    if hooks:
        spec["hooks"] = hooks
    if rootfs is None:
        rootfs = busybox_rootfs(f"{path}/rootfs")
    spec["root"] = {"path": rootfs, "readonly": False}
    if cgroups_path is not None:
        spec.setdefault("linux", {})["cgroupsPath"] = cgroups_path
    if edit is not None:
        edit(spec)
    with open(f"{path}/config.json", "w") as f:
        json.dump(spec, f, indent=2)
    return path


def run(runc: str, state_root: str, bundle: str, container_id: str, timeout: float = 60, prefix=(),
        runc_args=()) -> tuple:
    """(exit status, stdout, stderr) of `runc run` of the bundle to completion; the container
    is always deleted afterwards. `prefix` goes in front of every runc command."""
    argv = [*prefix, runc, "--root", state_root, *runc_args, "run", "--bundle", bundle, container_id]
    try:
        done = subprocess.run(argv, env=RUN_ENV, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd="/")
    except subprocess.TimeoutExpired:
        delete(runc, state_root, container_id, prefix)
        raise RuncError(f"container {container_id} did not finish within {timeout}s") from None
    finally:
        delete(runc, state_root, container_id, prefix)
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def delete(runc: str, state_root: str, container_id: str, prefix=()) -> None:
    subprocess.run([*prefix, runc, "--root", state_root, "delete", "--force", container_id],
                   env=RUN_ENV, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)


def call(argv, what: str) -> None:
    try:
        subprocess.run(argv, env=RUN_ENV, check=True, capture_output=True, timeout=60, cwd="/")
    except FileNotFoundError:
        raise RuncError(f"{what}: {argv[0]} is not installed (apt-get install runc)") from None
    except subprocess.CalledProcessError as err:
        raise RuncError(f"{what} failed: {err.stderr.decode(errors='replace').strip()}") from None
