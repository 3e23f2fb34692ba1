"""gpuhook's JSON state files written: the caches, records, reports and stamps.

Every state file (caches, health reports, stamps, the container registry, grant and served
records) is written here: to a temporary name in its directory, then renamed into place, so
a reader (gpuhook.kernel.files.read) sees the old document or the new one, never half of
one; directories are made root-only and refused when anyone else could write them.

Two caches keep an unchanged host from being read twice the expensive way, each keyed by
everything that could change its content:

- the parsed configuration file, keyed by the file's identity and timestamps (tomllib and
  its imports cost more than the rest of the hook's decision), in <state-dir>/config-cache,
  the state-dir that file names (gpuhook.config.load says how it is found before parsing);
- the host inventory (gpuhook.discover.inventory) in <state-dir>, keyed by driver version, boot id
  and the cheap fingerprints of what the expensive reads depend on.

Caching is best effort: a cache that cannot be written never fails a container start.
"""

import errno
import os
import stat

from gpuhook import fastjson
from gpuhook.config import CACHE_DIR
from gpuhook.kernel.files import UntrustedPath, read, trusted


def make_dirs(path: str, mode: int = 0o755) -> None:
    """Make directory `path` with exactly `mode`, and its missing parents 0755, whatever the
    umask (os.makedirs gives intermediate directories 0777 & ~umask)."""
    missing = []
    current = path.rstrip("/") or "/"
    while not os.path.lexists(current):
        missing.append(current)
        current = os.path.dirname(current)
    for i, directory in enumerate(reversed(missing)):
        want = mode if i == len(missing) - 1 else 0o755
        try:
            os.mkdir(directory, want)
        except FileExistsError:
            continue  # made by a concurrent writer: the caller checks what it needs
        os.chmod(directory, want, follow_symlinks=False)


def ensure_dir(path: str, mode: int = 0o700) -> None:
    """`make_dirs`, then check the directory is ours and writable by nobody else; raises
    UntrustedPath if not."""
    make_dirs(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or not trusted(st):
        raise UntrustedPath(errno.EPERM, "not a directory owned by root and writable only by it", path)


def write_atomic(path: str, document, mode: int = 0o600, dir_mode: int = 0o700) -> None:
    """Write `document` as JSON to `path` atomically; raises OSError (or TypeError for a
    document JSON cannot hold). The directory is made with `dir_mode` (gpuhook.apply.statefiles.ensure_dir)."""
    directory = os.path.dirname(path)
    ensure_dir(directory, dir_mode)
    temp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    data = (fastjson.dumps(document) + "\n").encode()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        os.rename(temp, path)
    except OSError:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def remove(path: str) -> bool:
    """Remove state file `path`; False when it was already gone. Raises other OSErrors."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def claim(path: str, taken: str) -> None:
    """Rename state file `path` to `taken` in the same directory: of several claimants, the one
    whose rename succeeds has it. Raises OSError (FileNotFoundError: claimed first by another,
    or never there)."""
    os.rename(path, taken)


def open_lock(path: str, dir_mode: int = 0o700) -> int:
    """A descriptor of the lock file `path` (made 0600 when missing, its directory by
    `ensure_dir`) to flock. Raises OSError."""
    ensure_dir(os.path.dirname(path), dir_mode)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write(path: str, document) -> bool:
    """Best-effort `write_atomic` for caches: False if it could not be written."""
    try:
        write_atomic(path, document)
        return True
    except (OSError, TypeError, ValueError):
        return False


def write_caches(config, refreshed=()) -> None:
    """The one place a start writes gpuhook's caches, after it planned and before it applies
    (gpuhook.hook.prestart): the parsed configuration file's entry when gpuhook.config.load
    had to parse it (`config.cache_entry`), and what discovery refreshed (`refreshed`: the
    (path, document) pairs of gpuhook.discover.survey.Host.cache). Best effort."""
    if config.cache_entry is not None:
        path, document = config.cache_entry
        if write(path, document):
            prune_config_cache(config.state_dir)
    for path, document in refreshed:
        write(path, document)


def prune_config_cache(state_dir: str, keep: int = 64) -> None:
    """Drop cached configs whose file is gone, once there are more than `keep` of them."""
    directory = f"{state_dir}/{CACHE_DIR}"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    if len(names) <= keep:
        return
    for name in names:
        entry = read(f"{directory}/{name}")
        source = entry.get("source") if isinstance(entry, dict) else None
        if not isinstance(source, str) or not os.path.exists(source):
            try:
                os.unlink(f"{directory}/{name}")
            except OSError:
                pass
