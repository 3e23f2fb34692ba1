"""What a start could not take back, exactly, and the reaper that takes it back later.

The namespace worker undoes its own work when a start fails (gpuhook.apply.nsworker). It cannot
when the hook had to kill it first (the deadline), and it cannot be killed at all while a
filesystem call holds it in the kernel (a volume or driver root that stopped answering:
SIGKILL waits for that call to return). Its journal (gpuhook.apply.order.Journal) says what it
had made and not undone. Then (docs/security.md, "A stalled filesystem"):

- a killed worker is gone: the hook removes what it left in the rootfs at once (`settle`);
- a stuck worker is not waited for: the hook writes a record (`<state-dir>/leftovers/`,
  root-only), logs exactly what is left, and ends on time. The record is reaped (`reap`) by
  the container's poststop, or by the next start on the same rootfs, once that worker is
  gone; until then a start on that rootfs is refused (exit 4), so nothing it makes can be
  mistaken for what the stuck start left.

Only entries of the rootfs are reaped, and only while each is still the very file, directory
or link the worker made (device, inode and change time, recorded when it was made), resolved
inside the rootfs on its own mount. What the worker made in the container's /dev and its mounts live in
the container's mount namespace and go with it.
"""

import errno
import os
import stat

from gpuhook.apply import statefiles
from gpuhook.apply.rootfs import lstat_here
from gpuhook.kernel import files, paths
from gpuhook.kernel import procstat

DIRECTORY = "leftovers"
MAX_RECORDS = 256  # records looked at by one reap


def directory(state_dir: str) -> str:
    return f"{state_dir}/{DIRECTORY}"


def settle(worker, rootfs: str, container_id: str, state_dir: str, log: dict) -> str:
    """After a worker was killed before it undid its work: take back what it left in the
    rootfs now (it is gone), or record it for `reap` (it is stuck). Notes the outcome in
    `log` (the hook's log line) and returns a short text for the error's hint."""
    entries, overflowed = worker.journal()
    if worker.stuck:
        stat_ = procstat.read_stat(worker.pid)
        left = {"container": container_id, "rootfs": rootfs, "rootfs_identity": _identity(rootfs),
                "worker": worker.pid, "worker_start_time": stat_.start_time if stat_ else 0,
                "boot_id": files.boot_id(), "step": worker.step(), "entries": entries, "overflowed": overflowed}
        where = directory(state_dir)
        try:
            statefiles.write_atomic(f"{where}/{procstat.entry_name(container_id)}.json", left)
            saved = f"recorded in {where} for the reaper (poststop, or the next start on this rootfs)"
        except (OSError, TypeError, ValueError) as err:
            saved = f"not recorded ({err}): remove it by hand once the worker is gone"
        log["left_behind"] = {"worker": worker.pid, "why": "stuck in the kernel after SIGKILL (a filesystem "
                                 "that does not answer); it ends when that call returns", "step": worker.step(),
                                 "made": [_shown(e) for e in entries], "journal_full": overflowed, "reaper": saved}
        return f"the namespace worker (pid {worker.pid}) is stuck in the kernel; what it left is in gpuhook's log"
    problems = take_back(rootfs, entries)
    log["left_behind"] = {"killed worker": worker.pid, "taken back": [_shown(e) for e in entries],
                             "problems": problems, "journal_full": overflowed}
    if problems or overflowed:
        return "the killed namespace worker left files behind: see gpuhook's log"
    return ""


