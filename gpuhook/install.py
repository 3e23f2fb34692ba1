"""`gpuhook install` / `gpuhook uninstall`: register gpuhook with a container runtime.

Every target registers two stages (`STAGES`): ``prestart`` (inject and check the GPUs) and
``poststop`` (clean up what a stopped container left on them). Targets (docs/packaging.md has
the operator's view):

- ``podman``, ``crio``: ``<hooks-dir>/gpuhook.json`` (prestart) and
  ``<hooks-dir>/gpuhook-poststop.json`` (poststop), oci-hooks 1.0.0 files. One file per stage
  because oci-hooks passes the same args to every stage a file lists, and our args name the
  stage. The admin dir /etc/containers/oci/hooks.d overrides the packaged
  /usr/share/containers/oci/hooks.d file of the same name, so the two never both run.
- ``containerd``: a base runtime spec (containerd's default spec from ``ctr oci spec`` plus
  our hooks) and an edit of containerd's config.toml that points CRI's runc runtime at it. The
  edit goes into config.toml itself, not a conf.d drop-in: containerd 1.6 replaces a whole
  plugin section with the imported one, so a drop-in would silently reset Debian's own CRI
  settings (cni bin_dir) to the built-in defaults (checked with ``containerd config dump``).
- ``runc-bundle``: our hooks appended to a bundle's config.json ``hooks.prestart`` and
  ``hooks.poststop``.

Every operation is computed first as an `InstallPlan` (each file's content before and after,
the backups to make or drop): pure data that ``--dry-run`` renders as a unified diff.
`apply` is the only function here that writes.

Backups and uninstall: the first time gpuhook changes a file that does not already carry
gpuhook, the file is copied to ``FILE.gpuhook-bak``. Uninstall returns every file to that
state: a file gpuhook wrote whole is restored from its backup or, if it had none, deleted; a
shared file (containerd's config.toml, a bundle's config.json) loses exactly the lines or
hook entries gpuhook added, and its backup is restored byte for byte and dropped when nothing
else changed since. Directories gpuhook created stay.
"""

import copy
import difflib
import errno
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from gpuhook import config as cfg
from gpuhook.errors import InputError

TARGETS = ("podman", "crio", "containerd", "runc-bundle")

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
# CDI annotation naming an NVIDIA GPU, the one request channel that is also an annotation
# (podman matches `when.annotations` keys and values as unanchored regular expressions).
CDI_WHEN = {r"^cdi\.k8s\.io/.*$": r"nvidia\.com/gpu="}

CRI_PLUGIN = "io.containerd.grpc.v1.cri"
# containerd 2.x (config version 3) split CRI; its runtimes live in the runtime plugin.
CRI_RUNTIME_PLUGIN_V3 = "io.containerd.cri.v1.runtime"
RUNC_TABLE_PATHS = {2: ("plugins", CRI_PLUGIN, "containerd", "runtimes", "runc"),
                    3: ("plugins", CRI_RUNTIME_PLUGIN_V3, "containerd", "runtimes", "runc")}
RUNC_TABLE_PATH = RUNC_TABLE_PATHS[2]


def runc_table_name(version: int = 2) -> str:
    path = RUNC_TABLE_PATHS[version]
    return f'plugins."{path[1]}".containerd.runtimes.runc'


RUNC_TABLE = runc_table_name(2)
RUNC_RUNTIME_TYPE = "io.containerd.runc.v2"
# Marks on the config.toml lines gpuhook adds or changes, so uninstall can take back exactly
# those. A changed line keeps its original after WAS_MARK.
ADDED_MARK = "# added by gpuhook install"
WAS_MARK = "# changed by gpuhook install, was: "


class InstallError(InputError):
    """A runtime's configuration could not be read or changed as asked."""


@dataclass(frozen=True)
class Hook:
    """How a runtime starts gpuhook: an absolute interpreter, -I -S, our launcher."""

    python: str
    launcher: str
    config: str | None = None
    timeout: int = 30

    def entry(self, stage: str = STAGE) -> dict:
        """The OCI hook entry {path, args, env, timeout} for `stage`; args[0] is argv[0].

        argv[0] is the interpreter's full path, not "python3": Python derives sys.executable
        from a bare argv[0] by searching PATH, which finds the system interpreter instead of a
        venv's and so loses the venv's site-packages (pynvml, psutil)."""
        args = [self.python, "-I", "-S", self.launcher, stage]
        if self.config:
            args += ["--config", self.config]
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
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")


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


