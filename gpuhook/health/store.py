"""What the health checks keep under <state-dir>/health: reports, stamps and per-GPU locks.

    <state-dir>/health/<uuid>.json          the latest report on a GPU (a device plugin reads it)
    <state-dir>/health/stamps/<uuid>@<allocation>.json   "prepared for that allocation": the
                                            start that carries the allocation may skip the GPU
    <state-dir>/health/locks/<uuid>.lock    flock(2) target: one check or reset of a GPU at a time
    <state-dir>/health/containers/          the registry of started containers (registry.py)

Files are written to a temporary name in the same directory and renamed into place, so a
reader sees the old document or the new one, never half of one. Names come from GPU UUIDs,
which are checked to be plain tokens before they become part of a path. Stamps carry the
boot id and CLOCK_BOOTTIME, so a stamp survives no reboot and no change of the wall clock.
A stamp is made for one allocation (a device plugin's Allocate hands the container a token
as a /dev/null bind mount, which an image cannot add) and only a start carrying that token
can claim it: a stamp nobody claims never lets another start skip its checks. The formats
are in docs/health.md.
"""

import fcntl
import os
import time

from gpuhook.apply import statefiles
from gpuhook.kernel import files
from gpuhook.kernel.files import boot_id  # noqa: F401  (re-exported: reports, stamps and the registry use it)
from gpuhook.driver import is_uuid
from gpuhook.errors import InputError

FORMAT = 2  # 2: stamps carry the allocation they were made for

# In the container: a read-only bind of /dev/null at ALLOCATION_ROOT/<token> is the token of
# the device plugin's allocation (docs/device-plugin.md, "Stamps bound to the allocation").
ALLOCATION_ROOT = "/var/run/gpuhook-allocation"
TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
MIN_TOKEN, MAX_TOKEN = 16, 128
MAX_TOKENS = 8  # tokens one start may carry (one per allocation; more is not a kubelet's doing)


def health_dir(state_dir: str) -> str:
    return f"{state_dir}/health"


def checked_uuid(uuid: str) -> str:
    """`uuid` if it is a GPU or MIG UUID safe to use in a file name; InputError otherwise."""
    if not is_uuid(uuid):
        raise InputError(f"{str(uuid)[:100]!r} is not a GPU UUID (GPU-... or MIG-...)")
    return uuid


def report_path(state_dir: str, uuid: str) -> str:
    return f"{health_dir(state_dir)}/{checked_uuid(uuid)}.json"


def is_token(text) -> bool:
    """Whether `text` has the form of an allocation token: 16 to 128 letters, digits, `-`, `_`."""
    return isinstance(text, str) and MIN_TOKEN <= len(text) <= MAX_TOKEN and set(text) <= TOKEN_CHARS


def checked_token(token: str) -> str:
    """`token` if it is an allocation token safe to use in a file name; InputError otherwise."""
    if not is_token(token):
        raise InputError(f"{str(token)[:40]!r} is not an allocation token ({MIN_TOKEN} to {MAX_TOKEN} letters, "
                         "digits, - or _)")
    return token


def stamps_dir(state_dir: str) -> str:
    return f"{health_dir(state_dir)}/stamps"


def stamp_path(state_dir: str, uuid: str, allocation: str) -> str:
    return f"{stamps_dir(state_dir)}/{checked_uuid(uuid)}@{checked_token(allocation)}.json"


def allocation_tokens(mounts) -> tuple:
    """The allocation tokens a container carries: the names under ALLOCATION_ROOT of its
    spec's bind mounts of /dev/null (oci.Mount records). Only the runtime adds mounts, and
    the device plugin's tokens are random, so an image cannot claim a stamp made for another
    allocation; a tmpfs, a volume or any other source at that path is no token. At most
    MAX_TOKENS, in the spec's order."""
    prefix = ALLOCATION_ROOT + "/"
    tokens = []
    for mount in mounts:
        dest = "/" + "/".join(p for p in mount.destination.split("/") if p and p != ".")
        if dest.startswith("/run/"):
            dest = "/var" + dest  # /var/run is a link to /run in most images
        name = dest[len(prefix):] if dest.startswith(prefix) else ""
        is_bind = mount.type == "bind" or "bind" in mount.options or "rbind" in mount.options
        if is_token(name) and mount.source == "/dev/null" and is_bind and name not in tokens:
            tokens.append(name)
            if len(tokens) == MAX_TOKENS:
                break
    return tuple(tokens)


def lock_path(state_dir: str, uuid: str) -> str:
    return f"{health_dir(state_dir)}/locks/{checked_uuid(uuid)}.lock"


