"""The container-side actions of a plan, and the order that carries them to the worker.

These records are the part of a gpuhook.plan.make.Plan that the namespace worker (gpuhook.apply.nsworker)
carries out inside the container's mount namespace. They live apart from the planning so the
worker, forked before the planning starts (gpuhook.apply.worker), loads only this module and
not the planner's. `encode_order` packs them, as plain tuples, for the pipe to the worker;
`decode_order` unpacks them there.
"""

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
