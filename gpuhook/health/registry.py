"""The containers gpuhook started with GPUs: who may own a GPU process, and who left one behind.

The hook records every container it gave GPUs (after a successful apply) in
<state-dir>/health/containers/<id>@<pid>-<start_time>.json (keyed by the init as well as the
id: two runtimes, or two --root dirs of one runtime, can each have a container of one id):

    {"format": 1, "id": "...", "pid": 4242, "start_time": 123456, "boot_id": "...",
     "cgroups": {"pids": "/mycontainer", "": "/mycontainer"},
     "cgroup_ids": {"pids": 1234, "": 5678}, "pid_ns": 4026532600, "ns_init": [4242, 123456],
     "gpus": ["GPU-..."], "names": {"pod": ..., "namespace": ..., "container_name": ...},
     "registered": 12.5}

`pid` and `start_time` (field 22 of /proc/<pid>/stat, clock ticks since boot) identify the
container's init for good: a reused pid has another start time. A container is *gone*
when that process no longer exists, is a zombie, or has another start time.

A process belongs to a registered container only by kernel identity, checked again just
before it is killed (docs/health.md, "Who owns a GPU process"), never by a path or an id:

- it is in exactly the container's own cgroups: for every controller recorded (`cgroups`,
  the init's paths that differ from the registering hook's, "" for cgroup v2) the same
  path, and that directory is still the cgroup the init was in (`cgroup_ids`, its inode: a
  cgroup removed and made again at the same path is another cgroup, and a child cgroup is
  not the container's);
- it is in the container's pid namespace (`pid_ns`), and that namespace is still the one
  recorded: its init (`ns_init`, pid and start time: the container's own init, or the
  process that is pid 1 of a namespace the container shares, such as a pod's; [0, 0] for
  the host's, where gpuhook itself runs) still runs in it. A process that merely joined the cgroup from namespaces of its
  own is not the container's, and nothing is left of a container whose own pid namespace
  ended with its init (the kernel kills the rest);
- it started no earlier than the container's init.

Only cgroups the init has to itself at registration count as the container's: a cgroup that
already holds other processes (a container placed into a host daemon's cgroup) is shared,
and nothing in it is ever taken for the container's. An entry without these identities
(written by an older gpuhook) owns no process.

An entry is removed at poststop once nothing is left behind, and only when its container is
gone: a poststop naming a live container's id changes nothing; an entry of a gone container
that nothing can be left of (its cgroups no longer exist, its pid namespace ended), or from
another boot, is dropped when the registry is read.
"""

import os
import time

from gpuhook.apply import statefiles
from gpuhook.health import store
from gpuhook.kernel import caller, mountinfo, procstat
from gpuhook.kernel.procstat import ID_CHARS, ProcessStat, entry_name, read_stat  # noqa: F401 (re-exported)
from gpuhook.record import record

FORMAT = 1


class Container(record("Container", "id pid start_time cgroups gpus names boot_id registered "
                                    "cgroup_ids pid_ns ns_init", defaults=(None, 0, None))):
    """One registry entry (see the module docstring). `cgroup_ids` maps each key of `cgroups`
    to the inode of that cgroup's directory; `pid_ns` is the inode of the init's pid
    namespace; `ns_init` the (pid, start time) of that namespace's init."""

    __slots__ = ()

    @property
    def key(self) -> tuple:
        """What identifies the container: its id and its init (pid and start time)."""
        return (self.id, self.pid, self.start_time)

    def as_dict(self) -> dict:
        return {"format": FORMAT, "id": self.id, "pid": self.pid, "start_time": self.start_time,
                "cgroups": dict(self.cgroups), "cgroup_ids": dict(self.cgroup_ids or {}), "pid_ns": self.pid_ns,
                "ns_init": list(self.ns_init) if self.ns_init else None, "gpus": list(self.gpus),
                "names": dict(self.names), "boot_id": self.boot_id, "registered": self.registered}

    def label(self) -> str:
        names = self.names
        if names.get("pod"):
            return f"{self.id[:12]} ({names.get('namespace', '?')}/{names['pod']}/{names.get('container_name', '?')})"
        return self.id[:64]


def read_cgroups(pid: int, proc: str = "/proc") -> dict | None:
    """Process `pid`'s cgroups (controller -> path, "" for v2), or None when unreadable."""
    try:
        return procstat.read_cgroups(pid, proc)
    except OSError:
        return None


def own_cgroups(container_cgroups: dict, registrant_cgroups: dict) -> dict:
    """The paths that are the container's own: not the root and not the registrant's (the
    runtime's) own path or one above it, which other processes share."""
    own = {}
    for key, path in container_cgroups.items():
        if path in ("", "/"):
            continue
        mine = registrant_cgroups.get(key)
        if mine is not None and (mine == path or mine.startswith(path.rstrip("/") + "/")):
            continue
        own[key] = path
    return own


def entries_dir(state_dir: str) -> str:
    return f"{store.health_dir(state_dir)}/containers"


