"""What discovery finds, as frozen records: a GPU, a MIG device, a driver library, a host file,
the inventory.

Records only (docs/architecture.md, "Names and types"): gpuhook.discover.proc and
gpuhook.discover.driverfiles fill them, NVML adds its facts to the same records
(gpuhook.discover.nvml), gpuhook.discover.inventory caches them, planning reads them. A GPU
is one record type and a MIG device another, wherever they come from.
"""

from gpuhook.record import record


class Gpu(record("Gpu", "index uuid minor bus_id model brand arch mig_mode mig_mode_pending mig_devices lost",
                  defaults=(None, None, None, None, (), False))):
    """One GPU: `index` (NVML order, by PCI bus id), `uuid`, `minor` (its /dev/nvidia<minor>),
    `bus_id` in /proc's form ("0000:18:00.0") and `model`, as the driver's /proc files give
    them; then what only NVML knows, None until it was asked (gpuhook.discover.inventory's
    NVML facts): `brand` (a token of nvml.BRANDS), `arch` (the compute capability, "9.0"),
    `mig_mode` and `mig_mode_pending` (None when the GPU cannot do MIG), its `mig_devices`
    (MigDevice). A GPU NVML lost has `lost` True, its index, and None elsewhere."""

    __slots__ = ()

    IDENTITY = ("index", "uuid", "minor", "bus_id", "model")  # what /proc says, and plans show

    @property
    def node(self) -> str:
        return f"/dev/nvidia{self.minor}"

    @property
    def label(self) -> str:
        """How messages name it: "GPU 0 GPU-<uuid>"."""
        return f"GPU {self.index} {self.uuid}"

    def identity(self) -> dict:
        return {name: getattr(self, name) for name in self.IDENTITY}


class MigDevice(record("MigDevice", "index uuid gpu_instance_id compute_instance_id name memory_total "
                                    "gpu_index gpu_uuid gpu_minor", defaults=(None, None, None, None))):
    """One MIG device (a compute instance) of a GPU: `index` is NVML's MIG device index on
    its GPU, `name` its profile ("1g.10gb"), `memory_total` bytes (None when not asked); the
    GPU it is part of by index, UUID and minor (its capability nodes are named by the minor)."""

    __slots__ = ()

    @property
    def label(self) -> str:
        """Its id in a request: "GPU:MIG" by index ("1:0")."""
        return f"{self.gpu_index}:{self.index}"


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
