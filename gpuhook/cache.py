"""gpuhook's JSON state files, and the caches built on them.

Every state file (caches, health reports, stamps, the container registry) is written to a
temporary name in its directory and renamed into place, so a reader sees the old document
or the new one, never half of one, and is read without following a symlink; a missing or
damaged file reads as None.

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
from gpuhook.prescan import read_regular_file

CONFIG_CACHE_DIR = "config-cache"  # under the state-dir the cached config names
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id ("" if unreadable): state from an earlier boot is never trusted."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def trusted(st) -> bool:
    """Whether a file or directory with stat `st` can only have been written by us: owned by
    this (root) user and writable by nobody else. A state file that fails this is ignored:
    under a runtime's umask of 0, or in a directory someone else made, it could be forged."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


class UntrustedPath(OSError):
    """A directory exists but is not one gpuhook can trust (see `trusted`)."""


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


def read_trusted(path: str, limit: int) -> bytes:
    """Up to `limit` bytes of the file at `path`, opened without following a symlink and
    without blocking (a FIFO cannot hang the hook). Raises OSError, or UntrustedPath when it
    is not a regular file owned by root and writable only by it (see `trusted`)."""
    try:
        data, st = read_regular_file(path, limit, os.O_NOFOLLOW, with_stat=True)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        st = None
    if st is None or not trusted(st):  # what was read of an untrusted file is dropped unused
        raise UntrustedPath(errno.EPERM, "not a regular file owned by root and writable only by it", path)
    return data


def read(path: str, limit: int = 16 << 20):
    """The JSON document at `path`, or None if missing, damaged, or not trusted (see
    `trusted`: the file and its directory)."""
    try:
        data = read_trusted(path, limit)
        if not trusted(os.lstat(os.path.dirname(path) or ".")):
            return None
        return fastjson.loads(data)
    except (OSError, ValueError, RecursionError):
        return None


def write_atomic(path: str, document, mode: int = 0o600, dir_mode: int = 0o700) -> None:
    """Write `document` as JSON to `path` atomically; raises OSError (or TypeError for a
    document JSON cannot hold). The directory is made with `dir_mode` (gpuhook.cache.ensure_dir)."""
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


def write(path: str, document) -> bool:
    """Best-effort `write_atomic` for caches: False if it could not be written."""
    try:
        write_atomic(path, document)
        return True
    except (OSError, TypeError, ValueError):
        return False


def file_identity(st) -> list:
    """What changes whenever a file's content can have changed."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def config_cache_path(state_dir: str, config_path: str) -> str:
    """Where the parsed `config_path`, which names `state_dir`, is cached."""
    name = os.path.abspath(config_path).replace("%", "%25").replace("/", "%")
    return f"{state_dir}/{CONFIG_CACHE_DIR}/{name}.json"


def prune_config_cache(state_dir: str, keep: int = 64) -> None:
    """Drop cached configs whose file is gone, once there are more than `keep` of them."""
    directory = f"{state_dir}/{CONFIG_CACHE_DIR}"
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