def this_installation(python: str | None = None, config_path: str | None = None,
                      environ: dict | None = None) -> Hook:
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
                config=config_path, timeout=hook_timeout(config))


def packaged_hook(launcher: str = DEBIAN_LAUNCHER) -> Hook:
    """The hook a distribution package registers: system Python, default configuration."""
    return Hook(python=SYSTEM_PYTHON, launcher=launcher, timeout=hook_timeout(cfg.defaults()))


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
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InstallError(f"{path} is a symlink; gpuhook does not follow links when installing") from None
        raise InstallError(f"cannot read {path}: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InstallError(f"{path} is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise InstallError(f"{path} is not a regular file")
        data = os.read(fd, MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise InstallError(f"{path} is larger than {MAX_FILE_BYTES >> 20} MiB")
    except OSError as err:
        raise InstallError(f"cannot read {path}: {err.strerror}") from err
    finally:
        os.close(fd)
    return (data, st) if want_stat else data


def _hooks_d_is_ours(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and is_gpuhook_entry(doc.get("hook"))


def _runtime_notes(target: str, paths: list, package_hooks_dir: str, installing: bool) -> list:
    """What the runtime does with the hooks.d files at `paths` (all in one dir)."""
    notes = []
    directory = os.path.dirname(paths[0])
    # The runtimes read both default dirs, the admin one overriding by file name.
    if directory == ADMIN_HOOKS_DIR:
        for path in paths:
            packaged = os.path.join(package_hooks_dir, os.path.basename(path))
            if os.path.exists(packaged):
                notes.append(f"{path} overrides the packaged {packaged} (same file name)" if installing else
                             f"the packaged {packaged} still registers gpuhook (remove the package to stop it)")
    if target == "crio":
        notes.append("CRI-O reads hooks only from the dirs in crio.conf's hooks_dir (default "
                     f"{package_hooks_dir}); make sure {directory} is listed, then restart CRI-O")
    elif installing:
        notes.append("podman reads the hooks dir at every container start; nothing to restart")
    return notes


def hooks_d_paths(hooks_dir: str) -> dict:
    """Stage -> the hooks.d file gpuhook install writes for it in `hooks_dir`."""
    directory = os.path.abspath(hooks_dir)
    return {stage: os.path.join(directory, name) for stage, name in HOOKS_D_FILES.items()}


def plan_hooks_d(target: str, hooks_dir: str, hook: Hook, annotated: bool = False,
                 package_hooks_dir: str = PACKAGE_HOOKS_DIR) -> InstallPlan:
    """Write <hooks_dir>/gpuhook.json (prestart) and gpuhook-poststop.json (poststop) for
    podman or CRI-O; each file that is not gpuhook's is backed up first."""
    changes, notes = [], []
    paths = hooks_d_paths(hooks_dir)
    for stage, path in paths.items():
        old = _read_text(path)
        new = render_json(hooks_d_document(hook, annotated, stage))
        backup = path + BACKUP_SUFFIX if old is not None and old != new and not _hooks_d_is_ours(old) else None
        changes.append(FileChange(path, old, new, backup=backup))
        if old is None and os.path.exists(path + BACKUP_SUFFIX):
            notes.append(f"{path + BACKUP_SUFFIX} is left from an earlier install; uninstall will restore it")
    notes = _runtime_notes(target, list(paths.values()), package_hooks_dir, installing=True) + notes
    return InstallPlan(tuple(changes), tuple(notes))


def plan_hooks_d_removal(target: str, hooks_dir: str,
                         package_hooks_dir: str = PACKAGE_HOOKS_DIR) -> InstallPlan:
    """Take back <hooks_dir>/gpuhook.json and gpuhook-poststop.json: restore the file each
    replaced, or delete it. A file of those names that does not run gpuhook stops the whole
    uninstall before anything changes; an absent one (an install older than the poststop
    file) is only noted."""
    changes, notes, present = [], [], []
    for path in hooks_d_paths(hooks_dir).values():
        old = _read_text(path)
        if old is None:
            notes.append(f"{path} does not exist: nothing to remove")
            continue
        if not _hooks_d_is_ours(old):
            raise InstallError(f"{path} does not run gpuhook; leaving it alone")
        backup = path + BACKUP_SUFFIX
        saved = _read_text(backup)
        changes.append(FileChange(path, old, saved, drop_backup=backup if saved is not None else None))
        present.append(path)
    if present:
        notes += _runtime_notes(target, present, package_hooks_dir, installing=False)
    return InstallPlan(tuple(changes), tuple(notes))


# --- JSON specs: runc bundles and containerd's base spec --------------------------------


def _plan_spec_with_hook(path: str, old: str | None, base: dict, style: str | None, entries: dict) -> FileChange:
    new_doc = with_hook(base, entries, path)
    if old is not None and _parse_json_object(old, path) == new_doc:
        return FileChange(path, old, old)
    backup = None
    if old is not None and not has_gpuhook(_parse_json_object(old, path)):
        backup = path + BACKUP_SUFFIX
    return FileChange(path, old, render_json(new_doc, style), backup=backup)


def _plan_spec_without_hook(path: str, old: str, delete_without_backup: bool) -> tuple[FileChange, list]:
    """Remove gpuhook's entries from the spec at `path`; restore the backup's exact bytes
    when the only differences from it were ours."""
    doc = _parse_json_object(old, path)
    backup = path + BACKUP_SUFFIX
    saved = _read_text(backup)
    if saved is None:
        if delete_without_backup:
            return FileChange(path, old, None), []
        return FileChange(path, old, render_json(without_hook(doc), old)), []
    try:
        saved_doc = json.loads(saved)
    except ValueError:
        saved_doc = None
    stripped = without_hook(doc)
    if isinstance(saved_doc, dict) and without_hook(saved_doc) == stripped:
        return FileChange(path, old, saved, drop_backup=backup), []
    note = f"{path} changed since gpuhook install; removed only gpuhook's hook and kept {backup}"
    return FileChange(path, old, render_json(stripped, old)), [note]


def plan_bundle(bundle: str, hook: Hook) -> InstallPlan:
    """Add gpuhook's prestart and poststop hooks to a runc bundle's config.json."""
    path = _bundle_config(bundle)
    old = _read_text(path)
    change = _plan_spec_with_hook(path, old, _parse_json_object(old, path), old, hook.entries())
    return InstallPlan((change,), ("runc reads config.json when the container is created: "
                                   "containers created from now on run gpuhook",))


def plan_bundle_removal(bundle: str) -> InstallPlan:
    """Remove gpuhook's hooks (every stage in `STAGES`) from a runc bundle's config.json."""
    path = _bundle_config(bundle)
    old = _read_text(path)
    if not has_gpuhook(_parse_json_object(old, path)):
        return InstallPlan((), (f"{path} has no gpuhook hook: nothing to remove",))
    change, notes = _plan_spec_without_hook(path, old, delete_without_backup=False)
    return InstallPlan((change,), tuple(notes))


def _bundle_config(bundle: str | None) -> str:
    if not bundle:
        raise InstallError("runc-bundle needs the bundle directory: gpuhook install runc-bundle BUNDLE")
    if not os.path.isdir(bundle):
        raise InstallError(f"bundle {bundle} is not a directory")
    path = os.path.join(os.path.abspath(bundle), "config.json")
    if not os.path.exists(path):
        raise InstallError(f"bundle {bundle} has no config.json", "create it with `runc spec`")
    return path


# --- containerd -------------------------------------------------------------------------


def default_spec_from_ctr(ctr: str = "ctr") -> str:
    """containerd's default runtime spec, as `ctr oci spec` prints it."""
    try:
        done = subprocess.run([ctr, "oci", "spec"], capture_output=True, timeout=60, cwd="/",
                              stdin=subprocess.DEVNULL, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except FileNotFoundError:
        raise InstallError(f"{ctr} is not installed", "install containerd, or give a spec with --base-spec") from None
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InstallError(f"{ctr} oci spec did not run: {err}") from err
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise InstallError(f"{ctr} oci spec failed: {tail[0]}")
    return done.stdout.decode()


def _parse_toml(text: str, where: str) -> dict:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InstallError(f"{where}: invalid TOML: {err}") from err


def _runc_table(doc: dict, version: int = 2) -> dict | None:
    node = doc
    for key in RUNC_TABLE_PATHS[version]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node if isinstance(node, dict) else None


def _table_header(line: str) -> tuple | None:
    """The key path of a TOML table header line (`[a."b".c]  # x`), None for other lines."""
    text = line.strip()
    if not text.startswith("[") or text.startswith("[["):
        return None
    import tomllib

    try:
        node = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    path = []
    while isinstance(node, dict) and len(node) == 1:
        key, node = next(iter(node.items()))
        path.append(key)
    return tuple(path)


def _set_in(doc: dict, path: tuple, key: str, value) -> None:
    for part in path:
        doc = doc.setdefault(part, {})
    doc[key] = value


def _manual_hint(spec_path: str, version: int = 2) -> str:
    return (f"add it by hand under [{runc_table_name(version)}]: runtime_type = \"{RUNC_RUNTIME_TYPE}\" "
            f"and base_runtime_spec = {json.dumps(spec_path)}")


def set_base_runtime_spec(text: str, spec_path: str, where: str) -> str:
    """containerd config.toml text with CRI's runc runtime using `spec_path` as base spec.

    Lines are added or changed textually (keeping the user's comments and layout) and marked;
    the result is parsed back and must differ from the original in exactly that setting.
    """
    doc = _parse_toml(text, where)
    version = doc.get("version", 1) if doc else 2
    if isinstance(version, bool) or not isinstance(version, int) or version not in RUNC_TABLE_PATHS:
        raise InstallError(f"{where}: containerd config version {str(version)[:20]}: gpuhook edits version 2 "
                           "(containerd 1.5 to 1.7) and version 3 (containerd 2.x)", _manual_hint(spec_path))
    table_path, table_name = RUNC_TABLE_PATHS[version], runc_table_name(version)
    runc = _runc_table(doc, version)
    current = runc.get("base_runtime_spec") if runc else None
    if current == spec_path:
        return text
    if current:
        raise InstallError(f"{where}: CRI's runc runtime already uses base_runtime_spec = {json.dumps(current)}",
                           f"add gpuhook's hook to that spec instead: gpuhook install containerd --output {current}")
    expected = copy.deepcopy(doc)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    value = f"base_runtime_spec = {json.dumps(spec_path)}"
    if not doc:
        # Empty or comments only: without `version = 2` containerd 1.x reads version 1.
        lines.insert(0, f"version = 2  {ADDED_MARK}\n")
        expected["version"] = 2
    header = next((i for i, line in enumerate(lines) if _table_header(line) == table_path), None)
    if header is not None:
        end = next((i for i in range(header + 1, len(lines)) if _table_header(lines[i]) is not None), len(lines))
        indent = lines[header][: len(lines[header]) - len(lines[header].lstrip())] + "  "
        existing = next((i for i in range(header + 1, end)
                         if lines[i].lstrip().startswith("base_runtime_spec") and "=" in lines[i]), None)
        if existing is not None:
            own = lines[existing][: len(lines[existing]) - len(lines[existing].lstrip())]
            lines[existing] = f"{own}{value}  {WAS_MARK}{lines[existing].strip()}\n"
        else:
            lines.insert(header + 1, f"{indent}{value}  {ADDED_MARK}\n")
    else:
        lines.append(f"# CRI's runc containers start from a spec that runs gpuhook  {ADDED_MARK}\n")
        lines.append(f"[{table_name}]  {ADDED_MARK}\n")
        if not (runc and "runtime_type" in runc):
            # Defining the table replaces containerd's default runc entry, runtime type included.
            lines.append(f"  runtime_type = \"{RUNC_RUNTIME_TYPE}\"  {ADDED_MARK}\n")
            _set_in(expected, table_path, "runtime_type", RUNC_RUNTIME_TYPE)
        lines.append(f"  {value}  {ADDED_MARK}\n")
    _set_in(expected, table_path, "base_runtime_spec", spec_path)
    new = "".join(lines)
    try:
        result = _parse_toml(new, where)
    except InstallError:
        result = None
    if result != expected:
        raise InstallError(f"{where}: cannot add base_runtime_spec safely (the runc runtime is defined in "
                           "a form gpuhook does not edit)", _manual_hint(spec_path, version))
    return new


def unset_base_runtime_spec(text: str) -> str:
    """`text` without the lines gpuhook added, and with the lines it changed restored."""
    out = []
    for line in text.splitlines(keepends=True):
        if WAS_MARK in line:
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + line.split(WAS_MARK, 1)[1].rstrip("\r\n") + "\n")
        elif line.rstrip().endswith(ADDED_MARK):
            continue
        else:
            out.append(line)
    return "".join(out)


def _containerd_notes(config_path: str, installing: bool) -> tuple:
    if installing:
        return (f"restart containerd to load {config_path} (systemctl restart containerd); the base spec "
                "applies to containers started through CRI (Kubernetes)",
                "ctr and nerdctl do not use base_runtime_spec: start containers with `ctr run --config SPEC` "
                "or register the hook in their spec")
    return (f"restart containerd to load {config_path} (systemctl restart containerd)",)


def plan_containerd(hook: Hook, spec_path: str = CONTAINERD_SPEC, config_path: str = CONTAINERD_CONFIG,
                    base_spec: str | None = None, ctr: str = "ctr") -> InstallPlan:
    """Write the base spec (default spec + our prestart and poststop hooks) and point
    config.toml's runc runtime at it."""
    spec_path = os.path.abspath(spec_path)
    config_path = os.path.abspath(config_path)
    old_spec = _read_text(spec_path)
    if base_spec is not None:
        style = _read_text(base_spec)
        if style is None:
            raise InstallError(f"base spec {base_spec} does not exist")
        where = base_spec
    elif old_spec is not None:
        style, where = old_spec, spec_path  # an existing spec gets our hook added
    else:
        style, where = default_spec_from_ctr(ctr), f"{ctr} oci spec"
    spec_change = _plan_spec_with_hook(spec_path, old_spec, _parse_json_object(style, where), style,
                                       hook.entries())
    old_config = _read_text(config_path)
    new_config = set_base_runtime_spec(old_config or "", spec_path, config_path)
    backup = None
    if old_config is not None and new_config != old_config and ADDED_MARK not in old_config \
            and WAS_MARK not in old_config:
        backup = config_path + BACKUP_SUFFIX
    # The spec first: the config must never point at a file that is not there yet.
    return InstallPlan((spec_change, FileChange(config_path, old_config, new_config, backup=backup)),
                       _containerd_notes(config_path, installing=True))


def plan_containerd_removal(spec_path: str = CONTAINERD_SPEC,
                            config_path: str = CONTAINERD_CONFIG) -> InstallPlan:
    """Take back the config.toml lines and the base spec that plan_containerd added."""
    spec_path = os.path.abspath(spec_path)
    config_path = os.path.abspath(config_path)
    changes, notes = [], []
    old_config = _read_text(config_path)
    if old_config is not None and (ADDED_MARK in old_config or WAS_MARK in old_config):
        new_config = unset_base_runtime_spec(old_config)
        backup = config_path + BACKUP_SUFFIX
        saved = _read_text(backup)
        drop = None
        if saved is not None and new_config.rstrip("\n") == saved.rstrip("\n"):
            new_config, drop = saved, backup
        elif saved is None and not new_config.strip():
            new_config = None  # gpuhook created the file
        elif saved is not None:
            notes.append(f"{config_path} changed since gpuhook install; removed only gpuhook's lines and kept {backup}")
        changes.append(FileChange(config_path, old_config, new_config, drop_backup=drop))
    old_spec = _read_text(spec_path)
    if old_spec is not None and has_gpuhook(_parse_json_object(old_spec, spec_path)):
        change, spec_notes = _plan_spec_without_hook(spec_path, old_spec, delete_without_backup=True)
        changes.append(change)
        notes += spec_notes
    if not changes:
        return InstallPlan((), (f"neither {config_path} nor {spec_path} carries gpuhook: nothing to remove",))
    return InstallPlan(tuple(changes), tuple(notes) + _containerd_notes(config_path, installing=False))


# --- entry points -----------------------------------------------------------------------

# Options that only make sense for some targets, so a misplaced one is an error, not ignored.
_OPTION_TARGETS = {
    "hooks_dir": ("--hooks-dir", ("podman", "crio")),
    "annotated": ("--annotated", ("podman", "crio")),
    "spec_path": ("--output", ("containerd",)),
    "containerd_config": ("--containerd-config", ("containerd",)),
    "base_spec": ("--base-spec", ("containerd",)),
    "bundle": ("BUNDLE", ("runc-bundle",)),
}


def _check_options(target: str, given: dict) -> None:
    if target not in TARGETS:
        raise InstallError(f"unknown target {target!r} (one of {', '.join(TARGETS)})")
    for name, value in given.items():
        if value in (None, False):
            continue
        option, targets = _OPTION_TARGETS[name]
        if target not in targets:
            raise InstallError(f"{option} does not apply to {target} (only to {', '.join(targets)})")


def plan_install(target: str, bundle: str | None = None, hooks_dir: str | None = None,
                 spec_path: str | None = None, containerd_config: str | None = None,
                 base_spec: str | None = None, python: str | None = None, config_path: str | None = None,
                 annotated: bool = False, environ: dict | None = None) -> InstallPlan:
    """What `gpuhook install TARGET` would change, for the gpuhook running this code."""
    _check_options(target, {"bundle": bundle, "hooks_dir": hooks_dir, "spec_path": spec_path,
                            "containerd_config": containerd_config, "base_spec": base_spec,
                            "annotated": annotated})
    if target == "runc-bundle":
        _bundle_config(bundle)  # a usage error comes before any other check
    hook = this_installation(python, config_path, environ)
    if target in ("podman", "crio"):
        return plan_hooks_d(target, hooks_dir or ADMIN_HOOKS_DIR, hook, annotated)
    if target == "containerd":
        return plan_containerd(hook, spec_path or CONTAINERD_SPEC, containerd_config or CONTAINERD_CONFIG,
                               base_spec)
    return plan_bundle(bundle, hook)


def plan_uninstall(target: str, bundle: str | None = None, hooks_dir: str | None = None,
                   spec_path: str | None = None, containerd_config: str | None = None) -> InstallPlan:
    """What `gpuhook uninstall TARGET` would change."""
    _check_options(target, {"bundle": bundle, "hooks_dir": hooks_dir, "spec_path": spec_path,
                            "containerd_config": containerd_config})
    if target in ("podman", "crio"):
        return plan_hooks_d_removal(target, hooks_dir or ADMIN_HOOKS_DIR)
    if target == "containerd":
        return plan_containerd_removal(spec_path or CONTAINERD_SPEC, containerd_config or CONTAINERD_CONFIG)
    return plan_bundle_removal(bundle)


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
                _write_atomic(change.path, change.new)
                verb = "created" if change.old is None else "restored" if change.drop_backup else "updated"
                done.append(f"{verb} {change.path}")
            if change.drop_backup:
                os.unlink(change.drop_backup)
                done.append(f"removed {change.drop_backup}")
        except OSError as err:
            before = f" (done before the failure: {'; '.join(done)})" if done else ""
            raise InstallError(f"cannot change {err.filename or change.path}: {err.strerror}{before}") from err
    return done


def _write_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` in one rename, keeping an existing file's mode and owner."""
    _replace(path, text.encode("utf-8"))


def _copy_atomic(source: str, target: str) -> None:
    data, st = _read_bytes(source, want_stat=True)
    _replace(target, data, st)


def _replace(path: str, data: bytes, like=None) -> None:
    """Replace `path` with `data` through its directory's fd (safepath.replace_file), with
    the mode and owner of `like`, else of the file it replaces, else 0644 root. A link
    planted in a user-owned directory is never followed, and a FIFO or device is refused."""
    from gpuhook import cache, safepath

    directory, name = os.path.split(path)
    cache.make_dirs(directory)
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if like is None:
            try:
                like = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                like = None
            if like is not None and not stat.S_ISREG(like.st_mode):
                raise OSError(errno.EINVAL, "not a regular file; refusing to replace it", path)
        if like is None:
            safepath.replace_file(dir_fd, name, data)
        else:
            owner = (like.st_uid, like.st_gid) if os.geteuid() == 0 else None
            safepath.replace_file(dir_fd, name, data, like.st_mode & 0o7777, owner)
    finally:
        os.close(dir_fd)
