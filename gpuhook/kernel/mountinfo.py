"""The mount table of the caller's mount namespace (/proc/self/mountinfo), parsed: the one reader.

Used where the hook must know how a mount is set up before it acts on it: whether the mount
it attaches a mount to propagates mounts to other namespaces (a `shared:` peer group), which
filesystem a mount point it meets belongs to (before it asks that filesystem anything), which
mounts the ldconfig sandbox must detach, and where the cgroup hierarchies are mounted (the
device policy's placement, the health registry's kernel identities). Fields are described in
proc_pid_mountinfo(5).

The table is read as bytes: a mount point is whatever bytes its creator chose, and one name
that is not UTF-8 anywhere in the namespace must not make the table unreadable. Paths come
back as str by os.fsdecode (surrogate escapes), which os functions turn back into the same
bytes.
"""

import os

from gpuhook.kernel import files

LIMIT = 16 << 20  # a mount table larger than this is refused, not read without bound


class MountEntry:
    """One line of mountinfo: `id`, `parent`, `dev` (the filesystem's device number, as
    st_dev), `root` (the path of the filesystem the mount shows) and mount `point` (both
    unescaped), per-mount `options` (bytes, e.g. b"ro"), `shared` (whether it is in a peer
    group), `fstype` and `super_options` (the filesystem's, e.g. {"rw", "devices"} for a v1
    devices hierarchy). Raises ValueError for a line that is not one."""

    __slots__ = ("id", "parent", "dev", "root", "point", "options", "shared", "fstype", "super_options")

    def __init__(self, line: bytes):
        fields = line.split(b" ")  # only a space: `lines`
        dash = fields.index(b"-")
        if dash < 6 or len(fields) < dash + 3:
            raise ValueError("not a mountinfo line")
        self.id = int(fields[0])
        self.parent = int(fields[1])
        major, _, minor = fields[2].partition(b":")
        self.dev = os.makedev(int(major), int(minor))
        self.root = unescape(fields[3])
        self.point = unescape(fields[4])
        self.options = tuple(fields[5].split(b","))
        self.shared = any(f.startswith(b"shared:") for f in fields[6:dash])
        self.fstype = fields[dash + 1].decode("ascii", "replace")
        self.super_options = frozenset(os.fsdecode(o) for o in fields[dash + 3].split(b",")) \
            if len(fields) > dash + 3 else frozenset()


def unescape(field: bytes) -> str:
    """mountinfo writes space, tab, newline and backslash as a backslash and three octal digits."""
    if 0x5C not in field:  # nearly every field: a loop over its bytes cost ~40 µs a line
        return os.fsdecode(field)
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


