"""What every `gpuhook install` target shares: the constants, the hook entry of this
installation, the plan records (`InstallPlan`, `FileChange`), the JSON formats, safe reads,
and `apply`, the only function of the package that writes (gpuhook.install has the
overview)."""

import copy
import difflib
import errno
import json
import math
import os
import stat
import subprocess
import sys
from dataclasses import dataclass

from gpuhook import config as cfg
from gpuhook.errors import InputError
from gpuhook.kernel.files import read_regular_file

TARGETS = ("podman", "crio", "containerd", "runc-bundle", "docker")

HOOK_FILE_NAME = "gpuhook.json"
POSTSTOP_FILE_NAME = "gpuhook-poststop.json"
ADMIN_HOOKS_DIR = "/etc/containers/oci/hooks.d"
PACKAGE_HOOKS_DIR = "/usr/share/containers/oci/hooks.d"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_SPEC = "/etc/containerd/gpuhook-base-spec.json"
BACKUP_SUFFIX = ".gpuhook-bak"

# What the Debian and RPM packages register (packaging/render.py writes their files).
SYSTEM_PYTHON = "/usr/bin/python3"
DEBIAN_LAUNCHER = "/usr/lib/python3/dist-packages/gpuhook/launch.py"
# The native front (native/prescan.c, built by native/build.py) both packages install: the
# hook's no-GPU path without Python, and the client of the resident agent (gpuhook agent).
# A registration with it runs `FRONT PYTHON -I -S LAUNCHER STAGE...`: it execs argv[1..].
PACKAGED_FRONT = "/usr/libexec/gpuhook/gpuhook-front"

# prestart: podman 4.x runs it as such, podman 5.x runs a prestart stage as createRuntime,
# runc and crun run both at the same point; the hook treats the two names alike.
STAGE = "prestart"
# poststop: runc and crun run it at `delete`, podman when it cleans up a stopped container.
# The hook kills what the container left on its GPUs there (and, with reset-on-release,
# resets them); it never fails a stop.
POSTSTOP = "poststop"
# Every stage gpuhook install registers, in this order, and its hooks.d file name.
STAGES = (STAGE, POSTSTOP)
HOOKS_D_FILES = {STAGE: HOOK_FILE_NAME, POSTSTOP: POSTSTOP_FILE_NAME}
# The hook's environment is exactly this (CVE-2025-23266: a hook without `env` inherits
# the runtime's, LD_PRELOAD included). Children get their own minimal env from gpuhook.
HOOK_ENV = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
# Seconds between the hook's own deadline (config deadline-seconds, which bounds the
# health checks too) and the runtime killing it, so the hook can undo and report first.
TIMEOUT_MARGIN = 5

# The annotation-gated variant: podman and CRI-O start the hook only for containers with a
# CDI annotation naming a device of any NVIDIA kind (nvidia.com/gpu, k8s.device-plugin.nvidia.com/gpu,
# a DRA claim k8s.gpu.nvidia.com/claim) or of gpuhook's own (gpuhook.example/gpu), the kinds the
# annotation channel accepts (gpuhook.request.resolve.is_gpu_kind) and the one request channel that is
# also an annotation (podman matches `when.annotations` keys and values as unanchored regular
# expressions).
CDI_WHEN = {r"^cdi\.k8s\.io/.*$": r"(nvidia\.com/[a-zA-Z0-9_.-]+|gpuhook\.example/gpu)="}

class InstallError(InputError):
    """A runtime's configuration could not be read or changed as asked."""


@dataclass(frozen=True)
class Hook:
    """How a runtime starts gpuhook: an absolute interpreter, -I -S, our launcher; with
    `front`, that command run by the native front (PACKAGED_FRONT)."""

    python: str
    launcher: str
    config: str | None = None
    timeout: int = 30
    front: str | None = None

    def entry(self, stage: str = STAGE) -> dict:
        """The OCI hook entry {path, args, env, timeout} for `stage`; args[0] is argv[0].

        argv[0] is the interpreter's full path, not "python3": Python derives sys.executable
        from a bare argv[0] by searching PATH, which finds the system interpreter instead of a
        venv's and so loses the venv's site-packages (pynvml, click)."""
        args = [self.python, "-I", "-S", self.launcher, stage]
        if self.config:
            args += ["--config", self.config]
        if self.front:
            return {"path": self.front, "args": [self.front, *args], "env": list(HOOK_ENV), "timeout": self.timeout}
        return {"path": self.python, "args": args, "env": list(HOOK_ENV), "timeout": self.timeout}

    def entries(self) -> dict:
        """Every stage gpuhook registers -> its hook entry, in `STAGES` order."""
        return {stage: self.entry(stage) for stage in STAGES}


