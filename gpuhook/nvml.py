"""The NVML backend: the only module in gpuhook that imports pynvml (nvidia-ml-py).

NVML answers what /proc/driver/nvidia cannot: the CUDA driver version, each GPU's brand and
compute capability, the MIG layout, and the health facts of docs/health.md (processes, memory, ECC
errors, retired pages, remapped rows, a GPU fallen off the bus). Loading it costs about 20 ms
of imports and, without persistence mode, NVML's start-up can take seconds (docs/runtime-facts.md
§4; README, Performance), so nothing imports pynvml before a `Session` is opened: importing this
module is free, and the no-GPU path never opens one.

Usage::

    with nvml.Session(nvml.library_path(config)) as session:
        inventory = session.inventory()
        facts = session.health(uuid)          # thread-safe: one thread per GPU is fine

Every NVML failure becomes an `NvmlError` naming the call and the GPU. A GPU that NVML
reports lost is not an error in `health()` (it is the fact being asked for) and shows up as
`GpuInfo.lost` in `inventory()`. Queries a GPU does not support (retired pages on Ampere,
ECC on a GeForce, ...) read as None.

pynvml has no parameter for the library path; it loads "libnvidia-ml.so.1" into its
module-global `nvmlLib` on first use unless one is already there. A Session therefore
installs its own `ctypes.CDLL(path)` there first (under pynvml's `libLoadLock`), so one
process uses one NVML library at a time; opening a session on a different library while
another is open is refused with a clear error.
"""

import threading

from gpuhook.errors import HostError, NvmlError
from gpuhook.record import record

SYSTEM_LIBRARY = "libnvidia-ml.so.1"

# NVML's nvmlBrandType_t values (index = value) as the tokens NVIDIA_REQUIRE_* constraints
# use (brand=tesla, brand=nvidiartx, ...), as NVIDIA's container toolkit spells them. Values
# past the end (newer brands) read as "unknown".
BRANDS = (
    "unknown", "quadro", "tesla", "nvs", "grid", "geforce", "titan", "nvidiavapps", "nvidiavpc",
    "nvidiavcs", "nvidiavws", "nvidiacloudgaming", "quadrortx", "nvidiartx", "nvidia",
    "geforcertx", "titanrtx",
)

# NVML return codes this module treats specially (nvml.h values; pynvml has the same names).
_NOT_SUPPORTED = 3
_NOT_FOUND = 6
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15


class MigDevice(record("MigDevice", "index uuid gpu_instance_id compute_instance_id name memory_total")):
    """One MIG device (a compute instance) of a GPU; `index` is NVML's MIG device index."""

    __slots__ = ()


class GpuInfo(record(
    "GpuInfo", "index uuid minor bus_id name brand arch mig_mode mig_mode_pending mig_devices lost",
)):
    """One GPU as NVML sees it. `bus_id` is in /proc's form ("0000:18:00.0"), `brand` a token
    from BRANDS, `arch` the compute capability ("9.0"). `mig_mode` and `mig_mode_pending` are
    None when the GPU cannot do MIG. A lost GPU has `lost` True, its index, and None elsewhere."""

    __slots__ = ()


class NvmlHost(record("NvmlHost", "driver_version cuda_version gpus")):
    """The host as NVML sees it: driver version ("550.54.15"), the CUDA version the driver
    supports ("12.4") and its GPUs in NVML index order."""

    __slots__ = ()


class Process(record("Process", "pid used_memory kind gpu_instance_id compute_instance_id")):
    """A process with a context on a GPU. `kind` is "compute" or "graphics"; `used_memory` is
    bytes or None when NVML cannot tell; the instance ids are None outside MIG."""

    __slots__ = ()


class EccCounts(record("EccCounts", "volatile_corrected volatile_uncorrected aggregate_corrected "
                                        "aggregate_uncorrected")):
    """Total ECC error counts. Volatile ones are cleared by a reset; aggregate ones are not."""

    __slots__ = ()


class RetiredPages(record("RetiredPages", "single_bit double_bit pending")):
    """Pages retired for multiple single-bit or a double-bit error; `pending`: retirements
    that need a reset to take effect (GPUs before Ampere)."""

    __slots__ = ()


class RemappedRows(record("RemappedRows", "correctable uncorrectable pending failure")):
    """Rows remapped for correctable/uncorrectable errors; `pending`: remaps that need a
    reset; `failure`: a remap failed at some point (Ampere and later)."""

    __slots__ = ()


