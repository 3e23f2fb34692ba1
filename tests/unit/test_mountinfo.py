"""The mount table, read once way for everyone (gpuhook.kernel.mountinfo): literal mountinfo
lines (proc_pid_mountinfo(5)) in a directory standing in for /proc."""

import os

import pytest

from gpuhook.apply.cgroup import hierarchy
from gpuhook.health import registry
from gpuhook.kernel import mountinfo

# A hybrid host's table (v1 controllers, cgroup2 at .../unified), then a tmpfs whose mount
# point is not UTF-8 (any user who may mount can name one so; mountinfo shows its bytes).
HYBRID = (b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
          b"25 22 0:21 / /sys/fs/cgroup ro,nosuid shared:4 - tmpfs tmpfs ro,mode=755\n"
          b"26 25 0:22 / /sys/fs/cgroup/unified rw,nosuid shared:5 - cgroup2 cgroup2 rw,nsdelegate\n"
          b"30 25 0:26 / /sys/fs/cgroup/devices rw,nosuid shared:11 - cgroup cgroup rw,devices\n"
          b"31 25 0:27 / /sys/fs/cgroup/pids rw,nosuid shared:12 - cgroup cgroup rw,pids\n")
NOT_UTF8 = b"90 22 0:50 / /tmp/caf\xe9\\040x rw,relatime shared:40 - tmpfs tmpfs rw\n"
CGROUP = b"12:pids:/ctr\n11:devices:/ctr\n0::/ctr\n"


@pytest.fixture
def proc(tmp_path):
    """A /proc with the hybrid table plus a mount point that is not UTF-8, and process 42."""
    os.makedirs(tmp_path / "self")
    os.makedirs(tmp_path / "42")
    (tmp_path / "self" / "mountinfo").write_bytes(HYBRID + NOT_UTF8)
    (tmp_path / "42" / "cgroup").write_bytes(CGROUP)
    return str(tmp_path)


def test_a_mount_point_that_is_not_utf8_does_not_hide_the_device_policy(proc):
    # Before, the table was read as UTF-8 text: this one mount made every GPU start fail
    # with exit 70 (an internal error) on the host.
    place = hierarchy.placement(42, proc=proc)
    assert (place.mode, place.directory, place.cgroup_path) == (hierarchy.V1, "/sys/fs/cgroup/devices/ctr", "/ctr")


def test_the_health_registry_reads_the_same_table(proc):
    mounts = registry.cgroup_mounts(proc)
    assert [(fstype, point) for fstype, _, point, _ in mounts] == [
        ("cgroup2", "/sys/fs/cgroup/unified"), ("cgroup", "/sys/fs/cgroup/devices"), ("cgroup", "/sys/fs/cgroup/pids")]
    assert registry.cgroup_directories({"pids": "/ctr", "": "/ctr"}, mounts) == [
        "/sys/fs/cgroup/pids/ctr", "/sys/fs/cgroup/unified/ctr"]


def test_an_entry_keeps_the_bytes_of_its_names():
    (tmpfs,) = [m for m in mountinfo.parse(HYBRID + NOT_UTF8) if m.fstype == "tmpfs" and m.id == 90]
    assert os.fsencode(tmpfs.point) == b"/tmp/caf\xe9 x"  # \040 unescaped, the byte kept
    assert (tmpfs.root, tmpfs.parent, tmpfs.shared, tmpfs.options) == ("/", 22, True, (b"rw", b"relatime"))
    (devices,) = [m for m in mountinfo.parse(HYBRID) if m.id == 30]
    assert devices.super_options == {"rw", "devices"} and devices.dev == os.makedev(0, 26)


def test_lines_that_are_no_entries_are_skipped():
    cut = b"22 1 8:1 / / rw,relatime shared:1 - ext4\n"  # no source, no super options
    assert [m.id for m in mountinfo.parse(b"garbage\n\n22 1 8:1 / /\n" + cut + NOT_UTF8)] == [90]


def test_a_hierarchy_covered_by_a_later_mount_is_hidden():
    # A private namespace mounted cgroup2 over a hybrid host's /sys/fs/cgroup: the v1
    # mounts beneath it are still listed, and no longer visible (docs/runtime-facts.md §5).
    over = b"40 22 0:60 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    assert mountinfo.cgroup_mounts(mountinfo.parse(HYBRID + over)) == [
        ("cgroup2", "/", "/sys/fs/cgroup", {"rw"})]


