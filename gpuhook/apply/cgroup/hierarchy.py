"""Where a process's device policy lives: the v1 devices controller or the v2 unified tree.

Read from /proc/<pid>/cgroup and the mount table (docs/runtime-facts.md §5). On a hybrid host
(v1 controllers plus a cgroup2 mount at /sys/fs/cgroup/unified) the devices controller is v1,
so v1 wins whenever the process has a devices line and that hierarchy is mounted.
"""

import os

from gpuhook.errors import HostError
from gpuhook.kernel import mountinfo as mount_table
from gpuhook.kernel.mountinfo import cgroup_directory
from gpuhook.kernel.procstat import read_cgroups
from gpuhook.record import record

V1 = "v1"
V2 = "v2"


class Placement(record("Placement", "mode directory cgroup_path")):
    """`mode` is V1 or V2; `directory` is the cgroup's directory in the mounted hierarchy."""

    __slots__ = ()


def placement(pid: int, proc: str = "/proc", mountinfo: str | bytes | None = None) -> Placement:
    """Find the cgroup that holds `pid`'s device policy (`mountinfo`: a mount table to use
    instead of the caller's)."""
    try:
        paths = read_cgroups(pid, proc)
    except FileNotFoundError:
        raise HostError(f"process {pid} is gone (no {proc}/{pid}/cgroup)") from None
    except OSError as err:
        raise HostError(f"cannot read {proc}/{pid}/cgroup: {err.strerror}") from err
    try:
        table = mount_table.read_bytes(proc=proc) if mountinfo is None else \
            os.fsencode(mountinfo) if isinstance(mountinfo, str) else mountinfo
    except OSError as err:
        raise HostError(f"cannot read the mount table: {err.strerror}") from err
    mounts = mount_table.cgroup_mounts_in(table)
    if paths.get("devices") == "/" and paths.get("", "/") not in ("", "/"):
        # The root v1 devices cgroup (which allows everything) but a v2 cgroup of its own:
        # the runtime ran in v2 mode (pure v2 in a private mount namespace on a hybrid
        # host), so the policy is that cgroup's device programs. Reporting "v1 root, allow
        # all" from the host's namespace would be wrong.
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                directory = cgroup_directory(point, root, paths[""])
                if directory:
                    return Placement(V2, directory, paths[""])
        raise HostError(f"process {pid}'s device policy is on cgroup v2 ({paths[''][:200]}), which is not mounted "
                        "in this mount namespace",
                        "run it in the runtime's mount namespace: nsenter --target <runtime pid> --mount gpuhook ...")
    if "devices" in paths:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and "devices" in options:
                directory = cgroup_directory(point, root, paths["devices"])
                if directory:
                    return Placement(V1, directory, paths["devices"])
        # The root of the v1 devices hierarchy allows everything, so with none visible
        # (pure v2 in a private namespace on a hybrid host) the policy is in v2.
        if paths["devices"] != "/" or "" not in paths:
            raise HostError(f"process {pid} is in a v1 devices cgroup but no devices hierarchy is mounted here")
    if "" in paths:
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                directory = cgroup_directory(point, root, paths[""])
                if directory:
                    return Placement(V2, directory, paths[""])
        raise HostError(f"process {pid} is in a cgroup v2 tree that is not mounted here")
    raise HostError(f"process {pid} has no devices cgroup and no cgroup v2 membership")
