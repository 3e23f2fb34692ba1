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
`Gpu.lost` in `inventory()`. Queries a GPU does not support (retired pages on Ampere,
ECC on a GeForce, ...) read as None, and so do queries an older driver lacks.

Older drivers: NVML grew versioned entry points (docs/health.md, "Drivers"). The process
queries try `_v3` (driver 510 on), then `_v2` (455 on), then the first version, and memory
tries `nvmlDeviceGetMemoryInfo_v2` (510 on, which reports the driver's own reserve apart
from what is used) before the first version (which counts the reserve as used); what a
library lacks is remembered for the process.

Resets: `nvidia-smi --gpu-reset` refuses while any application has NVML open on the host,
monitoring tools included. `closed_for_reset()` shuts every session of this process down
for the time of a reset (waiting for calls in flight; calls made meanwhile wait) and starts
them again after, and `exclusive()` waits for the sessions of other gpuhook processes: a
session opened with a `client_lock` holds that file shared (flock) while NVML is open here,
and a reset holds it exclusively.

pynvml has no parameter for the library path; it loads "libnvidia-ml.so.1" into its
module-global `nvmlLib` on first use unless one is already there. A Session therefore
installs its own `ctypes.CDLL(path)` there first (under pynvml's `libLoadLock`), so one
process uses one NVML library at a time; opening a session on a different library while
another is open is refused with a clear error.
"""

import threading
import time

from gpuhook.discover.types import Gpu, MigDevice
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
_ARGUMENT_VERSION_MISMATCH = 25
_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long

# The process queries, newest first: (entry point, its struct has MIG instance ids).
_PROCESS_CALLS = {
    "compute": (("nvmlDeviceGetComputeRunningProcesses_v3", True), ("nvmlDeviceGetComputeRunningProcesses_v2", True),
                ("nvmlDeviceGetComputeRunningProcesses", False)),
    "graphics": (("nvmlDeviceGetGraphicsRunningProcesses_v3", True),
                 ("nvmlDeviceGetGraphicsRunningProcesses_v2", True), ("nvmlDeviceGetGraphicsRunningProcesses", False)),
}


class NvmlHost(record("NvmlHost", "driver_version cuda_version gpus")):
    """The host as NVML sees it: driver version ("550.54.15"), the CUDA version the driver
    supports ("12.4") and its GPUs (gpuhook.discover.types.Gpu, NVML's facts filled in) in
    NVML index order."""

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
    "Health", "uuid lost lost_in processes memory_total memory_used ecc retired_pages remapped_rows memory_reserved",
    defaults=(None,),
)):
    """The facts a pre-start check needs about one GPU or MIG device.

    `lost` is True when NVML reported the GPU lost (fallen off the bus); `lost_in` names the
    call that said so, and the other facts are then None. `ecc`, `retired_pages` and
    `remapped_rows` are None when the GPU does not support them (MIG devices support none).
    `memory_used` is what processes and leftovers use; `memory_reserved` the driver's own
    reserve, or None where the driver has only the first memory call, whose `used` includes
    the reserve.
    """

    __slots__ = ()


class ResetFacts(record("ResetFacts", "persistence mig_mode mig_devices")):
    """What decides how (and whether) gpuhook resets a GPU: its persistence mode and current
    MIG mode (None where the GPU cannot tell) and how many MIG devices it has."""

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
    from gpuhook.discover.driverfiles import libraries

    for lib in libraries(config.driver_root, lib_dirs=config.driver_lib_dirs):
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
                            hint="is the NVIDIA driver installed? config key nvml-library names the library") from err
        pynvml.nvmlLib = library
        # Function pointers cached from a previous library would call into the old one.
        pynvml._nvmlGetFunctionPointer_cache.clear()
        _missing.clear()


# How many times this process attached NVML (started it with no session open): the decision
# log says what was really loaded (an inventory-cache note alone once hid that health had
# loaded NVML anyway).
INITIALISED = [0]

# Entry points the loaded library lacks (an older driver), so they are not tried again.
_missing = set()

# How long a call made while a reset has NVML closed waits for it to open again, and how long
# reopening waits for another gpuhook process's reset to end: resets are bounded by their
# own timeouts (health.reset-timeout-seconds), so these are only a last resort.
CALL_WAIT_SECONDS = 120.0
CLIENT_LOCK_WAIT_SECONDS = 60.0


class NvmlBusy(NvmlError):
    """NVML could not be closed for a reset in time: calls still in flight in this process,
    or another gpuhook process's sessions."""

    def __init__(self, detail: str):
        super().__init__("nvmlShutdown", f"could not close NVML for a GPU reset: {detail}")
        self.detail = detail


class _Gate:
    """The state of NVML in this process, shared by every Session (module docstring, Resets).

    `active`: threads inside NVML calls; `suspenders`: threads that need NVML closed (resets);
    `closed`: NVML is shut down for them; `held`: client-lock path -> [fd, sessions];
    `exclusive`: client-lock path -> [fd, holders] for resets."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.active = 0
        self.suspenders = 0
        self.closed = False
        self.broken = None
        self.held = {}
        self.exclusive = {}

    def use(self):
        return _Use(self)


class _Use:
    """One NVML call (or a run of calls that share handles), held off while NVML is closed."""

    def __init__(self, gate):
        self.gate = gate

    def __enter__(self):
        gate = self.gate
        end = time.monotonic() + CALL_WAIT_SECONDS
        with gate.cond:
            while gate.suspenders:
                left = end - time.monotonic()
                if left <= 0:
                    raise NvmlError("nvmlInit", "NVML stayed closed for a GPU reset for too long")
                gate.cond.wait(left)
            if gate.broken is not None:
                raise NvmlError("nvmlInit", f"NVML could not be started again after a GPU reset: {gate.broken}")
            gate.active += 1
        return self

    def __exit__(self, *exc):
        gate = self.gate
        with gate.cond:
            gate.active -= 1
            if not gate.active:
                gate.cond.notify_all()


_gate = _Gate()


def _flock(path: str, operation: int, until: float):
    """A descriptor of the lock file `path` holding `operation` (LOCK_SH or LOCK_EX), polled
    until monotonic time `until`; None when that passed first. Raises OSError (a missing file
    too: whoever names the lock makes it, gpuhook.health.actions.client_lock; flock needs no
    write access)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    pause = 0.002
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
        except OSError:
            os.close(fd)
            raise
        left = until - time.monotonic()
        if left <= 0:
            os.close(fd)
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _hold_client_lock(path: str) -> None:
    """Count a session on client lock `path`; the first one takes it shared. Call with the
    gate's lock held."""
    entry = _gate.held.get(path)
    if entry is not None:
        entry[1] += 1
        return
    try:
        fd = _flock(path, _LOCK_SH, time.monotonic() + CLIENT_LOCK_WAIT_SECONDS)
    except OSError:
        fd = None  # an unwritable state dir must not stop the checks; only resets lose the guard
    _gate.held[path] = [-1 if fd is None else fd, 1]


def _drop_client_lock(path: str) -> None:
    import os

    entry = _gate.held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _gate.held[path]
        if entry[0] >= 0:
            os.close(entry[0])


_LOCK_SH, _LOCK_EX = 1, 2  # fcntl.LOCK_SH, LOCK_EX (Linux values; fcntl is imported only when needed)


class Session:
    """An initialised NVML, as a context manager that always shuts it down.

    Sessions nest and may be used from several threads; NVML itself is thread-safe and its
    calls release the GIL, so per-GPU queries in threads run in parallel. `client_lock`: a
    file this process holds shared while the session is open, so that gpuhook's resets in
    other processes wait for it (see `exclusive`).
    """

    def __init__(self, library: str = SYSTEM_LIBRARY, client_lock: str | None = None):
        self.library = library
        self.client_lock = client_lock
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
        end = time.monotonic() + CALL_WAIT_SECONDS
        with _gate.cond:
            while _gate.suspenders:  # a reset has NVML closed: open when it is done
                left = end - time.monotonic()
                if left <= 0:
                    raise NvmlError("nvmlInit", "NVML stayed closed for a GPU reset for too long")
                _gate.cond.wait(left)
            # Shared before NVML attaches: a reset in another gpuhook process that holds it
            # exclusively must never find this process attached (gpuhook.discover.nvml.exclusive).
            if self.client_lock:
                _hold_client_lock(self.client_lock)
            try:
                with _lock:
                    if _open_sessions and _loaded_path != self.library:
                        raise NvmlError("nvmlInit", f"a session on {_loaded_path} is open in this process; "
                                        f"cannot also load {self.library}")
                    _install_library(pynvml, self.library)
                    # After a reset NVML could not be started again for the open sessions:
                    # start it for them too, so that every session's close has its nvmlInit.
                    starts = 1 + (_open_sessions if _gate.broken is not None else 0)
                    for _ in range(starts):
                        _call(pynvml, "nvmlInit", None, pynvml.nvmlInit)
                    _gate.broken = None
                    if not _open_sessions:
                        INITIALISED[0] += 1
                    _loaded_path = self.library
                    _open_sessions += 1
            except BaseException:
                if self.client_lock:
                    _drop_client_lock(self.client_lock)
                raise
        self._pynvml = pynvml

    def close(self) -> None:
        global _open_sessions
        pynvml, self._pynvml = self._pynvml, None
        if pynvml is None:
            return
        with _gate.cond:
            try:
                with _lock:
                    _open_sessions -= 1
                    if _gate.closed or _gate.broken is not None:
                        # Shut down for a reset already (it is not started again for this one),
                        # or it could not be started again after one.
                        if not _open_sessions:
                            _gate.broken = None
                        return
                    _call(pynvml, "nvmlShutdown", None, pynvml.nvmlShutdown)
            finally:
                # Dropped once NVML let go: a reset elsewhere may then find nothing attached.
                if self.client_lock:
                    _drop_client_lock(self.client_lock)

    @property
    def pynvml(self):
        if self._pynvml is None:
            raise HostError("NVML session is not open")
        return self._pynvml

    def driver_version(self) -> str:
        with _gate.use():
            return self._driver_version()

    def _driver_version(self) -> str:
        return _call(self.pynvml, "nvmlSystemGetDriverVersion", None, self.pynvml.nvmlSystemGetDriverVersion)

    def cuda_version(self) -> str:
        """The CUDA version the driver supports, as "major.minor"."""
        with _gate.use():
            return self._cuda_version()

    def _cuda_version(self) -> str:
        value = _call(self.pynvml, "nvmlSystemGetCudaDriverVersion", None,
                      self.pynvml.nvmlSystemGetCudaDriverVersion)
        return f"{value // 1000}.{value % 1000 // 10}"

    def inventory(self) -> NvmlHost:
        """Driver and CUDA versions and every GPU with its MIG devices."""
        p = self.pynvml
        with _gate.use():
            count = _call(p, "nvmlDeviceGetCount", None, p.nvmlDeviceGetCount)
            gpus = tuple(self._gpu(index) for index in range(count))
            return NvmlHost(self._driver_version(), self._cuda_version(), gpus)

    def gpu(self, index: int) -> Gpu:
        """GPU `index` (NVML order). A lost GPU is returned with `lost` set, not raised."""
        with _gate.use():
            return self._gpu(index)

    def _gpu(self, index: int) -> Gpu:
        p = self.pynvml
        try:
            handle = _call(p, "nvmlDeviceGetHandleByIndex", index, p.nvmlDeviceGetHandleByIndex, index)
            uuid = _uuid(p, index, handle)
            pci = _call(p, "nvmlDeviceGetPciInfo", uuid, p.nvmlDeviceGetPciInfo, handle)
            cc_major, cc_minor = _call(p, "nvmlDeviceGetCudaComputeCapability", uuid,
                                 p.nvmlDeviceGetCudaComputeCapability, handle)
            mig_mode = _optional(p, "nvmlDeviceGetMigMode", uuid, p.nvmlDeviceGetMigMode, handle)
            node_minor = _call(p, "nvmlDeviceGetMinorNumber", uuid, p.nvmlDeviceGetMinorNumber, handle)
            mig_devices = ()
            if mig_mode is not None and mig_mode[0]:
                mig_devices = self._mig_devices(handle, uuid, index, node_minor)
            return Gpu(
                index=index,
                uuid=uuid,
                minor=node_minor,
                bus_id=f"{pci.domain & 0xFFFF:04x}:{pci.bus:02x}:{pci.device:02x}.0",
                model=_call(p, "nvmlDeviceGetName", uuid, p.nvmlDeviceGetName, handle),
                brand=brand_name(_call(p, "nvmlDeviceGetBrand", uuid, p.nvmlDeviceGetBrand, handle)),
                arch=f"{cc_major}.{cc_minor}",
                mig_mode=None if mig_mode is None else bool(mig_mode[0]),
                mig_mode_pending=None if mig_mode is None else bool(mig_mode[1]),
                mig_devices=mig_devices,
                lost=False,
            )
        except NvmlError as err:
            if err.code != _GPU_IS_LOST:
                raise
            return Gpu(index, None, None, None, None, lost=True)

    def _mig_devices(self, handle, uuid: str, gpu_index=None, gpu_minor=None) -> tuple:
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
                gpu_index=gpu_index,
                gpu_uuid=uuid,
                gpu_minor=gpu_minor,
            ))
        return tuple(found)

    def health(self, uuid: str) -> Health:
        """The health facts of the GPU or MIG device `uuid` (see `Health`)."""
        p = self.pynvml
        with _gate.use():
            try:
                handle = _call(p, "nvmlDeviceGetHandleByUUID", uuid, p.nvmlDeviceGetHandleByUUID, uuid)
                processes = tuple(process for kind in ("compute", "graphics")
                                  for process in self._processes(handle, uuid, kind))
                total, used, reserved = self._memory(handle, uuid)
                return Health(
                    uuid=uuid,
                    lost=False,
                    lost_in=None,
                    processes=processes,
                    memory_total=total,
                    memory_used=used,
                    memory_reserved=reserved,
                    ecc=self._ecc(handle, uuid),
                    retired_pages=self._retired_pages(handle, uuid),
                    remapped_rows=self._remapped_rows(handle, uuid),
                )
            except NvmlError as err:
                if err.code != _GPU_IS_LOST:
                    raise
                return Health(uuid, True, err.call, None, None, None, None, None, None)

    def _processes(self, handle, uuid: str, kind: str) -> tuple:
        """The `kind` ("compute" or "graphics") processes, by the newest query the driver has."""
        import ctypes

        p = self.pynvml
        for name, with_instances in _PROCESS_CALLS[kind]:
            if name in _missing:
                continue
            struct = p.c_nvmlProcessInfo_v2_t if with_instances else _process_info_v1()
            try:
                fn = _call(p, name, uuid, p._nvmlGetFunctionPointer, name)
            except NvmlError as err:
                if err.code != _FUNCTION_NOT_FOUND:
                    raise
                _missing.add(name)
                continue
            count = ctypes.c_uint(0)
            ret = fn(handle, ctypes.byref(count), None)
            entries = ()
            # NVML's size query: SUCCESS means none; INSUFFICIENT_SIZE gives the count. More
            # processes can appear between the two calls, hence the spare room and the retry.
            while ret == p.NVML_ERROR_INSUFFICIENT_SIZE:
                count.value = count.value * 2 + 5
                entries = (struct * count.value)()
                ret = fn(handle, ctypes.byref(count), entries)
            if ret != p.NVML_SUCCESS:
                raise NvmlError(name, str(p.NVMLError(ret)), uuid, code=ret)
            return tuple(
                Process(entry.pid, None if entry.usedGpuMemory == _NOT_AVAILABLE else entry.usedGpuMemory, kind,
                        _instance_id(entry.gpuInstanceId) if with_instances else None,
                        _instance_id(entry.computeInstanceId) if with_instances else None)
                for entry in entries[:count.value]
            ) if entries else ()
        raise NvmlError(_PROCESS_CALLS[kind][-1][0], "the NVML library has none of its versions", uuid,
                        code=_FUNCTION_NOT_FOUND)

    def _memory(self, handle, uuid: str) -> tuple:
        """(total, used, reserved) bytes: reserved None where only the first version exists,
        whose `used` includes the driver's reserve."""
        p = self.pynvml
        name = "nvmlDeviceGetMemoryInfo_v2"
        if name not in _missing and hasattr(p, "nvmlMemory_v2"):
            try:
                memory = _call(p, name, uuid, p.nvmlDeviceGetMemoryInfo, handle, p.nvmlMemory_v2)
                return memory.total, memory.used, memory.reserved
            except NvmlError as err:
                if err.code in (_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH):
                    _missing.add(name)  # an older driver: it lacks the call or knows another struct
                elif err.code != _NOT_SUPPORTED:
                    raise
        memory = _call(p, "nvmlDeviceGetMemoryInfo", uuid, p.nvmlDeviceGetMemoryInfo, handle)
        return memory.total, memory.used, None

    def reset_facts(self, uuid: str) -> ResetFacts:
        """Persistence and MIG mode of GPU `uuid` (see ResetFacts)."""
        p = self.pynvml
        with _gate.use():
            handle = _call(p, "nvmlDeviceGetHandleByUUID", uuid, p.nvmlDeviceGetHandleByUUID, uuid)
            persistence = _optional(p, "nvmlDeviceGetPersistenceMode", uuid, p.nvmlDeviceGetPersistenceMode, handle)
            mig_mode = _optional(p, "nvmlDeviceGetMigMode", uuid, p.nvmlDeviceGetMigMode, handle)
            current = None if mig_mode is None else bool(mig_mode[0])
            devices = len(self._mig_devices(handle, uuid)) if current else 0
            return ResetFacts(None if persistence is None else bool(persistence), current, devices)

    def set_persistence(self, uuid: str, enabled: bool) -> None:
        """Turn persistence mode of GPU `uuid` on or off (root only). Where nvidia-persistenced
        runs, the driver library asks the daemon, which then keeps or closes the GPU's device
        file (docs/health.md, Persistence mode)."""
        p = self.pynvml
        with _gate.use():
            handle = _call(p, "nvmlDeviceGetHandleByUUID", uuid, p.nvmlDeviceGetHandleByUUID, uuid)
            mode = p.NVML_FEATURE_ENABLED if enabled else p.NVML_FEATURE_DISABLED
            _call(p, "nvmlDeviceSetPersistenceMode", uuid, p.nvmlDeviceSetPersistenceMode, handle, mode)

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