def entry_path(state_dir: str, container: Container) -> str:
    return f"{entries_dir(state_dir)}/{entry_name(container.id)}@{container.pid}-{container.start_time}.json"


def from_process(container_id: str, pid: int, gpus, names: dict | None = None, proc: str = "/proc") -> Container:
    """The entry for container `container_id` whose init is `pid` (read now from /proc).
    Raises LookupError when the init cannot be read."""
    stat = read_stat(pid, proc) if pid > 0 else None
    cgroups = read_cgroups(pid, proc) if stat is not None else None
    if stat is None or cgroups is None or stat.zombie:
        raise LookupError(f"container init pid {pid} is not readable in {proc}")
    mine = read_cgroups(caller.pid(), proc) or {}
    own = own_cgroups(cgroups, mine)
    mounts = cgroup_mounts(proc)
    own = {key: path for key, path in own.items() if not _shared({key: path}, pid, mounts)}
    ids = {}
    for key, path in own.items():
        inode = cgroup_inode(key, path, mounts)
        if inode is not None:
            ids[key] = inode
    own = {key: path for key, path in own.items() if key in ids}
    ids = ids or None
    pid_ns = pid_namespace(pid, proc)
    ns_init = _namespace_init(pid, stat, pid_ns, proc) if pid_ns else None
    return Container(container_id, pid, stat.start_time, own, tuple(gpus), dict(names or {}), store.boot_id(),
                     round(store.boottime(), 3), ids, pid_ns, ns_init)


# Bounds on the look through /proc for a shared pid namespace's init (registration runs
# inside the hook's deadline); past them the entry has no ns_init and owns no process.
MAX_SCAN = 1 << 16
SCAN_SECONDS = 0.5


def pid_namespace(pid, proc: str = "/proc") -> int:
    """The inode number of `pid`'s pid namespace, 0 when it cannot be read."""
    try:
        link = os.readlink(f"{proc}/{pid}/ns/pid")
    except OSError:
        return 0
    number = link[len("pid:["):-1] if link.startswith("pid:[") and link.endswith("]") else ""
    return int(number) if number.isdigit() and len(number) < 20 else 0


