"""Device access gpuhook gave a container's cgroup, taken back once its container is gone.

gpuhook adds allow rules to the container's devices cgroup on v1 (gpuhook.apply.cgroup.v1),
and allow blocks in front of the runtime's device program on v2 (gpuhook.apply.cgroup.v2).
A cgroup the container has to itself is removed with it, rules, program and all. But two
containers can share one cgroup (one `cgroupsPath`; runc removes a cgroup only once it is
empty, and runc before 1.2 starts a container in a non-empty one): then the grant outlives the
container it was made for, and the other container keeps a GPU it was never granted
(docs/security.md, "shared cgroups"). So every grant is recorded in
<state-dir>/grants/<id>@<pid>-<start_time>.json (root only, like the health registry):

    {"format": 2, "id": "...", "pid": 4242, "start_time": 123456, "boot_id": "...",
     "mode": "v1", "directory": "/sys/fs/cgroup/devices/...", "cgroup": [dev, inode],
     "planned": ["c 195:0 rw", ...], "added": ["c 195:0 rw", ...]}

`planned` is every rule the container was to have, `added` only what the cgroup lacked
(gpuhook.apply.cgroup.v1.grant), `cgroup` the devices cgroup's identity when it was granted.
At poststop, whatever the health mode, `release` denies `added` again once the container's
init is gone (pid and start time, as in gpuhook.health.registry) and its cgroup still exists
as the same cgroup (path AND inode: a cgroup removed with the container and made again at
its path by someone else is another cgroup, whose rules are not ours), except for the access
letters that another live container's grant in the same cgroup planned for that device
(`to_take_back`: exactly the letters, so a container planned `r` keeps `r`, never the `w` of
the one that stopped). A poststop naming a live container changes nothing. Format-1 entries
(no `cgroup`) are taken back by path as before. On v2 (`mode` "v2") taking back rebuilds
each gpuhook program of the cgroup without those letters (gpuhook.apply.cgroup.v2.take_back),
the runtime's own program behind it unchanged.

What this does not know: device access that a *runtime* gave a container sharing the cgroup
after gpuhook's grant. Taking back our rule then takes that access away too. A shared cgroup
is not a supported way to run GPU containers; the failure is the safe one (EPERM), never a
GPU granted to nobody.
"""

import os

from gpuhook.apply import statefiles
from gpuhook.kernel import files
from gpuhook.kernel import procstat
from gpuhook.devrules.devices import parse_v1_line, without_letters

FORMAT = 2
FORMATS = (1, 2)  # read; 1 has no cgroup identity
MAX_ENTRIES = 4096  # bound on the directory scan; the directory lives in /run (tmpfs)


def grants_dir(state_dir: str) -> str:
    return f"{state_dir}/grants"


class Grant:
    """One recorded grant (see the module docstring)."""

    __slots__ = ("id", "pid", "start_time", "boot_id", "mode", "directory", "cgroup", "planned", "added", "path",
                 "doc")

    def __init__(self, doc: dict, path: str = ""):
        self.id = str(doc["id"])
        self.pid = int(doc["pid"])
        self.start_time = int(doc["start_time"])
        self.boot_id = str(doc["boot_id"])
        self.mode = str(doc.get("mode", "v1"))
        self.directory = str(doc["directory"])
        ident = doc.get("cgroup")
        self.cgroup = None if ident is None else (int(ident[0]), int(ident[1]))
        self.planned = [parse_v1_line(str(line)) for line in doc["planned"]]
        self.added = [parse_v1_line(str(line)) for line in doc["added"]]
        self.path = path
        self.doc = doc

    def alive(self) -> bool:
        return procstat.is_alive(self.pid, self.start_time)

    def same_cgroup(self) -> bool:
        """Whether the cgroup it was granted in still exists, as that cgroup: at its path with
        its identity (a format-1 entry knows only the path)."""
        identity = _identity(self.directory)
        return identity is not None and (self.cgroup is None or identity == self.cgroup)


def _identity(directory: str):
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def save(state_dir: str, container_id: str, pid: int, directory: str, planned, added, mode: str = "v1") -> str:
    """Record a grant (cgroup `mode` "v1" or "v2") made for the container whose init is `pid`;
    returns the entry's path. Raises OSError (or LookupError when the init cannot be read)."""
    stat = procstat.read_stat(pid)
    if stat is None or stat.zombie:
        raise LookupError(f"container init pid {pid} is not readable")
    identity = _identity(directory)
    if identity is None:
        raise LookupError(f"devices cgroup {directory} is not readable")
    path = f"{grants_dir(state_dir)}/{procstat.entry_name(container_id)}@{pid}-{stat.start_time}.json"
    statefiles.write_atomic(path, {"format": FORMAT, "id": container_id, "pid": pid, "start_time": stat.start_time,
                              "boot_id": files.boot_id(), "mode": mode, "directory": directory,
                              "cgroup": list(identity),
                              "planned": [rule.v1_line() for rule in planned],
                              "added": [rule.v1_line() for rule in added]})
    return path


