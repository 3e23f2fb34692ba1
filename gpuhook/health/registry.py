"""The containers gpuhook started with GPUs: who may own a GPU process, and who left one behind.

The hook records every container it gave GPUs (after a successful apply) in
<state-dir>/health/containers/<id>@<pid>-<start_time>.json (keyed by the init as well as the
id: two runtimes, or two --root dirs of one runtime, can each have a container of one id):

    {"format": 1, "id": "...", "pid": 4242, "start_time": 123456, "boot_id": "...",
     "cgroups": {"pids": "/mycontainer", "": "/mycontainer"}, "gpus": ["GPU-..."],
     "names": {"pod": ..., "namespace": ..., "container_name": ...}, "registered": 12.5}

`pid` and `start_time` (field 22 of /proc/<pid>/stat, clock ticks since boot) identify the
container's init for good: a reused pid has another start time. A container is *gone*
when that process no longer exists, is a zombie, or has another start time. `cgroups` are
the init's cgroup paths (per controller, "" for cgroup v2) that are the container's own,
i.e. differ from the registering hook's: a GPU process in those cgroups belongs to the
container; if the container is gone, the process is an orphan (docs/health.md).

Only cgroups the init has to itself at registration count as the container's: a cgroup that
already holds other processes (a container placed into a host daemon's cgroup) is shared,
and nothing in it is ever taken for the container's.

An entry is removed at poststop once nothing is left behind, and only when its container is
gone: a poststop naming a live container's id changes nothing; an entry of a gone container
whose cgroups no longer exist (nothing can be left in them), or from another boot, is
dropped when the registry is read.
"""

import os

from gpuhook.cgroup import hierarchy
from gpuhook.health import store
from gpuhook import procstat
from gpuhook.procstat import ID_CHARS, ProcessStat, entry_name, read_stat  # noqa: F401 (re-exported)
from gpuhook.record import record

FORMAT = 1


class Container(record("Container", "id pid start_time cgroups gpus names boot_id registered")):
    """One registry entry (see the module docstring)."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return {"format": FORMAT, "id": self.id, "pid": self.pid, "start_time": self.start_time,
                "cgroups": dict(self.cgroups), "gpus": list(self.gpus), "names": dict(self.names),
                "boot_id": self.boot_id, "registered": self.registered}

    def holds(self, cgroups: dict) -> bool:
        """True when a process with these cgroup paths is inside this container's cgroups:
        every controller both know puts it at or below the container's path (at least one)."""
        common = [key for key in self.cgroups if key in cgroups]
        if not common:
            return False
        for key in common:
            own, theirs = self.cgroups[key], cgroups[key]
            if theirs != own and not theirs.startswith(own.rstrip("/") + "/"):
                return False
        return True

    def label(self) -> str:
        names = self.names
        if names.get("pod"):
            return f"{self.id[:12]} ({names.get('namespace', '?')}/{names['pod']}/{names.get('container_name', '?')})"
        return self.id[:64]


def read_cgroups(pid: int, proc: str = "/proc") -> dict | None:
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            return hierarchy.proc_cgroups(f.read(1 << 16))
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
    mine = read_cgroups(os.getpid(), proc) or {}
    own = own_cgroups(cgroups, mine)
    mounts = _cgroup_mounts(proc)
    own = {key: path for key, path in own.items() if not _shared({key: path}, pid, mounts)}
    return Container(container_id, pid, stat.start_time, own, tuple(gpus),
                     dict(names or {}), store.boot_id(), round(store.boottime(), 3))


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


def record(state_dir: str, container: Container) -> None:
    """Write (or replace) the entry of `container`. Raises OSError."""
    store.write_json(entry_path(state_dir, container), container.as_dict())


def forget(state_dir: str, container) -> None:
    """Remove the entry of `container` (a Container), or every entry of an id (a str)."""
    targets = [container] if isinstance(container, Container) else load_id(state_dir, container)
    for entry in targets:
        try:
            os.unlink(entry_path(state_dir, entry))
        except FileNotFoundError:
            pass


def _parse(doc) -> Container | None:
    try:
        if doc["format"] != FORMAT:
            return None
        cgroups = {str(k): str(v) for k, v in doc["cgroups"].items()}
        return Container(str(doc["id"]), int(doc["pid"]), int(doc["start_time"]), cgroups,
                         tuple(str(g) for g in doc["gpus"]), {str(k): str(v) for k, v in doc["names"].items()},
                         str(doc["boot_id"]), float(doc["registered"]))
    except (KeyError, TypeError, ValueError, AttributeError):
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
                mounts = _cgroup_mounts(proc)
            if entry.boot_id != this_boot or not cgroups_exist(entry, mounts):
                try:
                    os.unlink(path)
                except OSError:
                    pass
                continue
        entries.append(entry)
    return tuple(entries)


def is_alive(container: Container, proc: str = "/proc") -> bool:
    """True while the container's init runs: same pid, same start time, not a zombie."""
    return procstat.is_alive(container.pid, container.start_time, proc)


def _cgroup_mounts(proc: str):
    try:
        with open(f"{proc}/self/mountinfo") as f:
            return hierarchy.cgroup_mounts(f.read())
    except OSError:
        return []


def cgroup_directories(cgroups: dict, mounts) -> list:
    """Where cgroup paths (controller -> path, "" for cgroup v2) are in the mounted
    hierarchies `mounts` (hierarchy.cgroup_mounts); paths no mount shows are left out."""
    found = []
    for key, path in cgroups.items():
        for fstype, root, point, options in mounts:
            if (key == "" and fstype == "cgroup2") or (key and fstype == "cgroup" and key in options):
                directory = _directory(point, root, path)
                if directory and directory not in found:
                    found.append(directory)
    return found


def cgroups_exist(container: Container, mounts) -> bool:
    """True if any of the container's cgroup directories still exists (or none can be
    located in the mount table, when nothing can be concluded)."""
    directories = cgroup_directories(container.cgroups, mounts)
    return not directories or any(os.path.isdir(d) for d in directories)


def _directory(mount_point: str, mount_root: str, path: str) -> str:
    """Where cgroup `path` is under a hierarchy mounted at `mount_point` showing `mount_root`
    ("" when the mount does not show it)."""
    root = mount_root.rstrip("/")
    if root and path != root and not path.startswith(root + "/"):
        return ""
    rest = path[len(root):].strip("/")
    return mount_point.rstrip("/") + ("/" + rest if rest else "")