def open_table(proc: str = "/proc") -> int:
    """A descriptor of the caller's mount table, for `read_bytes` to read again as it changes."""
    return os.open(f"{proc}/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)


def index(data: bytes) -> dict:
    """{mount id: its line} of a mount table, from each line's first field: a caller that needs
    a few entries parses just those (`MountEntry(line)`). A container's namespace, before its
    pivot, holds every mount of the host: on a node with a thousand pod volumes a full parse
    took 2.4 ms, and the namespace worker read the table twice per start."""
    lines = {}
    for line in _lines(data):
        try:
            lines[int(line.split(b" ", 1)[0])] = line
        except ValueError:
            continue
    return lines


def read_subtree(fd: int, top_id: int) -> list:
    """`subtree(parse(read_bytes(fd)), top_id)`, parsing in full only the lines of that subtree: the
    ldconfig sandbox reads the table of a container's namespace, which holds every mount of
    the host, three times per start, and a full parse of a few dozen lines cost ~0.5 ms each
    time. The subtree is found from each line's first two fields (mount id, parent id); every
    mount of it has its whole chain up to `top_id` among those lines, so `subtree` of them is
    `subtree` of the whole table."""
    lines = _lines(read_bytes(fd, "/proc"))
    heads, children = [], {}
    for line in lines:
        head = line.split(b" ", 2)
        try:
            mount, parent = int(head[0]), int(head[1])
        except (ValueError, IndexError):
            mount = parent = None  # not an entry: `parse` skips it too
        heads.append(mount)
        if parent is not None:
            children.setdefault(parent, []).append(mount)
    wanted, todo = set(), [top_id]
    while todo:
        mount = todo.pop()
        if mount not in wanted:
            wanted.add(mount)
            todo += children.get(mount, ())
    return subtree(parse(b"\n".join(line for line, mount in zip(lines, heads) if mount in wanted)), top_id)


def read_bytes(fd: int | None = None, proc: str = "/proc") -> bytes:
    """The caller's mount table as it is now, unparsed (`parse`, `index`, `cgroup_mounts_in`);
    `fd` is an open mountinfo file (`open_table`) to read again from its start (it shows the
    table as it is at the time of reading). Raises OSError."""
    own = fd is None
    if own:
        fd = open_table(proc)
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
    return data


def _lines(data: bytes) -> list:
    """The lines of a mount table: split at newlines only. The kernel escapes only space, tab,
    newline and backslash in a name (a mount's root and its mount point); a carriage return,
    vertical tab or form feed stays as it is. Split as text (`splitlines`, `split()`), a source
    directory named with them forged whole lines: a cgroup hierarchy "mounted" over another
    container's cgroup, and the GPU grant went there (attacker pass 21, A1). Fields are split at
    a space only, likewise."""
    return data.split(b"\n")


def parse(data: bytes) -> list:
    """The MountEntry of each line of a mount table (lines that are not entries are skipped)."""
    entries = []
    for line in _lines(data):
        try:
            entries.append(MountEntry(line))
        except (ValueError, IndexError):
            continue
    return entries


CGROUP_TYPES = (b"cgroup", b"cgroup2")


def cgroup_mounts(entries) -> list:
    """(fstype, root, mount point, super options) of every visible cgroup and cgroup2 mount
    among `entries`, in table order.

    A mount that a later one covers (at its mount point or above) is hidden: a private
    namespace that mounts cgroup2 over a hybrid host's /sys/fs/cgroup still lists the v1
    mounts beneath it (docs/runtime-facts.md §5).
    """
    return _visible([(m.point, m) for m in entries])


def cgroup_mounts_in(data: bytes) -> list:
    """`cgroup_mounts(parse(data))`, parsing in full only the cgroup lines: of every other
    line only its mount point is taken (it may cover a hierarchy). The GPU start reads the
    host's table twice; on a node with a thousand pod volumes the full parse and the covering
    test took 3.9 ms each time."""
    points = []
    for line in _lines(data):
        fields = line.split(b" ")
        try:  # a line `parse` would skip is no mount here either
            dash = fields.index(b"-")
            if dash < 6 or len(fields) < dash + 3:
                continue
            int(fields[0]), int(fields[1])
            if fields[dash + 1] in CGROUP_TYPES:
                entry = MountEntry(line)
                points.append((entry.point, entry))
            else:
                points.append((unescape(fields[4]), None))
        except (ValueError, IndexError):
            continue
    return _visible(points)


def _visible(points: list) -> list:
    """`cgroup_mounts` of [(mount point, its MountEntry, or None where it is no cgroup mount)]
    in table order: each hierarchy tested against the set of the mount points after it (a
    test of each against every later one took 1.5 ms for a thousand mounts)."""
    found, later = [], set()
    for point, m in reversed(points):
        if m is not None and m.fstype in ("cgroup", "cgroup2") and later.isdisjoint(_at_and_above(point)):
            found.append((m.fstype, m.root, m.point, set(m.super_options)))
        later.add(point.rstrip("/"))
    found.reverse()
    return found


def _at_and_above(point: str) -> list:
    """The mount points (without a trailing slash) that cover a mount at `point`: the point
    itself, each directory above it, and "" (a mount at /)."""
    above, at = [point, ""], point.find("/", 1)
    while at != -1:
        above.append(point[:at])
        at = point.find("/", at + 1)
    return above


def cgroup_mounts_here(proc: str = "/proc") -> list:
    """`cgroup_mounts` of the caller's mount table. Raises OSError."""
    return cgroup_mounts_in(read_bytes(proc=proc))


def cgroup_directory(mount_point: str, mount_root: str, path: str) -> str:
    """Where cgroup `path` (as /proc/<pid>/cgroup names it) is under a hierarchy mounted at
    `mount_point` that shows `mount_root` of it; "" when that mount does not show it (the
    cgroup lies outside the mount's root)."""
    root = mount_root.rstrip("/")
    if root and path != root and not path.startswith(root + "/"):
        return ""
    rest = path[len(root):].strip("/")
    return mount_point.rstrip("/") + ("/" + rest if rest else "")


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
    return int(files.proc_field(f"/proc/self/fdinfo/{fd}", b"mnt_id:"))
