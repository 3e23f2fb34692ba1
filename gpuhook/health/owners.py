"""Who owns each process NVML lists on a GPU: a live container, the host, or nobody.

NVML reports host pids. Each is looked up in /proc and put in one of these classes
(docs/health.md, "Who owns a GPU process"):

    container        a registered container's, whose init is alive (registry.belongs: its
                     exact cgroups by inode, its pid namespace, started after its init)
    other container  in other pid or mount namespaces than gpuhook's and not registered:
                     a container someone else started; treated as live, never killed
    host             in gpuhook's own pid and mount namespaces
    orphan           a registered container's (registry.belongs), and that container is gone
    zombie           exited, not yet reaped; its parent is looked at instead (a zombie whose
                     other threads still run has not exited: it is judged by a running thread)
    killed           a process this run killed, now a zombie its parent has not reaped yet:
                     its files, GPU context included, were closed when it exited
    gone             the pid no longer exists, yet NVML still lists it (a context left behind)

The host's init (pid 1) is a host process even when gpuhook runs in a mount namespace of
its own (a DaemonSet pod, a private-namespace test), and a process that exits between two
reads of its /proc files is judged by what it became (gone or a zombie), never as a live
"other container".

Only orphans are ever killed (and the orphan parent of a zombie, which is how a zombie gets
reaped). Everything else that is alive counts as a user of the GPU, which then is never
reset. Because NVML's pids are host pids, attribution needs the host's pid namespace
(`in_host_pid_namespace`).
"""

import os
from enum import Enum

from gpuhook.health import registry
from gpuhook.record import record

PF_KTHREAD = 0x00200000  # task flag of kernel threads (include/linux/sched.h)


class Owner(str, Enum):
    CONTAINER = "container"
    OTHER_CONTAINER = "other container"
    HOST = "host"
    ORPHAN = "orphan"
    ZOMBIE = "zombie"
    KILLED = "killed"
    GONE = "gone"


LIVE = frozenset({Owner.CONTAINER, Owner.OTHER_CONTAINER, Owner.HOST})


class Attributed(record("Attributed", "pid kind used_memory owner container start_time reaper detail")):
    """A GPU process with its owner. `container` is the registry entry it belongs to (or
    None); `start_time` identifies the process for a later kill; `reaper` is, for a zombie,
    the orphan parent whose death gets it reaped (a ProcessStat), else None; `detail` is
    the owner in words, for messages."""

    __slots__ = ()

    @property
    def live(self) -> bool:
        return self.owner in LIVE


class Namespaces(record("Namespaces", "pid mnt")):
    __slots__ = ()


def namespaces(pid, proc: str = "/proc"):
    """The pid and mount namespace identities of `pid` ("self" works), or None if unreadable."""
    try:
        return Namespaces(os.readlink(f"{proc}/{pid}/ns/pid"), os.readlink(f"{proc}/{pid}/ns/mnt"))
    except OSError:
        return None


def in_host_pid_namespace(proc: str = "/proc") -> bool:
    """True when this process sees the host's pids: only there is pid 2 the kernel thread
    kthreadd (a flag no user process can have, under a name any process could take)."""
    stat = registry.read_stat(2, proc)
    return stat is not None and stat.ppid == 0 and bool(stat.flags & PF_KTHREAD)