def _load(state_dir: str, container_id: str | None = None) -> list:
    """Every readable entry of this boot (at most MAX_ENTRIES, those of `container_id` first);
    entries of another boot are removed."""
    directory = grants_dir(state_dir)
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
    except OSError:
        return []
    if len(names) > MAX_ENTRIES and container_id is not None:
        # Bounded, but never at the cost of the stopping container's own entries.
        own = procstat.entry_name(container_id) + "@"
        names = [n for n in names if n.startswith(own)] + [n for n in names if not n.startswith(own)]
    names = names[:MAX_ENTRIES]
    this_boot = files.boot_id()
    found = []
    for name in names:
        path = f"{directory}/{name}"
        doc = files.read(path, limit=1 << 20)
        try:
            if doc is None or doc["format"] not in FORMATS:
                continue
            grant = Grant(doc, path)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if grant.boot_id != this_boot:
            _forget(grant)
            continue
        found.append(grant)
    return found


def _forget(grant: Grant) -> None:
    statefiles.remove(grant.path)


def release(state_dir: str, container_id: str) -> str:
    """Take back what was granted to the stopped container `container_id` (every gone init
    recorded under that id), then what earlier stops had to leave to containers then alive
    in the same cgroup or below and none alive needs now; returns the decision for the log.
    Never raises."""
    try:
        everything = _load(state_dir, container_id)
    except OSError as err:
        return f"grants not read: {err.strerror or err}"
    # Who is alive, and in the cgroup it was granted in, is asked once per entry: the entries
    # are compared with each other below, and a pid or a cgroup read per pair would be
    # quadratic in a directory of up to MAX_ENTRIES.
    alive = {id(grant) for grant in everything if grant.alive()}
    live = [grant for grant in everything if id(grant) in alive and grant.same_cgroup()]
    mine = [grant for grant in everything if grant.id == container_id]
    decisions = []
    for grant in mine:
        if id(grant) in alive:
            decisions.append(f"grant kept: container init pid {grant.pid} is still running")
        else:
            decisions.append(_settle(grant, live))
    # The grants of every other container that is gone: a stop that kept letters for a
    # container alive then (one cgroup for two containers, a container in a cgroup below)
    # left its record with them, and a container killed without its poststop left all of
    # it; whoever stops next takes back what nobody alive needs any more. Without this a
    # grant could outlive every container it served: two starts at once in one cgroup find
    # each other's rules, and the second records nothing as its own.
    for grant in everything:
        if grant.id != container_id and id(grant) not in alive:
            decision = _settle(grant, live)
            if decision.startswith(("took back", "grant not taken back")):
                decisions.append(f"{decision} (left by a container stopped earlier)")
    if not decisions:
        return "no cgroup grant recorded"
    return "; ".join(dict.fromkeys(decisions))


def _settle(grant: Grant, live: list) -> str:
    """Take back `grant` (its container is gone) as far as no grant in `live` (containers
    alive in the cgroup they were granted in) in the same cgroup or one below it needs its
    letters; keep the record with what is left."""
    if not grant.same_cgroup():
        _forget(grant)
        return "cgroup removed with the container"
    below = grant.directory.rstrip("/") + "/"
    others = [other for other in live if other.mode == grant.mode
              and (other.directory == grant.directory or other.directory.startswith(below))]
    revoke = to_take_back(grant, others)
    if grant.mode == "v2":
        from gpuhook.apply.cgroup import v2

        problems = v2.take_back(grant.directory, revoke) if revoke else []
    else:
        from gpuhook.apply.cgroup import v1

        problems = v1.revoke(grant.directory, revoke)
    if problems:
        return "grant not taken back: " + "; ".join(problems)  # kept: a later poststop tries again
    left = without_letters(grant.added, revoke)
    took = f"took back {len(revoke)} device rule(s) from the cgroup it shared" if revoke else ""
    if not left:
        _forget(grant)
        return took or "cgroup shared: nothing of its grant to take back"
    try:
        statefiles.write_atomic(grant.path, {**grant.doc, "added": [rule.v1_line() for rule in left], "kept": True})
    except OSError as err:
        return f"{took or 'nothing taken back'}; what live containers still need not recorded: {err.strerror or err}"
    return (f"{took}; " if took else "") + (f"{len(left)} rule(s) kept while a container in that cgroup "
                                            f"or below needs them")


def to_take_back(grant: Grant, others) -> list:
    """The rules to deny of `grant.added`: each with exactly the access letters no grant in
    `others` (live containers in the same cgroup or one below it) planned for that device. A
    letter another container was granted stays; one it was not (the `w` of a container that
    planned `r`) goes."""
    return without_letters(grant.added, [rule for other in others for rule in other.planned])