def reap(state_dir: str, log: dict, container_id: str | None = None, rootfs: str | None = None) -> None:
    """Take back the leftovers recorded for `container_id`, or for the rootfs `rootfs`, whose
    worker is gone. A record whose worker is still stuck stays; for `rootfs` (a start about to
    use it) that refuses the start: HostError. A record whose worker is gone and whose rootfs
    is gone too (a snapshot the runtime removed) is dropped: nothing is left to take back.
    Notes what it did in `log`."""
    where = directory(state_dir)
    try:
        names = sorted(os.listdir(where))[:MAX_RECORDS]
    except OSError:
        return  # none: the usual case, one failed syscall
    identity = _identity(rootfs) if rootfs is not None else None
    for name in names:
        path = f"{where}/{name}"
        left = files.read(path)
        if not isinstance(left, dict) or not isinstance(left.get("entries"), list):
            continue
        ours = (container_id is not None and left.get("container") == container_id) or \
            (identity is not None and left.get("rootfs_identity") == identity)
        pid, start = left.get("worker"), left.get("worker_start_time")
        if left.get("boot_id") == files.boot_id() and isinstance(pid, int) and isinstance(start, int) and \
                procstat.is_alive(pid, start):
            if ours and rootfs is not None:
                from gpuhook.errors import HostError

                raise HostError(f"an earlier start on this rootfs (container {left.get('container')}) left its "
                                f"namespace worker (pid {pid}) stuck in the kernel; its leftovers are recorded in "
                                f"{path} and taken back once it is gone")
            if ours:
                log.setdefault("leftovers", []).append(f"{name}: worker {pid} still stuck; kept")
            continue
        there = isinstance(left.get("rootfs"), str) and _identity(left["rootfs"]) == left.get("rootfs_identity")
        if not ours and there:
            continue  # another container's: its poststop or the next start on its rootfs takes it back
        problems = take_back(left["rootfs"], left["entries"]) if there else []
        try:
            os.unlink(path)
        except OSError as err:
            problems.append(f"cannot remove the record: {err.strerror}")
        log.setdefault("leftovers", []).append(
            {"container": left.get("container"), "taken back": [_shown(e) for e in left["entries"]] if there else [],
             "rootfs": "there" if there else "gone", "problems": problems})


def take_back(rootfs: str, entries: list) -> list:
    """Undo the journal `entries` (oldest first) in the rootfs at `rootfs`, newest first,
    each only while it is still what the worker made. Returns problems; never raises."""
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        return [f"rootfs: {err.strerror}"]
    problems = []
    try:
        root_dev = os.fstat(root).st_dev
        for entry in reversed(entries):
            try:
                kind, path, name, extra, dev, ino, ctime = entry
                if dev != root_dev:
                    continue  # the container's /dev: gone with its mount namespace
                _take_back_one(root, kind, path, name, extra, (dev, ino, ctime))
            except (OSError, ValueError, TypeError) as err:
                problems.append(f"{_shown(entry)}: {err.strerror if isinstance(err, OSError) else err}")
    finally:
        os.close(root)
    return problems


def _take_back_one(root: int, kind: str, path: str, name: str, extra: str, made: tuple) -> None:
    parent_path, base = paths.split(path)
    if base != name:
        raise ValueError("inconsistent journal entry")
    try:
        parent = paths.open_in_root(root, parent_path, os.O_PATH | os.O_DIRECTORY, same_mount=True)
    except FileNotFoundError:
        return
    try:
        try:
            st = lstat_here(parent, name, path)
        except FileNotFoundError:
            return  # gone already
        # A directory's ctime changes with what is made in it (and rmdir takes only an empty
        # one); anything else must be unchanged since the worker made it: an inode number is
        # reused at once, its ctime is not.
        if (st.st_dev, st.st_ino) != made[:2] or (kind != "dir" and st.st_ctime_ns != made[2]):
            return  # not what the worker made (any more): never touched
        if kind == "dir":
            os.rmdir(name, dir_fd=parent)
        elif kind == "relink":
            temp = f".{name}.gpuhook"
            os.symlink(extra, temp, dir_fd=parent)
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        elif kind == "replaced" and extra:
            aside = lstat_here(parent, extra, f"{parent_path}/{extra}")
            if stat.S_ISDIR(aside.st_mode):
                raise OSError(errno.EISDIR, "the set-aside copy is a directory")
            os.rename(extra, name, src_dir_fd=parent, dst_dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def _identity(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _shown(entry) -> str:
    try:
        kind, path = entry[0], entry[1]
    except (TypeError, IndexError):
        return "?"
    return f"{kind} {path}"