def _nspid_is_one(pid, proc: str) -> bool:
    """Whether `pid` is pid 1 of its own pid namespace (the last NSpid field of its status)."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            text = f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return line.split()[-1] == "1"
    return False


def _namespace_init(pid: int, stat, pid_ns: int, proc: str):
    """(pid, start time) of the process that is pid 1 in `pid`'s pid namespace `pid_ns`:
    the container's init itself, or the init of a namespace it shares (a pod's), found in
    /proc; (0, 0) for the pid namespace gpuhook runs in itself (the host's, whose inode
    number is the kernel's constant and never given to another). None when there is none
    to be found."""
    if _nspid_is_one(pid, proc):
        return (pid, stat.start_time)
    if pid_ns == pid_namespace("self", proc):
        return (0, 0)
    try:
        candidates = os.listdir(proc)
    except OSError:
        return None
    end = time.monotonic() + SCAN_SECONDS
    for name in candidates[:MAX_SCAN]:
        if time.monotonic() > end:
            return None
        if not name.isdigit() or pid_namespace(name, proc) != pid_ns or not _nspid_is_one(name, proc):
            continue
        found = read_stat(int(name), proc)
        if found is not None and not found.zombie:
            return (found.pid, found.start_time)
    return None


def belongs(container: Container, pid: int, proc: str = "/proc", mounts=None, stat=None, cgroups=None) -> bool:
    """Whether process `pid` is `container`'s by kernel identity (the module docstring): the
    same cgroups (paths and inodes), the container's pid namespace, which still exists, and
    started no earlier than the container's init. `stat` and `cgroups` may be passed when
    already read; every check is made on the kernel's answer now."""
    if not container.cgroups or not container.cgroup_ids or not container.pid_ns or not container.ns_init:
        return False
    stat = stat if stat is not None else read_stat(pid, proc)
    if stat is None or stat.start_time < container.start_time:
        return False
    cgroups = cgroups if cgroups is not None else read_cgroups(pid, proc)
    if cgroups is None or any(cgroups.get(key) != path for key, path in container.cgroups.items()):
        return False
    mounts = cgroup_mounts(proc) if mounts is None else mounts
    for key, path in container.cgroups.items():
        if cgroup_inode(key, path, mounts) != container.cgroup_ids.get(key):
            return False
    if pid_namespace(pid, proc) != container.pid_ns:
        return False
    return namespace_exists(container, proc)


def namespace_exists(container: Container, proc: str = "/proc") -> bool:
    """Whether the container's pid namespace is still the one recorded: its init runs and
    is in it (a namespace that ended may have its inode number given to a new one)."""
    if not container.ns_init or not container.pid_ns:
        return False
    ns_pid, ns_start = container.ns_init
    if ns_pid == 0:
        return pid_namespace("self", proc) == container.pid_ns
    return procstat.is_alive(ns_pid, ns_start, proc) and pid_namespace(ns_pid, proc) == container.pid_ns


def _shared(cgroups: dict, pid: int, mounts) -> bool:
    """Whether any of these cgroups holds a process other than `pid` (or cannot be read)."""
    for directory in cgroup_directories(cgroups, mounts):
        try:
            with open(f"{directory}/cgroup.procs", "rb") as f:
                pids = f.read(1 << 20).split()
        except OSError:
            return True
        if any(p != str(pid).encode() for p in pids):
            return True
    return False


def add(state_dir: str, container: Container) -> None:
    """Write (or replace) the entry of `container`. Raises OSError."""
    store.write_json(entry_path(state_dir, container), container.as_dict())


def forget(state_dir: str, container) -> None:
    """Remove the entry of `container` (a Container), or every entry of an id (a str)."""
    targets = [container] if isinstance(container, Container) else load_id(state_dir, container)
    for entry in targets:
        statefiles.remove(entry_path(state_dir, entry))


def _parse(doc) -> Container | None:
    try:
        if doc["format"] != FORMAT:
            return None
        cgroups = {str(k): str(v) for k, v in doc["cgroups"].items()}
        ids = {str(k): int(v) for k, v in (doc.get("cgroup_ids") or {}).items()} or None
        ns_init = doc.get("ns_init")
        ns_init = (int(ns_init[0]), int(ns_init[1])) if ns_init else None
        return Container(str(doc["id"]), int(doc["pid"]), int(doc["start_time"]), cgroups,
                         tuple(str(g) for g in doc["gpus"]), {str(k): str(v) for k, v in doc["names"].items()},
                         str(doc["boot_id"]), float(doc["registered"]), ids, int(doc.get("pid_ns") or 0), ns_init)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None


def load_id(state_dir: str, container_id: str) -> tuple:
    """Every entry of this container id (one per init that ever registered under it)."""
    prefix = entry_name(container_id) + "@"
    try:
        names = [n for n in os.listdir(entries_dir(state_dir)) if n.startswith(prefix) and n.endswith(".json")]
    except OSError:
        return ()
    found = (_parse(store.read_json(f"{entries_dir(state_dir)}/{name}")) for name in names)
    return tuple(sorted((e for e in found if e is not None and e.id == container_id), key=lambda e: e.registered))


def load(state_dir: str, container_id: str) -> Container | None:
    """The newest entry of this container id, or None."""
    entries = load_id(state_dir, container_id)
    return entries[-1] if entries else None


def load_all(state_dir: str, proc: str = "/proc", prune: bool = True) -> tuple:
    """Every entry, dropping (with `prune`) those nothing can depend on any more."""
    directory = entries_dir(state_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return ()
    entries = []
    this_boot = store.boot_id()
    mounts = None
    for name in names:
        if not name.endswith(".json"):
            continue
        path = f"{directory}/{name}"
        entry = _parse(store.read_json(path))
        if entry is None:
            continue
        if prune and (entry.boot_id != this_boot or not is_alive(entry, proc)):
            if mounts is None:
                mounts = cgroup_mounts(proc)
            if entry.boot_id != this_boot or not cgroups_exist(entry, mounts) or not namespace_exists(entry, proc):
                try:
                    statefiles.remove(path)
                except OSError:
                    pass
                continue
        entries.append(entry)
    return tuple(entries)


def is_alive(container: Container, proc: str = "/proc") -> bool:
    """True while the container's init runs: same pid, same start time, not a zombie."""
    return procstat.is_alive(container.pid, container.start_time, proc)


def cgroup_mounts(proc: str = "/proc"):
    """The cgroup hierarchies mounted where this process looks (gpuhook.kernel.mountinfo.cgroup_mounts);
    none when the table cannot be read."""
    try:
        return mountinfo.cgroup_mounts_here(proc)
    except OSError:
        return []


def cgroup_directories(cgroups: dict, mounts) -> list:
    """Where cgroup paths (controller -> path, "" for cgroup v2) are in the mounted
    hierarchies `mounts` (`cgroup_mounts`); paths no mount shows are left out."""
    found = []
    for key, path in cgroups.items():
        for fstype, root, point, options in mounts:
            if (key == "" and fstype == "cgroup2") or (key and fstype == "cgroup" and key in options):
                directory = mountinfo.cgroup_directory(point, root, path)
                if directory and directory not in found:
                    found.append(directory)
    return found


def cgroup_inode(key: str, path: str, mounts):
    """The inode of cgroup `path` of controller `key` ("" for v2) in `mounts`, or None when
    no mounted hierarchy shows it or it does not exist."""
    for directory in cgroup_directories({key: path}, mounts):
        try:
            return os.stat(directory).st_ino
        except OSError:
            continue
    return None


def cgroups_exist(container: Container, mounts) -> bool:
    """True if any of the container's cgroups still exists: the same directory (by inode)
    at its path (or none can be located in the mount table, when nothing can be concluded)."""
    if not cgroup_directories(container.cgroups, mounts):
        return True
    ids = container.cgroup_ids or {}
    for key, path in container.cgroups.items():
        inode = cgroup_inode(key, path, mounts)
        if inode is not None and inode == ids.get(key):
            return True
    return False
