"""Files read without trusting them: bounded, never blocking, and gpuhook's own state only when
it can only have been written by root.

`read_regular_file` reads a file an image, a runtime or a user controls (config.json, a CDI
spec, a cgroup file) without letting a FIFO or a device hold the hook. `read_trusted` and
`read` read gpuhook's own state files (caches, records, reports) and refuse one that anyone
but root could have written: a planted or forged file reads as missing. Nothing here writes;
gpuhook.apply.statefiles writes the state files.
"""

import errno
import os

from gpuhook import fastjson
BOOT_ID = "/proc/sys/kernel/random/boot_id"
_S_IFMT, _S_IFREG = 0o170000, 0o100000


def read_regular_file(path: str, limit: int, flags: int = 0, with_stat: bool = False):
    """Up to `limit` bytes of the regular file at `path` (and its stat, `with_stat`). Opened
    non-blocking and checked before reading: a FIFO or a device there (a bundle path the
    runtime took from a user) must not block the hook until the runtime kills it. `flags`
    are added to the open (O_NOFOLLOW where a planted symlink must not be followed). Raises
    OSError (EINVAL for a file that is not regular). The one reader of files gpuhook does not
    control; gpuhook.prescan keeps its own copy for the no-GPU path, which loads no package
    (tests/unit/test_files.py holds the two to the same answers). Uses the built-in posix
    module: nothing is imported."""
    import posix

    fd = posix.open(path, posix.O_RDONLY | posix.O_NONBLOCK | posix.O_CLOEXEC | flags)
    st = posix.fstat(fd)
    if st.st_mode & _S_IFMT != _S_IFREG:
        posix.close(fd)
        raise OSError(22, "not a regular file", path)
    with open(fd, "rb") as f:
        data = f.read(limit)
    return (data, st) if with_stat else data



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


def file_identity(st) -> list:
    """What changes whenever a file's content can have changed."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def proc_field(path: str, key: bytes) -> bytes:
    """The value of the line `key` (e.g. b"mnt_id:") in a small /proc file of "key: value"
    lines (fdinfo, status): one read of at most 8 KiB. OSError (EIO) when it has no such line."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 8192)
    finally:
        os.close(fd)
    if data.startswith(key):
        start = len(key)
    else:
        at = data.find(b"\n" + key)
        if at < 0:
            raise OSError(5, f"no {key.decode()} line")
        start = at + 1 + len(key)
    end = data.find(b"\n", start)
    return data[start:end if end >= 0 else len(data)].strip()