@pytest.mark.parametrize("point,root,path,expected", [
    ("/sys/fs/cgroup/devices", "/", "/ctr", "/sys/fs/cgroup/devices/ctr"),
    ("/sys/fs/cgroup/devices", "/", "/", "/sys/fs/cgroup/devices"),
    ("/sys/fs/cgroup", "/kubepods", "/kubepods/pod1/ctr", "/sys/fs/cgroup/pod1/ctr"),
    ("/sys/fs/cgroup", "/kubepods", "/kubepods", "/sys/fs/cgroup"),
    ("/sys/fs/cgroup", "/kubepods", "/kubepodsX/ctr", ""),  # outside what the mount shows
    ("/sys/fs/cgroup", "/kubepods", "/system.slice/ctr", ""),
])
def test_a_cgroup_path_is_joined_onto_its_mount_one_way(point, root, path, expected):
    assert mountinfo.cgroup_directory(point, root, path) == expected


def test_read_subtree_is_subtree_of_the_whole_table():
    """read_subtree parses only the subtree's lines; it must give what subtree(read()) does,
    in the same order, for any shape (loops, lines that are not entries, self-parented roots)."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        ids = rng.sample(range(1, 500), rng.randint(1, 60))
        lines = []
        for i, mid in enumerate(ids):
            parent = rng.choice(ids[:i + 1]) if i else rng.choice([mid, 999])
            lines.append(f"{mid} {parent} 0:{i} / /m{i}\\040x rw,relatime shared:{i} - tmpfs tmpfs rw".encode())
        if rng.random() < 0.3:
            lines.insert(rng.randrange(len(lines) + 1), b"not a mountinfo line")
        data = b"\n".join(lines) + b"\n"
        fd = os.memfd_create("mountinfo")
        try:
            os.write(fd, data)
            top = rng.choice(ids)
            got = [(m.id, m.parent, m.point) for m in mountinfo.read_subtree(fd, top)]
            want = [(m.id, m.parent, m.point) for m in mountinfo.subtree(mountinfo.parse(data), top)]
        finally:
            os.close(fd)
        assert got == want


def _random_table(rng, size: int) -> bytes:
    """A mount table of `size` lines whose mount points nest and repeat at random: cgroup and
    cgroup2 hierarchies, tmpfs and overlay mounts over them or over their parents, mounts at /,
    trailing slashes, escaped names, and lines that are no entries."""
    names = ["sys", "fs", "cgroup", "devices", "pids", "unified", "a b", "run", "x"]
    lines = []
    for i in range(size):
        depth = rng.randint(0, 4)
        point = "/" + "/".join(rng.choice(names) for _ in range(depth))
        if rng.random() < 0.1 and point != "/":
            point += "/"
        escaped = point.replace(" ", "\\040").encode()
        kind = rng.choice([b"cgroup", b"cgroup2", b"tmpfs", b"overlay", b"cgroup"])
        options = b"rw,devices" if kind == b"cgroup" and rng.random() < 0.5 else b"rw,pids"
        if rng.random() < 0.03:
            lines.append(b"not a mount line")
            continue
        lines.append(b"%d %d 0:%d /r%d %s rw,nosuid shared:%d - %s %s %s"
                     % (100 + i, 22, 30 + i, i, escaped, i, kind, kind, options))
    return b"\n".join(lines) + b"\n"


def test_cgroup_mounts_in_a_table_is_cgroup_mounts_of_the_whole_parse():
    """cgroup_mounts_in parses only the cgroup lines, and tests each against the set of later
    mount points: the same hierarchies, hidden the same way, as the full parse."""
    import random

    rng = random.Random(7)
    over = (b"40 22 0:40 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
            b"41 40 0:41 / /sys/fs/cgroup/devices/ rw - cgroup cgroup rw,devices\n"
            b"42 22 0:42 / / rw - overlay overlay rw\n"
            b"43 42 0:43 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    tables = [HYBRID, HYBRID + NOT_UTF8, HYBRID + over, over + HYBRID, b"", b"garbage\n"]
    tables += [_random_table(rng, size) for size in (1, 5, 30, 200) for _ in range(25)]
    for data in tables:
        assert mountinfo.cgroup_mounts_in(data) == _covered_one_by_one(mountinfo.parse(data)), data
        assert mountinfo.cgroup_mounts(mountinfo.parse(data)) == _covered_one_by_one(mountinfo.parse(data)), data


def _covered_one_by_one(entries) -> list:
    """The visible hierarchies, found the plain way (each against every later mount): the
    oracle for the set-based test in `mountinfo._visible`."""
    def covers(upper, point):
        upper = upper.rstrip("/")
        return point == upper or point.startswith(upper + "/") or not upper
    return [(m.fstype, m.root, m.point, set(m.super_options)) for i, m in enumerate(entries)
            if m.fstype in ("cgroup", "cgroup2") and not any(covers(later.point, m.point) for later in entries[i + 1:])]


def test_index_finds_each_line_by_its_mount_id():
    table = HYBRID + NOT_UTF8 + b"garbage\n\n"
    lines = mountinfo.index(table)
    assert sorted(lines) == [22, 25, 26, 30, 31, 90]
    for m in mountinfo.parse(table):
        entry = mountinfo.MountEntry(lines[m.id])
        assert (entry.id, entry.point, entry.fstype, entry.shared) == (m.id, m.point, m.fstype, m.shared)


def test_the_worker_parses_only_the_mount_lines_it_asks_for(monkeypatch):
    """Before its pivot a container's namespace holds every mount of the host: the worker
    parsed the whole table (2.4 ms for a thousand pod volumes) twice per start. It parses the
    lines of the mounts it looks at, and reads the table again for a mount it does not have."""
    from gpuhook.apply import target as target_module

    host = [b"%d 22 0:%d / /var/lib/kubelet/pods/p%d/volumes/token rw shared:%d - tmpfs tmpfs rw"
            % (1000 + i, 100 + i, i, i) for i in range(1000)]
    tables = [HYBRID + b"\n".join(host) + b"\n"]
    tables.append(tables[0] + b"5000 30 0:99 / /sys/fs/cgroup/devices/x rw - tmpfs tmpfs rw\n")
    reads = []
    monkeypatch.setattr(mountinfo, "read_bytes",
                        lambda fd=None, proc="/proc": reads.append(1) or tables[min(len(reads), 2) - 1])
    made = []
    real = mountinfo.MountEntry

    class Counted(real):
        __slots__ = ()

        def __init__(self, line):
            made.append(line)
            super().__init__(line)
    monkeypatch.setattr(mountinfo, "MountEntry", Counted)
    work = target_module.Target.__new__(target_module.Target)
    work.mount_lines, work.mount_table = None, {}
    assert work.mount_entry(30).point == "/sys/fs/cgroup/devices"
    assert work.mount_entry(30).shared and work.mount_entry(1500).point == "/var/lib/kubelet/pods/p500/volumes/token"
    assert len(reads) == 1 and len(made) == 2
    assert work.mount_entry(5000).fstype == "tmpfs" and len(reads) == 2
    assert work.mount_entry(4242) is None and len(reads) == 3


# A bind mount whose source directory (the root field) a pod named: the kernel escapes only
# space, tab, newline and backslash there, so carriage returns, vertical tabs and form feeds
# come through as they are (attacker pass 21, A1).
FORGED_LINES = [
    b"91\x0b25\x0b0:61\x0b/\x0b/sys/fs/cgroup/devices\x0brw\x0b-\x0btmpfs\x0btmpfs\x0brw",
    b"92\x0c25\x0c0:26\x0c/attacker\x0c/sys/fs/cgroup/devices/ctr\x0crw\x0c-\x0ccgroup\x0ccgroup\x0crw,devices",
]
FORGED = b"93 22 8:1 /x\r" + b"\r".join(FORGED_LINES) + b"\ry /var/lib/kubelet/pods/p/volume-subpaths/v rw - ext4 /dev/sda1 rw\n"


def test_a_name_with_carriage_returns_and_vertical_tabs_forges_no_mount(proc):
    """Split as text, the forged name above read as two more mounts: a tmpfs hiding the real
    devices hierarchy and a "devices hierarchy" at the container's cgroup whose root is the
    attacker's cgroup: the hook granted the GPU to the attacker's cgroup through the victim's
    path. Lines are split at newlines and fields at spaces only: it is one mount, its root the
    whole name."""
    table = HYBRID + FORGED
    entries = mountinfo.parse(table)
    assert [m.id for m in entries] == [22, 25, 26, 30, 31, 93]
    assert entries[-1].root.startswith("/x\r") and entries[-1].point == "/var/lib/kubelet/pods/p/volume-subpaths/v"
    assert mountinfo.cgroup_mounts_in(table) == mountinfo.cgroup_mounts(mountinfo.parse(HYBRID))
    assert sorted(mountinfo.index(table)) == [22, 25, 26, 30, 31, 93]
    with open(os.path.join(proc, "self", "mountinfo"), "wb") as f:
        f.write(table)
    place = hierarchy.placement(42, proc=proc)
    assert (place.mode, place.directory, place.cgroup_path) == (hierarchy.V1, "/sys/fs/cgroup/devices/ctr", "/ctr")
    table_fd = mountinfo.open_table(proc)
    try:
        assert sorted(m.id for m in mountinfo.read_subtree(table_fd, 25)) == [25, 26, 30, 31]
    finally:
        os.close(table_fd)
