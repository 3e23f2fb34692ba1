"""What the health checks keep under <state-dir>/health: reports, stamps and per-GPU locks.

    <state-dir>/health/<uuid>.json          the latest report on a GPU (a device plugin reads it)
    <state-dir>/health/stamps/<uuid>.json   "prepared by gpuhook prepare": the hook may skip the GPU
    <state-dir>/health/locks/<uuid>.lock    flock(2) target: one check or reset of a GPU at a time
    <state-dir>/health/containers/          the registry of started containers (registry.py)

Files are written to a temporary name in the same directory and renamed into place, so a
reader sees the old document or the new one, never half of one. Names come from GPU UUIDs,
which are checked to be plain tokens before they become part of a path. Stamps carry the
boot id and CLOCK_BOOTTIME, so a stamp survives no reboot and no change of the wall clock.
The formats are in docs/health.md.
"""

import fcntl
import os
import time

from gpuhook import cache
from gpuhook.cache import boot_id  # noqa: F401  (re-exported: reports, stamps and the registry use it)
from gpuhook.discover import is_uuid
from gpuhook.errors import InputError

FORMAT = 1


def health_dir(state_dir: str) -> str:
    return f"{state_dir}/health"


def checked_uuid(uuid: str) -> str:
    """`uuid` if it is a GPU or MIG UUID safe to use in a file name; InputError otherwise."""
    if not is_uuid(uuid):
        raise InputError(f"{str(uuid)[:100]!r} is not a GPU UUID (GPU-... or MIG-...)")
    return uuid


def report_path(state_dir: str, uuid: str) -> str:
    return f"{health_dir(state_dir)}/{checked_uuid(uuid)}.json"


def stamp_path(state_dir: str, uuid: str) -> str:
    return f"{health_dir(state_dir)}/stamps/{checked_uuid(uuid)}.json"


def lock_path(state_dir: str, uuid: str) -> str:
    return f"{health_dir(state_dir)}/locks/{checked_uuid(uuid)}.lock"


def boottime() -> float:
    """Seconds since boot, suspend included: comparable between processes, immune to clock changes."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write_json(path: str, document, mode: int = 0o600) -> None:
    """Write `document` to `path` atomically (gpuhook.cache), readable by root only (reports
    and registry entries name pods, pids and GPUs). Raises OSError; the caller decides
    whether that matters."""
    cache.write_atomic(path, document, mode=mode, dir_mode=0o700)


def read_json(path: str):
    """The JSON document at `path`, or None when it is missing or damaged."""
    return cache.read(path, limit=1 << 20)


# --- reports --------------------------------------------------------------------------------

def write_report(state_dir: str, document: dict) -> None:
    """Replace the report of GPU document["uuid"]."""
    write_json(report_path(state_dir, document["uuid"]), document)


def read_report(state_dir: str, uuid: str):
    """The latest report on GPU `uuid`, or None."""
    return read_json(report_path(state_dir, uuid))


# --- stamps ---------------------------------------------------------------------------------

def write_stamp(state_dir: str, uuid: str, status: str, by: str = "prepare") -> dict:
    """Leave a stamp saying GPU `uuid` was checked (and repaired if needed) just now."""
    stamp = {"format": FORMAT, "uuid": uuid, "status": status, "by": by, "pid": os.getpid(),
             "boot_id": boot_id(), "boottime": round(boottime(), 3),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(stamp_path(state_dir, uuid), stamp, mode=0o600)
    return stamp


class StampClaim:
    """What claiming a GPU's stamp found: `fresh` lets the hook skip the GPU; `why` says why
    not (or how old the stamp was) for the log."""

    def __init__(self, fresh: bool, why: str, age: float | None = None):
        self.fresh = fresh
        self.why = why
        self.age = age


def claim_stamp(state_dir: str, uuid: str, ttl: float) -> StampClaim:
    """Take GPU `uuid`'s stamp away (so it serves one start) and say whether it was fresh.

    The stamp is renamed to a name of our own before it is read: of two hooks racing for
    one stamp exactly one gets it, and the other does the checks itself.
    """
    path = stamp_path(state_dir, uuid)
    taken = f"{path}.claimed.{os.getpid()}.{time.monotonic_ns()}"
    try:
        os.rename(path, taken)
    except FileNotFoundError:
        return StampClaim(False, "no stamp")
    except OSError as err:
        return StampClaim(False, f"stamp not usable: {err.strerror}")
    try:
        stamp = read_json(taken)
    finally:
        try:
            os.unlink(taken)
        except OSError:
            pass
    if not isinstance(stamp, dict) or stamp.get("uuid") != uuid or stamp.get("format") != FORMAT:
        return StampClaim(False, "stamp damaged")
    if stamp.get("boot_id") != boot_id():
        return StampClaim(False, "stamp from another boot")
    made = stamp.get("boottime")
    if isinstance(made, bool) or not isinstance(made, (int, float)):
        return StampClaim(False, "stamp damaged")
    age = boottime() - made
    if age < -1.0:  # from the future: not this boot's clock
        return StampClaim(False, "stamp from the future", age)
    if age >= ttl:
        return StampClaim(False, f"stamp {age:.1f} s old (stamp-ttl-seconds {ttl:g})", age)
    return StampClaim(True, f"fresh stamp from {stamp.get('by', '?')} {max(age, 0.0):.1f} s old", age)


# --- locks ----------------------------------------------------------------------------------

class GpuLock:
    """An exclusive flock on <state-dir>/health/locks/<uuid>.lock, taken with a time limit.

    flock has no timeout of its own; acquire() polls LOCK_NB with short, growing sleeps,
    which also lets the caller notice its deadline. The kernel drops the lock when the
    holder exits, so a killed hook never leaves a GPU locked.
    """

    def __init__(self, state_dir: str, uuid: str):
        self.path = lock_path(state_dir, uuid)
        self.fd = -1

    def acquire(self, until: float, cancelled=None) -> bool:
        """True once held; False when monotonic time `until` passed (or `cancelled()` said so)
        first. Raises OSError when the lock file cannot be opened."""
        cache.ensure_dir(os.path.dirname(self.path), 0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        pause = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fd = fd
                return True
            except BlockingIOError:
                pass
            except OSError:
                os.close(fd)
                raise
            left = until - time.monotonic()
            if left <= 0 or (cancelled is not None and cancelled()):
                os.close(fd)
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1