def boottime() -> float:
    """Seconds since boot, suspend included: comparable between processes, immune to clock changes."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def write_json(path: str, document, mode: int = 0o600) -> None:
    """Write `document` to `path` atomically (gpuhook.apply.statefiles), readable by root only (reports
    and registry entries name pods, pids and GPUs). Raises OSError; the caller decides
    whether that matters."""
    statefiles.write_atomic(path, document, mode=mode, dir_mode=0o700)


def read_json(path: str):
    """The JSON document at `path`, or None when it is missing or damaged."""
    return files.read(path, limit=1 << 20)


# --- reports --------------------------------------------------------------------------------

def write_report(state_dir: str, document: dict) -> None:
    """Replace the report of GPU document["uuid"]."""
    write_json(report_path(state_dir, document["uuid"]), document)


def read_report(state_dir: str, uuid: str):
    """The latest report on GPU `uuid`, or None."""
    return read_json(report_path(state_dir, uuid))


# --- stamps ---------------------------------------------------------------------------------

def write_stamp(state_dir: str, uuid: str, status: str, allocation: str, by: str = "prepare",
                ttl: float | None = None) -> dict:
    """Leave a stamp saying GPU `uuid` was checked (and repaired if needed) just now for the
    start that carries `allocation`. With `ttl`, the GPU's other stamps that can no longer be
    claimed (older than `ttl`, damaged, from another boot) are removed: stamps of starts
    that never came do not pile up."""
    path = stamp_path(state_dir, uuid, allocation)
    stamp = {"format": FORMAT, "uuid": uuid, "allocation": allocation, "status": status, "by": by,
             "pid": os.getpid(), "boot_id": boot_id(), "boottime": round(boottime(), 3),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(path, stamp, mode=0o600)
    if ttl is not None:
        _prune_stamps(state_dir, uuid, ttl, keep=os.path.basename(path))
    return stamp


def _prune_stamps(state_dir: str, uuid: str, ttl: float, keep: str) -> None:
    directory = stamps_dir(state_dir)
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(f"{uuid}@") and e.name != keep]
    except OSError:
        return
    for name in names:
        path = f"{directory}/{name}"
        if _judge(read_json(path), uuid, None, ttl).fresh:
            continue
        try:
            statefiles.remove(path)
        except OSError:
            pass


def last_stamped(state_dir: str) -> dict:
    """{GPU UUID: modification time of its newest stamp}: which GPUs were prepared lately."""
    times: dict = {}
    try:
        entries = list(os.scandir(stamps_dir(state_dir)))
    except OSError:
        return times
    for entry in entries:
        uuid, sep, _ = entry.name.partition("@")
        if not sep or not is_uuid(uuid):
            continue
        try:
            times[uuid] = max(times.get(uuid, 0.0), entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            pass
    return times


class StampClaim:
    """What claiming a GPU's stamp found: `fresh` lets the hook skip the GPU; `why` says why
    not (or how old the stamp was) for the log."""

    def __init__(self, fresh: bool, why: str, age: float | None = None):
        self.fresh = fresh
        self.why = why
        self.age = age


def claim_stamp(state_dir: str, uuid: str, ttl: float, allocations) -> StampClaim:
    """Take GPU `uuid`'s stamp made for one of `allocations` (the tokens this start carries)
    away, so it serves one start, and say whether it was fresh. A stamp made for another
    allocation is never looked at: it can serve only its own start.

    The stamp is renamed to a name of our own before it is read: of two hooks racing for
    one stamp exactly one gets it, and the other does the checks itself.
    """
    if not allocations:
        return StampClaim(False, "no stamp for this start (it carries no allocation token)")
    claim = StampClaim(False, "no stamp")
    for allocation in allocations:
        path = stamp_path(state_dir, uuid, allocation)
        taken = f"{path}.claimed.{os.getpid()}.{time.monotonic_ns()}"
        try:
            statefiles.claim(path, taken)
        except FileNotFoundError:
            continue
        except OSError as err:
            claim = StampClaim(False, f"stamp not usable: {err.strerror}")
            continue
        try:
            stamp = read_json(taken)
        finally:
            try:
                statefiles.remove(taken)
            except OSError:
                pass
        claim = _judge(stamp, uuid, allocation, ttl)
        if claim.fresh:
            break
    return claim


def _judge(stamp, uuid: str, allocation: str | None, ttl: float) -> StampClaim:
    """Whether `stamp` (a parsed stamp file) is GPU `uuid`'s, made for `allocation` (any when
    None), in this boot and less than `ttl` seconds ago."""
    if (not isinstance(stamp, dict) or stamp.get("uuid") != uuid or stamp.get("format") != FORMAT
            or (allocation is not None and stamp.get("allocation") != allocation)):
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
        fd = statefiles.open_lock(self.path)
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