class Health(record(
    "Health", "uuid lost lost_in processes memory_total memory_used ecc retired_pages remapped_rows",
)):
    """The facts a pre-start check needs about one GPU or MIG device.

    `lost` is True when NVML reported the GPU lost (fallen off the bus); `lost_in` names the
    call that said so, and the other facts are then None. `ecc`, `retired_pages` and
    `remapped_rows` are None when the GPU does not support them (MIG devices support none).
    """

    __slots__ = ()


def brand_name(value: int) -> str:
    """The constraint token for an NVML brand value ("unknown" for values gpuhook does not know)."""
    return BRANDS[value] if 0 <= value < len(BRANDS) else "unknown"


def library_path(config) -> str:
    """The NVML library to load for `config`: `nvml-library` if set; else the system's
    libnvidia-ml.so.1 (the dynamic linker's when driver-root is / and no driver-lib-dirs are
    named, else the driver's own: in the driver root's ld cache, e.g. a driver container's,
    or in the driver's library dirs)."""
    if config.nvml_library:
        return config.nvml_library
    if config.driver_root == "/" and not config.driver_lib_dirs:
        return SYSTEM_LIBRARY
    from gpuhook import discover

    for lib in discover.libraries(config.driver_root, lib_dirs=config.driver_lib_dirs):
        if lib.bits == 64 and SYSTEM_LIBRARY in lib.sonames:
            return lib.host_path
    raise HostError(f"no {SYSTEM_LIBRARY} among the driver's libraries under driver root {config.driver_root}",
                    "set nvml-library to the NVML library's path")


def _import_pynvml():
    from gpuhook.sitepath import enable_site_packages

    enable_site_packages()  # the hook runs with python -S: site-packages is not on sys.path yet
    try:
        import pynvml
    except ImportError:
        try:
            # The Debian package ships nvidia-ml-py privately (packaging/).
            from gpuhook._vendor import pynvml
        except ImportError:
            raise HostError("pynvml (nvidia-ml-py) is not installed",
                            "install nvidia-ml-py, or the gpuhook package that vendors it") from None
    return pynvml


# One NVML library per process (pynvml keeps it in a module global): which one, and how many
# sessions use it.
_lock = threading.Lock()
_loaded_path = None
_open_sessions = 0


def _install_library(pynvml, path: str) -> None:
    """Make pynvml use the library at `path` (see the module docstring)."""
    import ctypes

    for name in ("nvmlLib", "libLoadLock", "_nvmlGetFunctionPointer_cache", "_nvmlLib_refcount"):
        if not hasattr(pynvml, name):
            raise HostError(f"this pynvml ({getattr(pynvml, '__file__', '?')}) has no {name}; gpuhook cannot "
                            "point it at a chosen NVML library", "install nvidia-ml-py >= 12.535")
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if current is not None and getattr(current, "_name", None) == path:
            return
        if current is not None and pynvml._nvmlLib_refcount > 0:
            raise NvmlError("nvmlInit", f"pynvml already has {getattr(current, '_name', '?')} initialised in "
                            f"this process; cannot switch to {path}")
        try:
            library = ctypes.CDLL(path)
        except OSError as err:
            raise NvmlError("load", f"cannot load {path}: {err}", code=None,
                            hint="is the NVIDIA driver installed? (config key nvml-library)") from err
        pynvml.nvmlLib = library
        # Function pointers cached from a previous library would call into the old one.
        pynvml._nvmlGetFunctionPointer_cache.clear()


# How many times this process initialised NVML: the decision log says what was really loaded
# (an inventory-cache note alone once hid that health had loaded NVML anyway).
INITIALISED = [0]


