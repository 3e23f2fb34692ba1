"""Small JSON caches under /run, so an unchanged host is never read twice the expensive way.

Two things are cached, each keyed by everything that could change its content:

- the parsed configuration file, keyed by the file's identity and timestamps (tomllib and
  its imports cost more than the rest of the hook's decision);
- the host inventory (gpuhook.inventory), keyed by driver version, boot id and the cheap
  fingerprints of what the expensive reads depend on.

Files are written to a temporary name and renamed into place, so readers see the old file
or the new one, never half of one; anything unreadable, damaged or stale is simply rebuilt.
Caching is best effort: a cache that cannot be written never fails a container start.
"""

from gpuhook import fastjson
import os

CONFIG_CACHE_DIR = "/run/gpuhook/config-cache"


def read(path: str):
    """The JSON document at `path`, or None if missing or damaged."""
    try:
        with open(path, "rb") as f:
            return fastjson.loads(f.read(16 << 20))
    except (OSError, ValueError, RecursionError):
        return None


def write(path: str, document) -> bool:
    """Write `document` atomically (temp file + rename); False if it could not be written."""
    directory = os.path.dirname(path)
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, fastjson.dumps(document).encode())
        finally:
            os.close(fd)
        os.replace(temp, path)
        return True
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(temp)
        except OSError:
            pass
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
