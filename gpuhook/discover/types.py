"""What discovery finds, as frozen records: a GPU, a driver library, a host file, the inventory.

Records only (docs/architecture.md, "Names and types"): gpuhook.discover.proc and
gpuhook.discover.driverfiles fill them, gpuhook.discover.inventory caches them, planning reads
them.
"""

from gpuhook.record import record


class Gpu(record("Gpu", "index uuid minor bus_id model")):
    """One GPU as the driver's /proc files describe it; index = NVML order (by PCI bus id)."""

    __slots__ = ()

    @property
    def node(self) -> str:
        return f"/dev/nvidia{self.minor}"


class Library(record("Library", "host_path file_name sonames capability bits")):
    """A driver library file and the names (sonames, dev links) that must point at it."""

    __slots__ = ()


class HostFile(record("HostFile", "host_path container_path capability kind")):
    """A binary, firmware blob or IPC endpoint; `kind` is file, socket or dir."""

    __slots__ = ()


class Inventory(record(
    "Inventory", "driver_version gpus majors libraries binaries firmware ipc proc_driver_dir "
                 "mig_minors capabilities",
    defaults=({}, ()),
)):
    """What the host offers. `majors` maps /proc/devices names (nvidia, nvidia-uvm, ...) to
    majors; `mig_minors` maps nvidia-caps names ("config", "gpu0/gi1/access") to minors;
    `capabilities` lists the driver's capability files ("gpu0/mig/gi1/ci0/access"), which
    exist for each MIG instance."""

    __slots__ = ()
