"""The container-side actions of a plan, and the order that carries them to the worker.

These records are the part of a gpuhook.plan.make.Plan that the namespace worker (gpuhook.nsworker)
carries out inside the container's mount namespace. They live apart from the planning so the
worker, forked before the planning starts (gpuhook.workerproc), loads only this module and
not the planner's. `encode_order` packs them, as plain tuples, for the pipe to the worker;
`decode_order` unpacks them there.
"""

import marshal

from gpuhook.record import record


class DeviceNode(record("DeviceNode", "path major minor mode uid gid host_path", defaults=(None,))):
    """A character device for the container's /dev: made with mknod, or, for a container in
    a user namespace (where a node on its /dev could not be opened), `host_path` is the
    host's node, bind-mounted in its place (as runc does for its own devices there)."""

    __slots__ = ()


class BindMount(record("BindMount", "source target kind options")):
    """Host `source` bind-mounted at container `target`; `kind` is file, socket or dir."""

    __slots__ = ()


class Symlink(record("Symlink", "path target")):
    __slots__ = ()


class ProcMask(record("ProcMask", "source_dir gpu_buses capabilities", defaults=((),))):
    """Cover the container's /proc/driver/nvidia with a read-only tmpfs holding a copy of
    `params` with ModifyDeviceFiles: 0, `version`, `registry`, only its own GPUs' dirs, and
    the capability files of its own MIG devices (relative paths under capabilities/; CUDA
    reads the nvidia-caps minors from them)."""

    __slots__ = ()

    target = "/proc/driver/nvidia"


class LdCacheUpdate(record("LdCacheUpdate", "ldconfig directories")):
    """Run the HOST's `ldconfig` against the container's rootfs for `directories`."""

    __slots__ = ()


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


class Order(record("Order", "pid rootfs userns proc_in_rootfs dev_tmpfs nodes mounts symlinks proc_mask ldcache")):
    """What the worker carries out: the plan's fields of the same names."""

    __slots__ = ()


def decode_order(data: bytes) -> tuple:
    """(Order, mount namespace id, user namespace id or None, /proc/driver/nvidia files,
    deadline) from `encode_order`'s bytes."""
    (pid, rootfs, userns, proc_in_rootfs, dev_tmpfs, nodes, mounts, symlinks, proc_mask, ldcache,
     mntns, user_ns, proc_files, deadline) = marshal.loads(data)
    order = Order(pid, rootfs, userns, proc_in_rootfs, dev_tmpfs, tuple(DeviceNode(*n) for n in nodes),
                  tuple(BindMount(*m) for m in mounts), tuple(Symlink(*s) for s in symlinks),
                  None if proc_mask is None else ProcMask(*proc_mask),
                  None if ldcache is None else LdCacheUpdate(*ldcache))
    return order, mntns, user_ns, proc_files, deadline