@dataclass(frozen=True)
class FileChange:
    """One file's content before and after (None: absent), and the backups involved."""

    path: str
    old: str | None
    new: str | None
    backup: str | None = None       # copy the current file here first
    drop_backup: str | None = None  # remove this backup afterwards (it was restored)
    mode: int | None = None         # a file created new gets this mode (default 0644)

    @property
    def modifies(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class InstallPlan:
    """Everything an install or uninstall would do: file changes plus notes for the user."""

    changes: tuple = ()
    notes: tuple = ()


# --- the hook entry for this installation --------------------------------------------------


def launcher_path() -> str:
    """This installation's gpuhook/launch.py, the file runtimes execute."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch.py")


def check_interpreter(path: str) -> str:
    """`path` if it is an absolute Python >= 3.11 binary, not a wrapper script."""
    if not path or not os.path.isabs(path):
        raise InstallError(f"interpreter {path!r} is not an absolute path",
                           "runtimes start hooks without a PATH search")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise InstallError(f"interpreter {path}: {err.strerror}") from err
    if head[:2] == b"#!":
        # A pyenv shim is a shell script that costs ~85 ms on every container start.
        raise InstallError(f"interpreter {path} is a script (a pyenv shim?), not a Python binary",
                           "pass the real interpreter with --python, e.g. $(python3 -c 'import sys; print(sys.executable)')")
    if not os.access(path, os.X_OK):
        raise InstallError(f"interpreter {path} is not executable")
    try:
        done = subprocess.run([path, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 11))"],
                              capture_output=True, timeout=30, env={}, stdin=subprocess.DEVNULL, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InstallError(f"interpreter {path} does not run: {err}") from err
    if done.stdout.strip() != b"True":
        raise InstallError(f"interpreter {path} is not Python 3.11 or newer")
    return path


def hook_timeout(config) -> int:
    """The runtime's timeout for the hook: above the hook's own deadline."""
    return math.ceil(config.deadline_seconds) + TIMEOUT_MARGIN


def check_front(path: str) -> bool:
    """Whether `path` is a native front this gpuhook can be run by: an absolute, executable
    regular file whose `--protocol` prints gpuhook.prescan.FRONT_PROTOCOL (an older or newer
    front would hand the hook a protocol it refuses)."""
    from gpuhook.prescan import FRONT_PROTOCOL

    if not path or not os.path.isabs(path):
        return False
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or not os.access(path, os.X_OK):
            return False
        done = subprocess.run([path, "--protocol"], capture_output=True, timeout=10, env={},
                              stdin=subprocess.DEVNULL, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout == f"{FRONT_PROTOCOL}\n".encode()


def pick_front(front: str | None, no_front: bool = False) -> str | None:
    """The front a registration uses: none with --no-front; `front` (--front) when given, which
    must pass check_front; else, for a packaged gpuhook, the packaged front when it is
    installed and passes check_front; else none (the Python command, as without a front)."""
    if no_front:
        if front:
            raise InstallError("--front and --no-front contradict each other")
        return None
    if front:
        front = os.path.abspath(front)
        if not check_front(front):
            raise InstallError(f"--front {front} is not a gpuhook front of this version",
                               "build it with native/build.py, or leave --front out")
        return front
    # Only a packaged gpuhook (its launcher under /usr/lib: the .deb's dist-packages, the RPM's
    # site-packages) is next to the packaged front; a virtual environment's or a copy's is not.
    packaged = launcher_path().startswith("/usr/lib/")
    return PACKAGED_FRONT if packaged and check_front(PACKAGED_FRONT) else None


def this_installation(python: str | None = None, config_path: str | None = None,
                      environ: dict | None = None, front: str | None = None, no_front: bool = False) -> Hook:
    """The hook entry for the gpuhook that is running this code.

    The interpreter defaults to sys.executable as is: not resolved, because a virtual
    environment's bin/python3 is how Python finds that environment's site-packages (the GPU
    path needs them), and never a shim, because sys.executable is the binary a shim ran.
    The configuration defaults to $GPUHOOK_CONFIG: the hook's own environment is PATH only,
    so a config file the hook must use goes into its arguments.
    """
    environ = os.environ if environ is None else environ
    config_path = config_path or environ.get(cfg.ENV_VAR) or None
    if config_path is not None:
        # The hook runs in the bundle directory; a relative path would resolve there.
        config_path = os.path.abspath(config_path)
    # Read the configuration the hook will read: it must be valid, and its deadline sets
    # the runtime's timeout. No cache: install writes nothing it was not asked to.
    config = cfg.load(config_path, {}, use_cache=False)
    return Hook(python=check_interpreter(python or sys.executable), launcher=launcher_path(),
                config=config_path, timeout=hook_timeout(config), front=pick_front(front, no_front))


def packaged_hook(launcher: str = DEBIAN_LAUNCHER, python: str = SYSTEM_PYTHON, front: str | None = None) -> Hook:
    """The hook a distribution package registers: the system's Python (RHEL 9's RPM: its
    python3.11), default configuration, run by the packaged native front when `front`."""
    return Hook(python=python, launcher=launcher, timeout=hook_timeout(cfg.defaults()), front=front)


# --- file formats -----------------------------------------------------------------------


def hooks_d_document(hook: Hook, annotated: bool = False, stage: str = STAGE) -> dict:
    """An oci-hooks 1.0.0 document (podman, CRI-O) that runs `hook` at `stage` only.

    Both stages' documents of one variant carry the same `when`: a container the prestart
    hook may have configured must also get the poststop hook, and one it never saw needs none."""
    if stage not in HOOKS_D_FILES:
        raise ValueError(f"gpuhook registers no {stage!r} stage (only {', '.join(STAGES)})")
    when = {"annotations": dict(CDI_WHEN)} if annotated else {"always": True}
    return {"version": "1.0.0", "hook": hook.entry(stage), "when": when, "stages": [stage]}


def render_json(doc, style: str | None = None) -> str:
    """JSON text; `style` is an existing file's text whose indentation is kept."""
    indent, trailing = "  ", "\n"
    if style is not None:
        indent = _indent_of(style)
        trailing = "\n" if style.endswith("\n") else ""
    if indent is None:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + trailing
    return json.dumps(doc, indent=indent, ensure_ascii=False) + trailing