class Attributor:
    """Attributes pids against one snapshot of the registry (read once per check run)."""

    def __init__(self, containers, proc: str = "/proc", starting: tuple | None = None, mounts=None):
        self.proc = proc
        self.containers = tuple(containers)
        # The container being started, (id, init pid): its own entry (a re-run hook) is no
        # owner. Another container of the same id (another runtime root) still is.
        self.starting = starting
        self.mounts = registry.cgroup_mounts(proc) if mounts is None else mounts
        self.mine = namespaces("self", proc)
        self._alive = {}
        self._killed = set()  # (pid, start time) of what this run killed; shared by the GPUs' threads

    def killed(self, pid: int, start_time: int) -> None:
        """Note that this run killed process `pid` (started at `start_time`): if it is still a
        zombie at the next look, its parent just has not reaped it yet."""
        self._killed.add((pid, start_time))

    def alive(self, container) -> bool:
        key = (container.id, container.pid, container.start_time)
        if key not in self._alive:
            self._alive[key] = registry.is_alive(container, self.proc)
        return self._alive[key]

    def belongs(self, container, pid: int, stat=None, cgroups=None) -> bool:
        """Whether `pid` is `container`'s now (registry.belongs), as the kill checks it again."""
        return registry.belongs(container, pid, self.proc, self.mounts, stat, cgroups)

    def owner_of(self, pid: int):
        """(Owner, registry entry or None, ProcessStat or None, detail) for a live pid."""
        stat = registry.read_stat(pid, self.proc)
        if stat is None:
            return Owner.GONE, None, None, "no such process"
        where = pid
        if stat.zombie:
            # A process keeps its files (GPU contexts included) until its last thread exits; a
            # thread-group leader that exited while other threads run shows as a zombie but
            # has not exited: judge it by a running thread (its namespaces went with the leader).
            where = _running_thread(pid, self.proc)
            if where is None:
                if (pid, stat.start_time) in self._killed:
                    return Owner.KILLED, None, stat, f"killed, not yet reaped by its parent pid {stat.ppid}"
                return Owner.ZOMBIE, None, stat, f"zombie, parent pid {stat.ppid}"
        cgroups = registry.read_cgroups(where, self.proc)
        if cgroups is None and where != pid:
            return Owner.OTHER_CONTAINER, None, stat, "cgroup unreadable"
        if cgroups is None:
            # Exited between the two reads, or /proc hides it: never a kill candidate.
            return self._vanished(pid, stat) or (Owner.OTHER_CONTAINER, None, stat, "cgroup unreadable")
        holders = [c for c in self.containers if (c.id, c.pid) != self.starting and self.belongs(c, pid, stat, cgroups)]
        if holders:
            # A live holder always wins, so a live container's process is never anyone's orphan.
            live = [c for c in holders if self.alive(c)]
            if live:
                return Owner.CONTAINER, live[0], stat, f"container {live[0].label()}"
            container = holders[0]
            return Owner.ORPHAN, container, stat, (f"left over from container {container.label()}, "
                                                   f"whose init (pid {container.pid}) is gone")
        if pid == 1:
            # NVML's pids are host pids (the engine checks it runs in the host's pid namespace).
            return Owner.HOST, None, stat, "the host's init"
        theirs = namespaces(where, self.proc)
        if theirs is None and where == pid:
            vanished = self._vanished(pid, stat)
            if vanished is not None:
                return vanished
        elif theirs is not None and self.mine is not None and theirs == self.mine:
            return Owner.HOST, None, stat, "host process"
        return Owner.OTHER_CONTAINER, None, stat, "a container gpuhook did not start"

    def _vanished(self, pid: int, before):
        """What `pid` became if it exited since `before` was read: the owner_of answer for a
        process now gone or a zombie, else None (it is still there, only unreadable)."""
        now = registry.read_stat(pid, self.proc)
        if now is None or now.start_time != before.start_time:
            return Owner.GONE, None, None, "exited during the check"
        if now.zombie:
            return self.owner_of(pid)
        return None

    def attribute(self, processes) -> tuple:
        """An Attributed for each nvml.Process."""
        found = []
        for process in processes or ():
            owner, container, stat, detail = self.owner_of(process.pid)
            reaper = None
            if owner is Owner.ZOMBIE:
                parent_owner, parent_container, parent_stat, parent_detail = self.owner_of(stat.ppid)
                if parent_owner is Owner.ORPHAN:
                    reaper, container = parent_stat, parent_container
                    detail = f"zombie whose parent pid {stat.ppid} is {parent_detail}"
                else:
                    detail = f"zombie not reaped by its parent pid {stat.ppid} ({parent_detail})"
            found.append(Attributed(process.pid, process.kind, process.used_memory, owner, container,
                                    stat.start_time if stat is not None else None, reaper, detail))
        return tuple(found)


def _running_thread(pid: int, proc: str):
    """The /proc path "<pid>/task/<tid>" of a thread of `pid` that has not exited, or None."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        if tid == str(pid) or not tid.isdigit():
            continue
        thread = registry.read_stat(f"{pid}/task/{tid}", proc)
        if thread is not None and not thread.zombie:
            return f"{pid}/task/{tid}"
    return None