class closed_for_reset:
    """Context manager: every NVML session of this process shut down while it is entered, and
    started again when it is left (module docstring, Resets).

    Entering waits (until monotonic time `until`) for NVML calls in flight to finish; calls
    and new sessions wait meanwhile. Resets of several GPUs share one closing. Raises
    NvmlBusy when calls are still running at `until`. If NVML cannot be started again, the
    sessions' calls fail with NvmlError saying so.
    """

    def __init__(self, until: float):
        self.until = until

    def __enter__(self):
        gate = _gate
        with gate.cond:
            gate.suspenders += 1
            try:
                while not gate.closed:
                    if not gate.active:
                        _shut_down_all()
                        gate.closed = True
                        break
                    left = self.until - time.monotonic()
                    if left <= 0:
                        raise NvmlBusy("NVML calls of this process were still running")
                    gate.cond.wait(left)
            except BaseException:
                gate.suspenders -= 1
                gate.cond.notify_all()
                raise
        return self

    def __exit__(self, *exc):
        gate = _gate
        with gate.cond:
            gate.suspenders -= 1
            if not gate.suspenders and gate.closed:
                gate.closed = False
                _start_all()
            gate.cond.notify_all()


def _shut_down_all() -> None:
    """nvmlShutdown for every open session, and their client locks dropped (gate lock held)."""
    import os

    with _lock:
        if _open_sessions:
            pynvml = _import_pynvml()
            for _ in range(_open_sessions):
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError:
                    break
    for path, entry in _gate.held.items():
        if entry[0] >= 0:
            os.close(entry[0])
            entry[0] = -1