def _indent_of(text: str) -> str | None:
    """The indentation unit of a JSON text (its first indented line), None when compact."""
    for line in text.splitlines()[1:]:
        body = line.lstrip(" \t")
        if body and body != line:
            return line[: len(line) - len(body)]
    return None


def is_gpuhook_entry(entry) -> bool:
    """True for an OCI hook entry that runs gpuhook: through its launcher (what gpuhook
    install writes) or as the `gpuhook` command (a hand-written entry)."""
    if not isinstance(entry, dict):
        return False
    path, args = entry.get("path"), entry.get("args")
    if isinstance(path, str) and os.path.basename(path) == "gpuhook":
        return True
    return isinstance(args, list) and any(isinstance(a, str) and a.endswith("/gpuhook/launch.py") for a in args)


def has_gpuhook(spec: dict) -> bool:
    """True when any stage gpuhook registers (`STAGES`) holds a gpuhook entry."""
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return False
    return any(isinstance(hooks.get(stage), list) and any(is_gpuhook_entry(e) for e in hooks[stage])
               for stage in STAGES)


def with_hook(spec: dict, entries: dict, where: str) -> dict:
    """`spec` with `entries` (stage -> entry, e.g. `Hook.entries()`) as its gpuhook hooks, one
    per stage: an old gpuhook entry of a stage is replaced in place, otherwise the entry runs
    after the spec's own hooks of that stage."""
    if not set(entries) <= set(STAGES):
        raise ValueError(f"entries must map stages ({', '.join(STAGES)}) to hook entries, got {sorted(entries)}")
    new = copy.deepcopy(spec)
    hooks = new.setdefault("hooks", {})
    if not isinstance(hooks, dict):
        raise InstallError(f"{where}: 'hooks' is not an object")
    for name in entries:
        if not isinstance(hooks.get(name, []), list):
            raise InstallError(f"{where}: 'hooks.{name}' is not a list")
    for name, entry in entries.items():
        stage = hooks.setdefault(name, [])
        ours = [i for i, e in enumerate(stage) if is_gpuhook_entry(e)]
        if not ours:
            stage.append(entry)
            continue
        stage[ours[0]] = entry
        for i in reversed(ours[1:]):
            del stage[i]
    return new


def without_hook(spec: dict) -> dict:
    """`spec` without gpuhook's entries in the stages it registers (`STAGES`), and without the
    lists (and the `hooks` object) that removing them leaves empty. Other stages, and lists
    that held no gpuhook entry, are not touched."""
    new = copy.deepcopy(spec)
    hooks = new.get("hooks")
    if not isinstance(hooks, dict):
        return new
    removed = False
    for stage in STAGES:
        entries = hooks.get(stage)
        if not isinstance(entries, list) or not any(is_gpuhook_entry(e) for e in entries):
            continue
        removed = True
        hooks[stage] = [e for e in entries if not is_gpuhook_entry(e)]
        if not hooks[stage]:
            del hooks[stage]
    if removed and not hooks:
        del new["hooks"]
    return new


