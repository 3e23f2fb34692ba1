"""Where a process's device policy lives: the v1 devices controller or the v2 unified tree.

Read from /proc/<pid>/cgroup and the mount table (docs/runtime-facts.md §5). On a hybrid host
(v1 controllers plus a cgroup2 mount at /sys/fs/cgroup/unified) the devices controller is v1,
so v1 wins whenever the process has a devices line and that hierarchy is mounted.
"""


from gpuhook.errors import HostError
from gpuhook.record import record

V1 = "v1"
V2 = "v2"


class Placement(record("Placement", "mode directory cgroup_path")):
    """`mode` is V1 or V2; `directory` is the cgroup's directory in the mounted hierarchy."""

    __slots__ = ()


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def cgroup_mounts(mountinfo_text: str) -> list[tuple[str, str, str, set]]:
    """(fstype, root, mount point, super options) of every visible cgroup and cgroup2 mount.

    A mount that a later one covers (at its mount point or above) is hidden: a private
    namespace that mounts cgroup2 over a hybrid host's /sys/fs/cgroup still lists the v1
    mounts beneath it (docs/runtime-facts.md §5).
    """
    mounts = []
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        mounts.append((rf[0], _unescape(lf[3]), _unescape(lf[4]), set(rf[2].split(","))))
    found = []
    for i, (fstype, root, point, options) in enumerate(mounts):
        if fstype not in ("cgroup", "cgroup2"):
            continue
        if any(_covers(later[2], point) for later in mounts[i + 1:]):
            continue
        found.append((fstype, root, point, options))
    return found


def _covers(upper: str, point: str) -> bool:
    upper = upper.rstrip("/")
    return point == upper or point.startswith(upper + "/") or not upper


def proc_cgroups(text: str) -> dict:
    """Controller name (or "" for the unified line) -> cgroup path, from /proc/<pid>/cgroup."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            paths[""] = path
        for name in controllers.split(","):
            if name:
                paths[name] = path
    return paths


def _join(mount_point: str, mount_root: str, path: str) -> str:
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root):]
    elif mount_root != "/":
        # The process's cgroup is outside what this mount shows.
        return ""
    return mount_point.rstrip("/") + ("/" + path.strip("/") if path.strip("/") else "")


def placement(pid: int, proc: str = "/proc", mountinfo: str | None = None) -> Placement:
    """Find the cgroup that holds `pid`'s device policy."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            paths = proc_cgroups(f.read())
    except FileNotFoundError:
        raise HostError(f"process {pid} is gone (no {proc}/{pid}/cgroup)") from None
    except OSError as err:
        raise HostError(f"cannot read {proc}/{pid}/cgroup: {err.strerror}") from err
    if mountinfo is None:
        try:
            with open(f"{proc}/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError as err:
            raise HostError(f"cannot read the mount table: {err.strerror}") from err
    mounts = cgroup_mounts(mountinfo)
    if paths.get("devices") == "/" and paths.get("", "/") not in ("", "/"):
        # The root v1 devices cgroup (which allows everything) but a v2 cgroup of its own:
        # the runtime ran in v2 mode (pure v2 in a private mount namespace on a hybrid
        # host), so the policy is that cgroup's device programs. Reporting "v1 root, allow
        # all" from the host's namespace would be wrong.
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                directory = _join(point, root, paths[""])
                if directory:
                    return Placement(V2, directory, paths[""])
        raise HostError(f"process {pid}'s device policy is on cgroup v2 ({paths[''][:200]}), which is not mounted "
                        "in this mount namespace",
                        "run it in the runtime's mount namespace: nsenter --target <runtime pid> --mount gpuhook ...")
    if "devices" in paths:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and "devices" in options:
                directory = _join(point, root, paths["devices"])
                if directory:
                    return Placement(V1, directory, paths["devices"])
        # The root of the v1 devices hierarchy allows everything, so with none visible
        # (pure v2 in a private namespace on a hybrid host) the policy is in v2.
        if paths["devices"] != "/" or "" not in paths:
            raise HostError(f"process {pid} is in a v1 devices cgroup but no devices hierarchy is mounted here")
    if "" in paths:
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                directory = _join(point, root, paths[""])
                if directory:
                    return Placement(V2, directory, paths[""])
        raise HostError(f"process {pid} is in a cgroup v2 tree that is not mounted here")
    raise HostError(f"process {pid} has no devices cgroup and no cgroup v2 membership")
