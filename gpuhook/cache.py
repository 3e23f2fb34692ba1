"""gpuhook's JSON state files, and the caches built on them.

Every state file (caches, health reports, stamps, the container registry) is written to a
temporary name in its directory and renamed into place, so a reader sees the old document
or the new one, never half of one, and is read without following a symlink; a missing or
damaged file reads as None.

Two caches keep an unchanged host from being read twice the expensive way, each keyed by
everything that could change its content:

- the parsed configuration file, keyed by the file's identity and timestamps (tomllib and
  its imports cost more than the rest of the hook's decision), under /run/gpuhook;
- the host inventory (gpuhook.inventory) in <state-dir>, keyed by driver version, boot id
  and the cheap fingerprints of what the expensive reads depend on.

Caching is best effort: a cache that cannot be written never fails a container start.
"""

import os

from gpuhook import fastjson

CONFIG_CACHE_DIR = "/run/gpuhook/config-cache"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id ("" if unreadable): state from an earlier boot is never trusted."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def read(path: str, limit: int = 16 << 20):
    """The JSON document at `path`, or None if missing or damaged."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return fastjson.loads(f.read(limit))
    except (OSError, ValueError, RecursionError):
        return None


def write_atomic(path: str, document, mode: int = 0o600, dir_mode: int = 0o700) -> None:
    """Write `document` as JSON to `path` atomically; raises OSError (or TypeError for a
    document JSON cannot hold)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    temp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    data = (fastjson.dumps(document) + "\n").encode()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
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


def config_cache_path(config_path: str) -> str:
    name = os.path.abspath(config_path).replace("%", "%25").replace("/", "%")
    return f"{CONFIG_CACHE_DIR}/{name}.json"


def prune_config_cache(keep: int = 64) -> None:
    """Drop cached configs whose file is gone, once there are more than `keep` of them."""
    try:
        names = os.listdir(CONFIG_CACHE_DIR)
    except OSError:
        return
    if len(names) <= keep:
        return
    for name in names:
        entry = read(f"{CONFIG_CACHE_DIR}/{name}")
        source = entry.get("source") if isinstance(entry, dict) else None
        if not isinstance(source, str) or not os.path.exists(source):
            try:
                os.unlink(f"{CONFIG_CACHE_DIR}/{name}")
            except OSError:
                pass
