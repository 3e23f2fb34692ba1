"""The container-side actions of a plan, and the order that carries them to the worker.

These records are the part of a gpuhook.plan.records.Plan that the namespace worker (gpuhook.apply.nsworker)
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




class HealthStep(record("HealthStep", "mode gpus on_failure kill_orphans deadline_seconds allocations",
                        defaults=((),))):
    """Check (and repair) `gpus` (UUIDs: whole GPUs and MIG parents) while the rest is
    applied, before it is committed (gpuhook.health.hooks.begin_start); in fallback mode
    a GPU with a fresh stamp made for one of `allocations` (the device plugin's tokens the
    container carries, gpuhook.health.store.allocation_tokens) is skipped."""

    __slots__ = ()


class Plan(record("Plan", (
    "container_id pid rootfs wants channel capabilities gpus "
    "nodes mounts symlinks rules proc_mask ldcache notes migs userns proc_in_rootfs health dev_tmpfs"
), defaults=((), False, False, None, False))):
    """`gpus` are the GPUs whose node the container gets (whole GPUs and MIG parents);
    `migs` the MIG devices (gpuhook.discover.types.MigDevice); `userns` whether the container has a user
    namespace (the apply layer then works as the container's root, and binds device nodes);
    `proc_in_rootfs` whether the spec mounts a procfs at /proc, which the apply layer then
    expects to find in the rootfs it joined (docs/security.md, "the right container");
    `dev_tmpfs` whether the spec has the runtime mount a fresh tmpfs at /dev, the only mount
    besides the rootfs's own that the apply layer writes on (docs/security.md, "Writes only
    on the rootfs and the runtime's /dev")."""

    __slots__ = ()

    @property
    def empty(self) -> bool:
        # Imported here: the namespace worker loads this module for the records it carries
        # out, and must not load the request stage with it (its start-up runs on every start).
        from gpuhook.request.resolve import NOTHING

        return self.wants == NOTHING

    def as_dict(self) -> dict:
        return {
            "container_id": self.container_id,
            "pid": self.pid,
            "rootfs": self.rootfs,
            "wants": self.wants,
            "channel": self.channel,
            "capabilities": sorted(self.capabilities),
            "gpus": [g.identity() for g in self.gpus],
            "mig_devices": [{"id": m.label, "uuid": m.uuid, "gpu": m.gpu_uuid, "gpu_instance": m.gpu_instance_id,
                             "compute_instance": m.compute_instance_id, "profile": m.name} for m in self.migs],
            "device_nodes": [dict(n._asdict(), mode=f"{n.mode:04o}") for n in self.nodes],
            "user_namespace": self.userns,
            "proc_in_rootfs": self.proc_in_rootfs,
            "dev_tmpfs": self.dev_tmpfs,
            "mounts": [dict(m._asdict(), options=list(m.options)) for m in self.mounts],
            "symlinks": [s._asdict() for s in self.symlinks],
            "cgroup_rules": [r.as_dict() for r in self.rules],
            "proc_mask": None if self.proc_mask is None else {
                "target": ProcMask.target,
                "source_dir": self.proc_mask.source_dir,
                "gpu_buses": list(self.proc_mask.gpu_buses),
                "capabilities": list(self.proc_mask.capabilities),
            },
            "ldcache": None if self.ldcache is None else {
                "ldconfig": self.ldcache.ldconfig,
                "directories": list(self.ldcache.directories),
            },
            "health": None if self.health is None else dict(self.health._asdict(), gpus=list(self.health.gpus),
                                                                allocations=list(self.health.allocations)),
            "notes": list(self.notes),
        }
