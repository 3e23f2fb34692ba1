"""What passes between the hook and its namespace worker: the order, the pipes, the shared page.

Both sides import this module and nothing of each other (gpuhook.apply.worker is the hook's
side, gpuhook.apply.nsworker the worker's), so the worker's child loads no code of its
parent's handle and the two never import each other. The exchange (docs/architecture.md,
"The namespace worker"):

- the order, hook -> worker: `encode_order` packs the container-side part of a plan as plain
  tuples with marshal (built in), length-prefixed on a pipe; `decode_order` unpacks it into
  the plan's records (gpuhook.plan.records) in the worker;
- the report, worker -> hook: one JSON line (at most REPORT_LIMIT bytes), then COMMIT or
  ABORT, one byte, hook -> worker;
- shared memory: the step the worker is on (`set_progress`, the first PROGRESS_BYTES) and
  after it the worker's `Journal` of what it made, which the hook reads whatever became of
  the worker.

Little beyond os here: the hook imports this module before it forks the worker, ahead of
the planning, on every GPU start.
"""

import marshal
import os

from gpuhook import fastjson
from gpuhook.record import record

PROGRESS_BYTES = 4096  # the shared page the worker names its current step in
JOURNAL_BYTES = 60 << 10  # after it: the worker's journal of what it made (`Journal`)
ORDER_LIMIT = 16 << 20  # an order is a few KiB; a bigger length prefix is a bug
REPORT_LIMIT = 16 << 20
COMMIT = b"c"
ABORT = b"a"
# How long past its own deadline (the hook's, less apply.CLEANUP_MARGIN) a worker waits for
# COMMIT or ABORT before it undoes its work itself: well after the hook is gone whatever
# happened (its backstop ends it within a second of its deadline).
COMMIT_WAIT = 4.0


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (a pipe may take it in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def set_progress(progress, step: str) -> None:
    data = step.encode("utf-8", "replace")[: PROGRESS_BYTES - 2]
    progress[0:2 + len(data)] = len(data).to_bytes(2, "little") + data


def read_exactly(fd: int, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def encode_order(plan, mntns: tuple, userns: tuple | None, proc_files: dict, deadline: float) -> bytes:
    """The part of `plan` the worker carries out, as plain data (`decode_order`).
    `mntns` and `userns` are the (st_dev, st_ino) of the namespaces the parent opened: the
    worker opens them again by pid and must find the same ones."""
    return marshal.dumps((
        plan.pid, plan.rootfs, plan.userns, plan.proc_in_rootfs, plan.dev_tmpfs,
        [tuple(n) for n in plan.nodes], [tuple(m) for m in plan.mounts], [tuple(s) for s in plan.symlinks],
        None if plan.proc_mask is None else tuple(plan.proc_mask),
        None if plan.ldcache is None else tuple(plan.ldcache),
        mntns, userns, proc_files, deadline,
    ))


def decode_order(data: bytes) -> tuple:
    """(Order, mount namespace id, user namespace id or None, /proc/driver/nvidia files,
    deadline) from `encode_order`'s bytes."""
    from gpuhook.plan.records import BindMount, DeviceNode, LdCacheUpdate, ProcMask, Symlink  # in the worker only

    (pid, rootfs, userns, proc_in_rootfs, dev_tmpfs, nodes, mounts, symlinks, proc_mask, ldcache,
     mntns, user_ns, proc_files, deadline) = marshal.loads(data)
    order = Order(pid, rootfs, userns, proc_in_rootfs, dev_tmpfs, tuple(DeviceNode(*n) for n in nodes),
                  tuple(BindMount(*m) for m in mounts), tuple(Symlink(*s) for s in symlinks),
                  None if proc_mask is None else ProcMask(*proc_mask),
                  None if ldcache is None else LdCacheUpdate(*ldcache))
    return order, mntns, user_ns, proc_files, deadline


class Order(record("Order", "pid rootfs userns proc_in_rootfs dev_tmpfs nodes mounts symlinks proc_mask ldcache")):
    """What the worker carries out: the plan's fields of the same names."""

    __slots__ = ()


class Journal:
    """What the worker made and has not undone, in memory shared with the hook (after the
    progress page): the hook can read it whatever became of the worker. The worker appends
    (`add`, from gpuhook.apply.rootfs.Changes), marks undone (`undone`) and clears it when it keeps its
    work (`clear`); the hook reads it (`entries`). Records: status byte (MADE or UNDONE), a
    length, then [kind, container path, name, extra, st_dev, st_ino, st_ctime_ns] as JSON."""

    MADE = 0x2B  # '+'
    UNDONE = 0x30  # '0'
    HEADER = 8  # u32 bytes used, u8 overflowed, padding

    def __init__(self, memory):
        self.memory = memory
        self.base = PROGRESS_BYTES

    def add(self, kind: str, path: str, parent_fd: int, name: str, extra: str):
        """Append a change just made (`name` in the directory `parent_fd`, at container path
        `path`); returns its token for `undone`, or None when the journal is full."""
        try:  # the entry's identity, so that it is only ever taken back if it is still the same
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            ident = [st.st_dev, st.st_ino, st.st_ctime_ns]  # ctime: an inode number is reused at once
        except OSError:
            ident = [0, 0, 0]
        data = fastjson.dumps([kind, path, name, extra, *ident]).encode("utf-8", "surrogateescape")
        used = int.from_bytes(self.memory[self.base:self.base + 4], "little")
        at = self.base + self.HEADER + used
        if at + 3 + len(data) > self.base + JOURNAL_BYTES:
            self.memory[self.base + 4] = 1
            return None
        self.memory[at + 1:at + 3 + len(data)] = len(data).to_bytes(2, "little") + data
        self.memory[at] = self.MADE
        self.memory[self.base:self.base + 4] = (used + 3 + len(data)).to_bytes(4, "little")
        return at

    def undone(self, token) -> None:
        if token is not None:
            self.memory[token] = self.UNDONE

    def clear(self) -> None:
        self.memory[self.base:self.base + 5] = bytes(5)

    def entries(self) -> tuple:
        """([kind, path, name, extra, st_dev, st_ino, st_ctime_ns] of each change still made, oldest
        first; whether the journal overflowed, so that more was made than it lists)."""
        used = min(int.from_bytes(self.memory[self.base:self.base + 4], "little"), JOURNAL_BYTES - self.HEADER)
        at, end, found = self.base + self.HEADER, self.base + self.HEADER + used, []
        while at + 3 <= end:
            size = int.from_bytes(self.memory[at + 1:at + 3], "little")
            if self.memory[at] == self.MADE:
                try:
                    found.append(fastjson.loads(bytes(self.memory[at + 3:at + 3 + size])))
                except ValueError:
                    pass
            at += 3 + size
        return found, bool(self.memory[self.base + 4])