def _parse_json_object(text: str, where: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise InstallError(f"{where}: not valid JSON: {err}") from err
    if not isinstance(doc, dict):
        raise InstallError(f"{where}: expected a JSON object")
    return doc


MAX_FILE_BYTES = 16 << 20


def _read_text(path: str) -> str | None:
    """A file's text exactly as stored (no newline translation); None when it is absent.
    A symlink, FIFO or device is refused, not followed: config and hooks directories can be
    user-owned, and a planted link must not make root hand back another file."""
    data = _read_bytes(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InstallError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from err


def _read_bytes(path: str, want_stat: bool = False):
    """The file at `path` (and its stat), never through a symlink, never blocking on a FIFO
    (gpuhook.kernel.files.read_regular_file); None when it does not exist."""
    try:
        data, st = read_regular_file(path, MAX_FILE_BYTES + 1, os.O_NOFOLLOW, with_stat=True)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InstallError(f"{path} is a symlink; gpuhook does not follow links when installing") from None
        if err.errno == errno.EINVAL:
            raise InstallError(f"{path} is not a regular file") from None
        raise InstallError(f"cannot read {path}: {err.strerror}") from err
    if len(data) > MAX_FILE_BYTES:
        raise InstallError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB")
    return (data, st) if want_stat else data


# --- rendering and applying -------------------------------------------------------------


def render_diff(plan: InstallPlan) -> str:
    """The plan as a unified diff (`patch` applies it), backups and notes as # lines."""
    out = []
    for change in plan.changes:
        if not change.modifies:
            out.append(f"# {change.path}: unchanged\n")
            continue
        if change.backup:
            out.append(f"# back up {change.path} to {change.backup}\n")
        before = (change.old or "").splitlines(keepends=True)
        after = (change.new or "").splitlines(keepends=True)
        for line in difflib.unified_diff(before, after, change.path if change.old is not None else "/dev/null",
                                         change.path if change.new is not None else "/dev/null"):
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
        if change.drop_backup:
            out.append(f"# remove {change.drop_backup} (restored)\n")
    out += [f"# {note}\n" for note in plan.notes]
    return "".join(out)


def apply(plan: InstallPlan) -> list[str]:
    """Carry out `plan`; returns one line per thing done."""
    done = []
    for change in plan.changes:
        if not change.modifies:
            done.append(f"unchanged {change.path}")
            continue
        try:
            if change.backup:
                _copy_atomic(change.path, change.backup)
                done.append(f"backed up {change.path} to {change.backup}")
            if change.new is None:
                os.unlink(change.path)
                done.append(f"removed {change.path}")
            else:
                _write_atomic(change.path, change.new, change.mode)
                verb = "created" if change.old is None else "restored" if change.drop_backup else "updated"
                done.append(f"{verb} {change.path}")
            if change.drop_backup:
                os.unlink(change.drop_backup)
                done.append(f"removed {change.drop_backup}")
        except OSError as err:
            before = f" (done before the failure: {'; '.join(done)})" if done else ""
            raise InstallError(f"cannot change {err.filename or change.path}: {err.strerror}{before}") from err
    return done


def _write_atomic(path: str, text: str, mode: int | None = None) -> None:
    """Replace `path` with `text` in one rename, keeping an existing file's mode and owner
    (`mode` for a new file, or one whose mode must be exactly that)."""
    _replace(path, text.encode("utf-8"), mode=mode)


def _copy_atomic(source: str, target: str) -> None:
    data, st = _read_bytes(source, want_stat=True)
    _replace(target, data, st)


def _replace(path: str, data: bytes, like=None, mode: int | None = None) -> None:
    """Replace `path` with `data` through its directory's fd (gpuhook.apply.rootfs.replace_file), with
    the mode and owner of `like`, else of the file it replaces, else 0644 root. A link
    planted in a user-owned directory is never followed, and a FIFO or device is refused."""
    from gpuhook.apply import rootfs, statefiles

    directory, name = os.path.split(path)
    statefiles.make_dirs(directory)
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if like is None:
            try:
                like = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                like = None
            if like is not None and not stat.S_ISREG(like.st_mode):
                raise OSError(errno.EINVAL, "not a regular file; refusing to replace it", path)
        if mode is not None:
            rootfs.replace_file(dir_fd, name, data, mode, (0, 0) if os.geteuid() == 0 else None)
        elif like is None:
            rootfs.replace_file(dir_fd, name, data)
        else:
            owner = (like.st_uid, like.st_gid) if os.geteuid() == 0 else None
            rootfs.replace_file(dir_fd, name, data, like.st_mode & 0o7777, owner)
    finally:
        os.close(dir_fd)
