"""The mount table of the caller's mount namespace (/proc/self/mountinfo), parsed.

Used where the hook must know how a mount is set up before it acts on it: whether the mount
it attaches a mount to propagates mounts to other namespaces (a `shared:` peer group), which
filesystem a mount point it meets belongs to (before it asks that filesystem anything), and
which mounts the ldconfig sandbox must detach. Fields are described in proc_pid_mountinfo(5).
"""

import os

LIMIT = 16 << 20  # a mount table larger than this is refused, not read without bound


class MountEntry:
    """One line of mountinfo: `id`, `parent`, `dev` (the filesystem's device number, as
    st_dev), mount `point` (unescaped), per-mount `options` (bytes, e.g. b"ro"), `shared`
    (whether it is in a peer group) and `fstype`."""

    __slots__ = ("id", "parent", "dev", "point", "options", "shared", "fstype")

    def __init__(self, line: bytes):
        fields = line.split()
        dash = fields.index(b"-")
        self.id = int(fields[0])
        self.parent = int(fields[1])
        major, _, minor = fields[2].partition(b":")
        self.dev = os.makedev(int(major), int(minor))
        self.point = unescape(fields[4])
        self.options = tuple(fields[5].split(b","))
        self.shared = any(f.startswith(b"shared:") for f in fields[6:dash])
        self.fstype = fields[dash + 1].decode("ascii", "replace")


def unescape(field: bytes) -> str:
    """mountinfo writes space, tab, newline and backslash as a backslash and three octal digits."""
    out, i = bytearray(), 0
    while i < len(field):
        octal = field[i + 1:i + 4]
        if field[i] == 0x5C and len(octal) == 3 and all(0x30 <= c <= 0x37 for c in octal):
            out.append(int(octal, 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return os.fsdecode(bytes(out))


def read(fd: int | None = None) -> list:
    """The mounts of the caller's namespace; `fd` is an open mountinfo file to read again
    from its start (it shows the table as it is at the time of reading)."""
    own = fd is None
    if own:
        fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
            if len(data) > LIMIT:
                raise OSError(27, "the mount table is too large")  # EFBIG
    finally:
        if own:
            os.close(fd)
    return [MountEntry(line) for line in data.splitlines() if line]


def subtree(mounts: list, top_id: int) -> list:
    """The mounts at and below the mount `top_id`."""
    children: dict = {}
    for m in mounts:
        children.setdefault(m.parent, []).append(m)
    found, todo = [], [m for m in mounts if m.id == top_id]
    while todo:
        m = todo.pop()
        found.append(m)
        todo += [c for c in children.get(m.id, ()) if c.id != m.id]
    return found


def mount_id(fd: int) -> int:
    """The id of the mount an open fd is on (its `mnt_id` in /proc/self/fdinfo)."""
    info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(info, 4096)
    finally:
        os.close(info)
    start = data.find(b"mnt_id:")
    if start < 0:
        raise OSError(5, "fdinfo has no mnt_id")
    return int(data[start + 7:data.index(b"\n", start)])
