"""Starts gpuhook has already served, so that a second hook entry of the same start is a no-op.

One container can carry gpuhook twice: containerd's base spec registers it as a prestart hook
and a CDI spec (`gpuhook cdi generate`) as a createRuntime hook, and each brings a poststop
(docs/packaging.md, "containerd"). runc runs prestart and then createRuntime for the same
init, one after the other; then both poststops at delete. The first entry of each kind does
the work; the others find this record and do nothing: no planning, no health prepare, no
second cleanup.

A start is named by its init's kernel identity, not by the container id alone (another
runtime root can run a container of the same id): `<state-dir>/served/<id>@<pid>-<start>.json`,
with `start` the init's start time (/proc/<pid>/stat field 22, which a reused pid does not
share), the boot id, the stage that served it, and `stopped` once a poststop cleaned up after
it. Written while the start's worker works (gpuhook.apply.run) and removed if the start
fails: a failed start aborts the container, so no second entry of it runs. A start its
backstop ends at the deadline leaves its record; it names only that start's init, which the
runtime then kills, and is pruned with the other records of gone inits. Root-owned, 0600 in a 0700 directory, read only when trusted (gpuhook.apply.statefiles);
a forged record could only make gpuhook skip a start, which then has no GPU at all.

Records of gone inits are pruned when a start is recorded and more than PRUNE_ABOVE are there
(so a start reads no other record on a node with fewer GPU containers): at once when a poststop
marked them stopped, else after PRUNE_AFTER seconds (a container's delete, and with it its
poststops, can come long after its init exited). A prune reads every record, so it runs at most
once every PRUNE_EVERY seconds (the mtime of PRUNED, touched by each prune): otherwise, on a
node with many recent records, every GPU start would read hundreds of them (benchmarks/RESULTS.md
measured 342 reads, several ms, per start).
"""

import os
import time

from gpuhook.apply import statefiles
from gpuhook.kernel import files
from gpuhook.kernel import procstat

DIRECTORY = "served"
PRUNE_AFTER = 3600
PRUNE_ABOVE = 128
MAX_PRUNED = 1024
PRUNE_EVERY = 60  # seconds between two prunes
PRUNED = ".pruned"  # in the directory: its mtime is when the last prune ran


def _directory(state_dir: str) -> str:
    return f"{state_dir}/{DIRECTORY}"


def _path(state_dir: str, container_id: str, pid: int, start_time: int) -> str:
    return f"{_directory(state_dir)}/{procstat.entry_name(container_id)}@{pid}-{start_time}.json"


def start_of(pid: int, proc: str = "/proc") -> int | None:
    """The start time of the live init `pid`, or None."""
    stat = procstat.read_stat(pid, proc) if pid > 0 else None
    return None if stat is None or stat.zombie else stat.start_time


def served_by(state_dir: str, container_id: str, pid: int, proc: str = "/proc") -> str | None:
    """The stage that already served the start whose init is `pid`, or None."""
    start = start_of(pid, proc)
    if start is None:
        return None
    doc = files.read(_path(state_dir, container_id, pid, start), 4096)
    if not isinstance(doc, dict) or doc.get("id") != container_id or doc.get("boot_id") != files.boot_id():
        return None
    return str(doc.get("stage"))


def save(state_dir: str, container_id: str, pid: int, stage: str, proc: str = "/proc") -> str | None:
    """Remember that `stage` serves this start: the record's path, or None where it could not
    be written (best effort; raises nothing)."""
    start = start_of(pid, proc)
    if start is None:
        return None
    path = _path(state_dir, container_id, pid, start)
    try:
        statefiles.write_atomic(path, {"id": container_id, "pid": pid, "start_time": start,
                                       "boot_id": files.boot_id(), "stage": stage, "stopped": False})
    except (OSError, TypeError, ValueError):
        return None
    _prune(state_dir, proc)
    return path


def stop(state_dir: str, container_id: str, pid: int, proc: str = "/proc") -> tuple:
    """At poststop: the records of this container's gone inits (`pid` narrows them when the
    runtime gave one), as (path, document). Raises nothing."""
    directory = _directory(state_dir)
    prefix = procstat.entry_name(container_id) + "@"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".json")]
    except OSError:
        return ()
    found = []
    for name in names:
        doc = files.read(f"{directory}/{name}", 4096)
        if not isinstance(doc, dict) or doc.get("id") != container_id or doc.get("boot_id") != files.boot_id():
            continue
        try:
            init, start = int(doc["pid"]), int(doc["start_time"])
        except (KeyError, TypeError, ValueError):
            continue
        if (pid > 0 and init != pid) or procstat.is_alive(init, start, proc):
            continue  # another start of this id, or one still running: not this stop
        found.append((f"{directory}/{name}", doc))
    return tuple(found)


def mark_stopped(path: str, doc: dict) -> None:
    """Remember that a poststop cleaned up after this start (best effort)."""
    try:
        statefiles.write_atomic(path, {**doc, "stopped": True})
    except (OSError, TypeError, ValueError):
        pass


def _prune(state_dir: str, proc: str) -> None:
    directory = _directory(state_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    if len(names) <= PRUNE_ABOVE:
        return
    now = time.time()
    stamp = f"{directory}/{PRUNED}"
    try:
        if 0 <= now - os.lstat(stamp).st_mtime < PRUNE_EVERY:
            return
    except OSError:
        pass
    try:
        statefiles.write_atomic(stamp, {})
    except (OSError, TypeError, ValueError):
        return  # no stamp, no prune: a start never pays for one on every call
    names = [n for n in names if n != PRUNED][:MAX_PRUNED]
    for name in names:
        path = f"{directory}/{name}"
        doc = files.read(path, 4096)
        try:
            alive = procstat.is_alive(int(doc["pid"]), int(doc["start_time"]), proc)
            stopped = doc.get("stopped") is True or doc.get("boot_id") != files.boot_id()
        except (KeyError, TypeError, ValueError):
            alive, stopped = False, True
        try:
            if not alive and (stopped or now - os.lstat(path).st_mtime > PRUNE_AFTER):
                statefiles.remove(path)
        except OSError:
            continue