class Session:
    """An initialised NVML, as a context manager that always shuts it down.

    Sessions nest and may be used from several threads; NVML itself is thread-safe and its
    calls release the GIL, so per-GPU queries in threads run in parallel.
    """

    def __init__(self, library: str = SYSTEM_LIBRARY):
        self.library = library
        self._pynvml = None

    def __enter__(self) -> "Session":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except NvmlError:
            # While another error propagates, it says more than a failed shutdown after it.
            if exc_type is None:
                raise

    def open(self) -> None:
        global _loaded_path, _open_sessions
        if self._pynvml is not None:
            return
        pynvml = _import_pynvml()
        with _lock:
            if _open_sessions and _loaded_path != self.library:
                raise NvmlError("nvmlInit", f"a session on {_loaded_path} is open in this process; "
                                f"cannot also load {self.library}")
            _install_library(pynvml, self.library)
            _call(pynvml, "nvmlInit", None, pynvml.nvmlInit)
            _loaded_path = self.library
            _open_sessions += 1
            INITIALISED[0] += 1
        self._pynvml = pynvml

    def close(self) -> None:
        global _open_sessions
        pynvml, self._pynvml = self._pynvml, None
        if pynvml is None:
            return
        with _lock:
            _open_sessions -= 1
            _call(pynvml, "nvmlShutdown", None, pynvml.nvmlShutdown)

    @property
    def pynvml(self):
        if self._pynvml is None:
            raise HostError("NVML session is not open")
        return self._pynvml

    def driver_version(self) -> str:
        return _call(self.pynvml, "nvmlSystemGetDriverVersion", None, self.pynvml.nvmlSystemGetDriverVersion)

    def cuda_version(self) -> str:
        """The CUDA version the driver supports, as "major.minor"."""
        value = _call(self.pynvml, "nvmlSystemGetCudaDriverVersion", None,
                      self.pynvml.nvmlSystemGetCudaDriverVersion)
        return f"{value // 1000}.{value % 1000 // 10}"

    def inventory(self) -> NvmlHost:
        """Driver and CUDA versions and every GPU with its MIG devices."""
        p = self.pynvml
        count = _call(p, "nvmlDeviceGetCount", None, p.nvmlDeviceGetCount)
        gpus = tuple(self.gpu(index) for index in range(count))
        return NvmlHost(self.driver_version(), self.cuda_version(), gpus)

    def gpu(self, index: int) -> GpuInfo:
        """GPU `index` (NVML order). A lost GPU is returned with `lost` set, not raised."""
        p = self.pynvml
        try:
            handle = _call(p, "nvmlDeviceGetHandleByIndex", index, p.nvmlDeviceGetHandleByIndex, index)
            uuid = _uuid(p, index, handle)
            pci = _call(p, "nvmlDeviceGetPciInfo", uuid, p.nvmlDeviceGetPciInfo, handle)
            major, minor = _call(p, "nvmlDeviceGetCudaComputeCapability", uuid,
                                 p.nvmlDeviceGetCudaComputeCapability, handle)
            mig_mode = _optional(p, "nvmlDeviceGetMigMode", uuid, p.nvmlDeviceGetMigMode, handle)
            mig_devices = ()
            if mig_mode is not None and mig_mode[0]:
                mig_devices = self._mig_devices(handle, uuid)
            return GpuInfo(
                index=index,
                uuid=uuid,
                minor=_call(p, "nvmlDeviceGetMinorNumber", uuid, p.nvmlDeviceGetMinorNumber, handle),
                bus_id=f"{pci.domain & 0xFFFF:04x}:{pci.bus:02x}:{pci.device:02x}.0",
                name=_call(p, "nvmlDeviceGetName", uuid, p.nvmlDeviceGetName, handle),
                brand=brand_name(_call(p, "nvmlDeviceGetBrand", uuid, p.nvmlDeviceGetBrand, handle)),
                arch=f"{major}.{minor}",
                mig_mode=None if mig_mode is None else bool(mig_mode[0]),
                mig_mode_pending=None if mig_mode is None else bool(mig_mode[1]),
                mig_devices=mig_devices,
                lost=False,
            )
        except NvmlError as err:
            if err.code != _GPU_IS_LOST:
                raise
            return GpuInfo(index, None, None, None, None, None, None, None, None, (), True)

    def _mig_devices(self, handle, uuid: str) -> tuple:
        p = self.pynvml
        found = []
        slots = _call(p, "nvmlDeviceGetMaxMigDeviceCount", uuid, p.nvmlDeviceGetMaxMigDeviceCount, handle)
        for index in range(slots):
            try:
                mig = _call(p, "nvmlDeviceGetMigDeviceHandleByIndex", uuid,
                            p.nvmlDeviceGetMigDeviceHandleByIndex, handle, index)
            except NvmlError as err:
                if err.code == _NOT_FOUND:  # an empty slot, not an error
                    continue
                raise
            mig_uuid = _uuid(p, f"{uuid} MIG {index}", mig)
            found.append(MigDevice(
                index=index,
                uuid=mig_uuid,
                gpu_instance_id=_call(p, "nvmlDeviceGetGpuInstanceId", mig_uuid, p.nvmlDeviceGetGpuInstanceId, mig),
                compute_instance_id=_call(p, "nvmlDeviceGetComputeInstanceId", mig_uuid,
                                          p.nvmlDeviceGetComputeInstanceId, mig),
                name=_call(p, "nvmlDeviceGetName", mig_uuid, p.nvmlDeviceGetName, mig),
                memory_total=_call(p, "nvmlDeviceGetMemoryInfo", mig_uuid, p.nvmlDeviceGetMemoryInfo, mig).total,
            ))
        return tuple(found)

    def health(self, uuid: str) -> Health:
        """The health facts of the GPU or MIG device `uuid` (see `Health`)."""
        p = self.pynvml
        try:
            handle = _call(p, "nvmlDeviceGetHandleByUUID", uuid, p.nvmlDeviceGetHandleByUUID, uuid)
            processes = tuple(
                Process(proc.pid, proc.usedGpuMemory, kind, _instance_id(proc.gpuInstanceId),
                        _instance_id(proc.computeInstanceId))
                for kind, call, fn in (
                    ("compute", "nvmlDeviceGetComputeRunningProcesses", p.nvmlDeviceGetComputeRunningProcesses),
                    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses", p.nvmlDeviceGetGraphicsRunningProcesses),
                )
                for proc in _call(p, call, uuid, fn, handle)
            )
            memory = _call(p, "nvmlDeviceGetMemoryInfo", uuid, p.nvmlDeviceGetMemoryInfo, handle)
            return Health(
                uuid=uuid,
                lost=False,
                lost_in=None,
                processes=processes,
                memory_total=memory.total,
                memory_used=memory.used,
                ecc=self._ecc(handle, uuid),
                retired_pages=self._retired_pages(handle, uuid),
                remapped_rows=self._remapped_rows(handle, uuid),
            )
        except NvmlError as err:
            if err.code != _GPU_IS_LOST:
                raise
            return Health(uuid, True, err.call, None, None, None, None, None, None)

    def _ecc(self, handle, uuid: str):
        p = self.pynvml
        counts = []
        for counter in (p.NVML_VOLATILE_ECC, p.NVML_AGGREGATE_ECC):
            for error in (p.NVML_MEMORY_ERROR_TYPE_CORRECTED, p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
                value = _optional(p, "nvmlDeviceGetTotalEccErrors", uuid, p.nvmlDeviceGetTotalEccErrors,
                                  handle, error, counter)
                if value is None:
                    return None
                counts.append(value)
        return EccCounts(*counts)

    def _retired_pages(self, handle, uuid: str):
        p = self.pynvml
        pending = _optional(p, "nvmlDeviceGetRetiredPagesPendingStatus", uuid,
                            p.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        if pending is None:
            return None
        counts = [
            len(_call(p, "nvmlDeviceGetRetiredPages", uuid, p.nvmlDeviceGetRetiredPages, handle, cause))
            for cause in (p.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                          p.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        ]
        return RetiredPages(counts[0], counts[1], bool(pending))

    def _remapped_rows(self, handle, uuid: str):
        p = self.pynvml
        rows = _optional(p, "nvmlDeviceGetRemappedRows", uuid, p.nvmlDeviceGetRemappedRows, handle)
        if rows is None:
            return None
        return RemappedRows(rows[0], rows[1], bool(rows[2]), bool(rows[3]))


def _instance_id(value: int):
    # NVML reports 0xFFFFFFFF for processes that are not on a MIG device.
    return None if value is None or value == 0xFFFFFFFF else value


def _call(pynvml, call: str, gpu, fn, *args):
    """fn(*args), with pynvml's errors turned into NvmlError naming `call` and `gpu`."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        raise NvmlError(call, str(err), None if gpu is None else str(gpu), code=err.value) from err
    except pynvml.NVMLLibraryMismatchError as err:
        raise NvmlError(call, f"the NVML library lacks this function ({err})", None if gpu is None else str(gpu),
                        code=_FUNCTION_NOT_FOUND) from err


def _uuid(pynvml, gpu, handle) -> str:
    """nvmlDeviceGetUUID, refusing anything that is not a UUID's form (gpuhook.discover.is_uuid):
    UUIDs name files and log lines."""
    from gpuhook.discover import is_uuid

    uuid = _call(pynvml, "nvmlDeviceGetUUID", gpu, pynvml.nvmlDeviceGetUUID, handle)
    if not is_uuid(uuid):
        raise NvmlError("nvmlDeviceGetUUID", "it returned text that is not a GPU or MIG UUID", str(gpu))
    return uuid


def _optional(pynvml, call: str, gpu, fn, *args):
    """_call, but None where the GPU does not support the query."""
    try:
        return _call(pynvml, call, gpu, fn, *args)
    except NvmlError as err:
        if err.code == _NOT_SUPPORTED:
            return None
        raise
