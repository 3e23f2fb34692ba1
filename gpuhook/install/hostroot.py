"""`gpuhook install TARGET --host-root DIR`: register gpuhook with a node's runtime from a
container that has the node's / mounted at DIR (the DaemonSet's init container,
deploy/kubernetes/, docs/kubernetes.md).

The runtime on the node executes the hook by the node's paths, so two things land there:
- gpuhook's own package, copied to DIR/opt/gpuhook/lib/gpuhook (pure Python; pynvml
  vendored). The hook's paths need nothing but the standard library, which the node's own
  Python brings;
- the runtime's registration (containerd's base spec and config.toml, or CRI-O's hooks dir),
  at DIR plus the usual path, naming the node's interpreter and the copied launcher.

The node's interpreter (default /usr/bin/python3) cannot be run from the container, so its
version is read from its name inside DIR: a link chain to python3.N with N >= 11 (resolved
inside DIR, at most 16 links). Every file is an InstallPlan change like any other target:
`--dry-run` shows it, re-running changes nothing, uninstall takes everything back.
"""

import os
import re

from gpuhook.install.common import FileChange, Hook, InstallError, _read_text, hook_timeout

HOST_LIB = "/opt/gpuhook/lib"
HOST_PYTHON = "/usr/bin/python3"
PACKAGE_SUFFIXES = (".py", ".json", ".c", ".h", ".proto")


def host_path(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def node_python_version(root: str, python: str = HOST_PYTHON) -> tuple:
    """(major, minor) of the node's interpreter at `python`, from the names in its link chain
    inside `root`. Raises InstallError when it is not a Python 3.11 or newer."""
    path = python
    for _ in range(16):
        match = re.fullmatch(r"python(\d+)\.(\d+)", os.path.basename(path))
        if match:
            version = (int(match.group(1)), int(match.group(2)))
            if version < (3, 11):
                raise InstallError(f"the node's {python} is Python {version[0]}.{version[1]}; gpuhook needs 3.11 or "
                                   "newer", "install python3.11 on the node, or pass --python with its path")
            if not os.path.isfile(host_path(root, path)):
                raise InstallError(f"the node's {path} is not a file")
            return version
        try:
            target = os.readlink(host_path(root, path))
        except FileNotFoundError:
            raise InstallError(f"the node has no {python}", "install Python 3.11 or newer on the node") from None
        except OSError:
            break  # a file, not a link: its name says no version
        path = os.path.normpath(os.path.join(os.path.dirname(path), target)) if not target.startswith("/") else target
    raise InstallError(f"cannot tell the version of the node's {python} from its name (python3.N)",
                       "pass --python with the versioned interpreter, e.g. /usr/bin/python3.11")


def package_files() -> dict:
    """This gpuhook's package files: path relative to the package's parent -> text."""
    base = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = {}
    for directory, dirs, names in os.walk(os.path.join(base, "gpuhook")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(PACKAGE_SUFFIXES):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, base)] = f.read()
    return files


def node_hook(root: str, config_path: str | None, python: str | None) -> Hook:
    """The hook entry as the node runs it: its interpreter, the copied launcher."""
    python = python or HOST_PYTHON
    node_python_version(root, python)
    from gpuhook import config as cfg

    if config_path is not None and not os.path.isabs(config_path):
        raise InstallError(f"--config {config_path}: give the node's absolute path")
    config = cfg.load(host_path(root, config_path), {}, use_cache=False) if config_path else cfg.defaults()
    return Hook(python=python, launcher=f"{HOST_LIB}/gpuhook/launch.py", config=config_path,
                timeout=hook_timeout(config))


def copy_changes(root: str) -> list:
    """FileChanges that put this gpuhook's package at DIR/opt/gpuhook/lib (or leave it)."""
    changes = []
    for relative, text in package_files().items():
        path = host_path(root, f"{HOST_LIB}/{relative}")
        old = _read_text(path)
        changes.append(FileChange(path, old, text))
    return changes


def removal_changes(root: str) -> list:
    """FileChanges that take the copied package away again."""
    changes = []
    top = host_path(root, f"{HOST_LIB}/gpuhook")
    for directory, dirs, names in os.walk(top):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(names):
            path = os.path.join(directory, name)
            old = _read_text(path)
            if old is not None:
                changes.append(FileChange(path, old, None))
    return changes


def lib_users(root: str, registrations: list, changes) -> list:
    """Which of `registrations` (node paths of files that may register gpuhook) still run the
    copied package once `changes` are made: the files it may not be taken from."""
    after = {change.path: change.new for change in changes}
    users = []
    for path in registrations:
        full = host_path(root, path)
        text = after[full] if full in after else _read_text(full)
        if text is not None and f"{HOST_LIB}/gpuhook/launch.py" in text:
            users.append(path)
    return users