def _start_all() -> None:
    """Undo _shut_down_all (gate lock held): client locks first, then nvmlInit per session."""
    for path, entry in _gate.held.items():
        try:
            fd = _flock(path, _LOCK_SH, time.monotonic() + CLIENT_LOCK_WAIT_SECONDS)
        except OSError:
            fd = None
        entry[0] = -1 if fd is None else fd
    with _lock:
        if not _open_sessions:
            return
        pynvml = _import_pynvml()
        INITIALISED[0] += 1
        started = 0
        try:
            for started in range(1, _open_sessions + 1):
                _call(pynvml, "nvmlInit", None, pynvml.nvmlInit)
        except NvmlError as err:
            for _ in range(started - 1):  # all or nothing: Session.open starts them all again
                try:
                    pynvml.nvmlShutdown()
                except pynvml.NVMLError:
                    break
            _gate.broken = err.one_line()


class exclusive:
    """Context manager: client lock `path` held exclusively, so that no other gpuhook process
    has a session on it (their sessions take it shared; see Session). Threads of this process
    share one hold. Enter it inside `closed_for_reset`, which drops this process's own shared
    holds. Raises NvmlBusy when other processes' sessions are still open at monotonic time
    `until`."""

    def __init__(self, path: str, until: float):
        self.path = path
        self.until = until

    def __enter__(self):
        gate = _gate
        with gate.cond:
            while True:
                entry = gate.exclusive.get(self.path)
                if entry is None:
                    entry = gate.exclusive[self.path] = [None, 1]
                    break
                entry[1] += 1
                while entry[0] is None and gate.exclusive.get(self.path) is entry:
                    left = self.until - time.monotonic()
                    if left <= 0:
                        entry[1] -= 1
                        raise NvmlBusy("other gpuhook processes have NVML open")
                    gate.cond.wait(left)
                if entry[0] is not None:
                    return self
                # The thread taking it gave up; try again.
        try:
            fd = _flock(self.path, _LOCK_EX, self.until)
        except OSError as err:
            fd, why = None, f"cannot lock {self.path}: {err.strerror}"
        else:
            why = "other gpuhook processes have NVML open"
        with gate.cond:
            if fd is None:
                del gate.exclusive[self.path]
                gate.cond.notify_all()
                raise NvmlBusy(why)
            entry[0] = fd
            gate.cond.notify_all()
        return self

    def __exit__(self, *exc):
        import os

        gate = _gate
        with gate.cond:
            entry = gate.exclusive[self.path]
            entry[1] -= 1
            if entry[1] <= 0:
                del gate.exclusive[self.path]
                os.close(entry[0])


_v1_struct = []


def _process_info_v1():
    """nvml.h's nvmlProcessInfo_v1_t, the first process queries' entries (no MIG instance ids);
    made on first use, as ctypes is imported only with a session."""
    if not _v1_struct:
        import ctypes

        class ProcessInfoV1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

        _v1_struct.append(ProcessInfoV1)
    return _v1_struct[0]


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
    """nvmlDeviceGetUUID, refusing anything that is not a UUID's form (gpuhook.driver.is_uuid):
    UUIDs name files and log lines."""
    from gpuhook.driver import is_uuid

    uuid = _call(pynvml, "nvmlDeviceGetUUID", gpu, pynvml.nvmlDeviceGetUUID, handle)
    if not is_uuid(uuid):
        raise NvmlError("nvmlDeviceGetUUID", "it returned text that is not a GPU or MIG UUID", str(gpu))
    return uuid


def _optional(pynvml, call: str, gpu, fn, *args):
    """_call, but None where the GPU does not support the query or the driver lacks it."""
    try:
        return _call(pynvml, call, gpu, fn, *args)
    except NvmlError as err:
        if err.code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
            return None
        raise
