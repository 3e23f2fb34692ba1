"""Process identity from /proc (its stat, its cgroups), and file names for container ids: what
the health registry (gpuhook.health.registry) and the grant records (gpuhook.apply.grants) both
key their files by.
Standard library only and cheap to import: the grant record is on every v1 GPU start."""

import errno
import os

from gpuhook.record import record

ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ProcessStat(record("ProcessStat", "pid state ppid start_time flags")):
    """What gpuhook needs from /proc/<pid>/stat."""

    __slots__ = ()

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")


def read_stat(pid: int, proc: str = "/proc"):
    """ProcessStat of `pid`, or None when there is no such process."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
    except OSError:  # gone (ENOENT, ESRCH) or hidden from us: either way not a process we can judge
        return None
    # The command name is in parentheses and may itself hold spaces and parentheses.
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        # Fields after the name, from field 3 on: state, ppid, ..., flags (9), starttime (22).
        return ProcessStat(pid, fields[0], int(fields[1]), int(fields[19]), int(fields[6]))
    except ValueError:
        return None


def parse_cgroups(data: bytes) -> dict:
    """Controller name (or "" for the unified line) -> cgroup path, from the bytes of
    /proc/<pid>/cgroup (paths by os.fsdecode: a cgroup's name is whatever bytes its creator
    chose)."""
    paths, ids = {}, set()
    # Lines at newlines only: a carriage return in a cgroup's name forged a line when split as
    # text (attacker pass 21 did it in the mount table). The kernel writes a name as it is, a
    # newline too, so a line that repeats a hierarchy or a controller makes the whole file
    # ambiguous: ValueError, never the forged path.
    for line in data.split(b"\n"):
        parts = line.split(b":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        if number in ids:
            raise ValueError("a cgroup hierarchy is listed twice (a cgroup name holds a newline)")
        ids.add(number)
        path = os.fsdecode(path)
        names = [name.decode("ascii", "replace") for name in controllers.split(b",") if name] or [""]
        for name in names:
            if name in paths:
                raise ValueError("a cgroup controller is listed twice (a cgroup name holds a newline)")
            paths[name] = path
    return paths


def read_cgroups(pid, proc: str = "/proc") -> dict:
    """`parse_cgroups` of process `pid` (or "self"). Raises OSError (FileNotFoundError when
    there is no such process)."""
    with open(f"{proc}/{pid}/cgroup", "rb") as f:
        data = f.read(1 << 16)
    try:
        return parse_cgroups(data)
    except ValueError as err:
        raise OSError(errno.EINVAL, str(err)) from None


def entry_name(container_id: str) -> str:
    """A file name for a container id: the id itself when it is a plain token, else a hash."""
    if 0 < len(container_id) <= 128 and set(container_id) <= ID_CHARS and not container_id.startswith("."):
        return container_id
    import hashlib

    return "sha256-" + hashlib.sha256(container_id.encode("utf-8", "surrogateescape")).hexdigest()


def is_alive(pid: int, start_time: int, proc: str = "/proc") -> bool:
    """True while the process `pid` that started at `start_time` runs: same pid, same start
    time (a reused pid has another), not a zombie."""
    stat = read_stat(pid, proc)
    return stat is not None and not stat.zombie and stat.start_time == start_time
