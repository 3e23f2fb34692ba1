"""The simulated NVML's state file: what its GPUs report, and the faults tests inject.

`gpuhook simulate DIR` writes DIR/nvml.json; the simulated libnvidia-ml (csrc/nvml_sim.c)
re-reads it whenever it changes and the simulated `nvidia-smi --gpu-reset` rewrites it. The
format and every field are documented in docs/simulated-host.md; `FIELDS` below is the
same list in code, used to validate every write so a typo fails here, not as a puzzling
NVML answer later.

Edits go through `update()` (or `set_host`, `set_gpu`, `add_process` on top of it): it takes
the same flock ("<file>.lock") as the C side and replaces the file atomically, so the
library never reads half a file and concurrent writers lose nothing. Example::

    from gpuhook.simulate import nvml as simnvml
    simnvml.set_gpu(state, 0, ecc_volatile_uncorrected=2, remapped_rows_pending=True)
    simnvml.add_process(state, "GPU-...", pid=4242, used_memory=1 << 30, stale=True)
"""

import fcntl
import json
import os

from gpuhook.discover.nvml import BRANDS
from gpuhook.simulate import SimulationError

STATE_FILE = "nvml.json"
ENV_VAR = "GPUHOOK_NVML_STATE"  # overrides the state path compiled into the library and tool
FORMAT = 1
MAX_GPUS = 64
MAX_MIG_DEVICES = 7
MAX_GPU_INSTANCE_ID = 14
MAX_COMPUTE_INSTANCE_ID = 7
MAX_LATENCY_MS = 3600 * 1000
NOT_ON_MIG = 0xFFFFFFFF

# Field name -> (kind, default). A default of None marks a required field. Kinds are checked
# by _check_value; the C loader (csrc/simstate.c) accepts exactly these names.
HOST_FIELDS = {
    "format": ("format", FORMAT),
    "driver_version": ("driver-version", None),
    "cuda_version": ("major.minor", None),
    "nvml_version": ("text", None),  # optional: the library derives "<cuda major>.<driver version>"
    "call_latency_ms": ("ms", 0),
    "init_latency_ms": ("ms", 0),
    "gpus": ("gpus", None),
}
GPU_FIELDS = {
    "uuid": ("gpu-uuid", None),
    "name": ("text", None),
    "brand": ("brand", "unknown"),
    "minor": ("minor", None),
    "bus_id": ("bus-id", None),
    "pci_device_id": ("u32", 0x233010DE),
    "pci_subsystem_id": ("u32", 0),
    "compute_capability": ("major.minor", "9.0"),
    "memory_total": ("bytes", 0),
    "memory_used": ("bytes", 0),
    "memory_reserved": ("bytes", 0),
    "persistence_mode": ("bool", False),
    "reset_peers": ("gpu-uuids", []),
    "compute_processes": ("processes", []),
    "graphics_processes": ("processes", []),
    "ecc_enabled": ("bool", True),
    "ecc_volatile_corrected": ("count", 0),
    "ecc_volatile_uncorrected": ("count", 0),
    "ecc_aggregate_corrected": ("count", 0),
    "ecc_aggregate_uncorrected": ("count", 0),
    "retired_pages_single_bit": ("pages", 0),
    "retired_pages_double_bit": ("pages", 0),
    "retired_pages_pending": ("bool", False),
    "remapped_rows_correctable": ("u32", 0),
    "remapped_rows_uncorrectable": ("u32", 0),
    "remapped_rows_pending": ("bool", False),
    "remapped_rows_failure": ("bool", False),
    "lost": ("bool", False),
    "mig_capable": ("bool", False),
    "mig_mode": ("bool", False),
    "mig_mode_pending": ("bool", None),  # None here: defaults to mig_mode, not required
    "mig_devices": ("mig-devices", []),
    "handle_latency_ms": ("ms", 0),
    "reset_fails": ("bool", False),
    "reset_hangs": ("bool", False),
    "reset_does_not_fix": ("bool", False),
    "reset_latency_ms": ("ms", 0),
    "reset_count": ("u32", 0),
    "reset_overlaps": ("u32", 0),
}
PROCESS_FIELDS = {
    "pid": ("pid", None),
    "used_memory": ("bytes", 0),
    "gpu_instance_id": ("u32", NOT_ON_MIG),
    "compute_instance_id": ("u32", NOT_ON_MIG),
    "stale": ("bool", False),
}
MIG_FIELDS = {
    "gpu_instance_id": ("gpu-instance", None),
    "compute_instance_id": ("compute-instance", 0),
    "uuid": ("mig-uuid", None),
    "profile": ("profile", None),
    "memory_total": ("bytes", 0),
    "memory_used": ("bytes", 0),
}
OPTIONAL_WITHOUT_DEFAULT = {"nvml_version", "mig_mode_pending"}


def state_path(directory: str) -> str:
    """The state file of the simulated host in `directory`."""
    return os.path.join(directory, STATE_FILE)


def new_state(driver_version: str, cuda_version: str, gpus: list, call_latency_ms: int = 0,
              init_latency_ms: int = 0) -> dict:
    """A complete state document (validated)."""
    state = {
        "format": FORMAT,
        "driver_version": driver_version,
        "cuda_version": cuda_version,
        "call_latency_ms": call_latency_ms,
        "init_latency_ms": init_latency_ms,
        "gpus": list(gpus),
    }
    validate(state)
    return state


def gpu_state(uuid: str, name: str, minor: int, bus_id: str, **fields) -> dict:
    """A healthy GPU's state: every field at its default, then `fields`."""
    gpu = {"uuid": uuid, "name": name, "minor": minor, "bus_id": bus_id}
    for field, (_kind, default) in GPU_FIELDS.items():
        if field not in gpu and field not in OPTIONAL_WITHOUT_DEFAULT:
            gpu[field] = list(default) if isinstance(default, list) else default
    _apply(gpu, fields, GPU_FIELDS, "gpu")
    return gpu


def process(pid: int, used_memory: int = 0, stale: bool = False, gpu_instance_id: int | None = None,
            compute_instance_id: int | None = None) -> dict:
    """A process entry. The simulated driver reports it while `pid` holds its files (exists and
    has a thread that has not exited: not a zombie), or always if `stale`."""
    entry = {"pid": pid, "used_memory": used_memory, "stale": stale}
    if gpu_instance_id is not None:
        entry["gpu_instance_id"] = gpu_instance_id
        entry["compute_instance_id"] = 0 if compute_instance_id is None else compute_instance_id
    return entry


def validate(state) -> None:
    """Raise SimulationError naming the first field that the simulated NVML would reject."""
    _check_object(state, HOST_FIELDS, "")
    gpus = state["gpus"]
    seen = {"uuid": {}, "minor": {}, "bus_id": {}, "mig": {}}
    for i, gpu in enumerate(gpus):
        where = f"gpus[{i}]"
        for field in ("uuid", "minor", "bus_id"):
            key = _bus_key(gpu[field]) if field == "bus_id" else gpu[field]
            if key in seen[field]:
                raise SimulationError(f"nvml state: {where}.{field}: same as gpus[{seen[field][key]}]")
            seen[field][key] = i
        mig_on = gpu.get("mig_mode", False) or gpu.get("mig_mode_pending", False)
        if mig_on and not gpu.get("mig_capable", False):
            raise SimulationError(f"nvml state: {where}.mig_mode: needs \"mig_capable\": true")
        instances = set()
        for j, device in enumerate(gpu.get("mig_devices", [])):
            pair = (device["gpu_instance_id"], device.get("compute_instance_id", 0))
            if pair in instances:
                raise SimulationError(f"nvml state: {where}.mig_devices[{j}]: GPU instance {pair[0]} compute "
                                      f"instance {pair[1]} is listed twice")
            instances.add(pair)
            if device["uuid"] in seen["mig"]:
                other = seen["mig"][device["uuid"]]
                raise SimulationError(f"nvml state: {where}.mig_devices[{j}].uuid: also on gpus[{other}]")
            seen["mig"][device["uuid"]] = i
    uuids = [gpu["uuid"] for gpu in gpus]
    for i, gpu in enumerate(gpus):
        for peer in gpu.get("reset_peers", []):
            if peer == gpu["uuid"] or peer not in uuids:
                raise SimulationError(f"nvml state: gpus[{i}].reset_peers: {peer} is not another GPU of this host")


def load(path: str) -> dict:
    """Read and validate the state file."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as err:
        raise SimulationError(f"cannot read NVML state {path}: {err.strerror}") from err
    try:
        state = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SimulationError(f"NVML state {path} is not valid JSON: {err}") from err
    try:
        validate(state)
    except SimulationError as err:
        raise SimulationError(f"{path}: {err.message}") from None
    return state


def save(path: str, state: dict) -> None:
    """Validate `state` and replace the state file with it, under the state lock."""
    validate(state)
    with _locked(path):
        _write(path, state)


def update(path: str, change) -> dict:
    """Apply `change(state)` (which edits the dict in place) under the state lock; returns the
    saved state. The read, the change and the write are one step for every other writer."""
    with _locked(path):
        state = load(path)
        change(state)
        validate(state)
        _write(path, state)
    return state


def set_host(path: str, **fields) -> dict:
    """Set host-level fields (driver_version, cuda_version, call_latency_ms, ...)."""
    def change(state):
        _apply(state, fields, {k: v for k, v in HOST_FIELDS.items() if k not in ("format", "gpus")}, "host")
    return update(path, change)


def set_gpu(path: str, gpu, **fields) -> dict:
    """Set fields of one GPU, named by NVML index or UUID; returns the saved state."""
    def change(state):
        _apply(state["gpus"][_gpu_index(state, gpu)], fields, GPU_FIELDS, "gpu")
    return update(path, change)


def add_process(path: str, gpu, pid: int, used_memory: int = 0, kind: str = "compute", stale: bool = False,
                gpu_instance_id: int | None = None, compute_instance_id: int | None = None) -> dict:
    """Put a process on a GPU (kind "compute" or "graphics"); see `process()`."""
    if kind not in ("compute", "graphics"):
        raise SimulationError(f"process kind must be compute or graphics, not {kind!r}")
    entry = process(pid, used_memory, stale, gpu_instance_id, compute_instance_id)

    def change(state):
        state["gpus"][_gpu_index(state, gpu)].setdefault(f"{kind}_processes", []).append(entry)
    return update(path, change)


def _gpu_index(state: dict, gpu) -> int:
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        if 0 <= gpu < len(state["gpus"]):
            return gpu
        raise SimulationError(f"no simulated GPU with index {gpu} (there are {len(state['gpus'])})")
    for i, entry in enumerate(state["gpus"]):
        if entry["uuid"] == gpu:
            return i
    raise SimulationError(f"no simulated GPU {gpu!r}")


def _apply(entry: dict, fields: dict, known: dict, what: str) -> None:
    for name, value in fields.items():
        if name not in known:
            raise SimulationError(f"unknown {what} field {name!r} (known: {', '.join(known)})")
        entry[name] = value


class _locked:
    """flock on "<path>.lock", the lock the simulated nvidia-smi takes for its writes."""

    def __init__(self, path: str):
        self.path = path + ".lock"
        self.fd = -1

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as err:
            if self.fd >= 0:
                os.close(self.fd)
            raise SimulationError(f"cannot lock {self.path}: {err.strerror}") from err
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _write(path: str, state: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(state, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise SimulationError(f"cannot write NVML state {path}: {err.strerror}") from err


# ---- validation -------------------------------------------------------------------------

def _check_object(value, fields: dict, where: str) -> None:
    if not isinstance(value, dict):
        raise SimulationError(f"nvml state: {where or 'the document'} must be a JSON object")
    for name in value:
        if name not in fields:
            raise SimulationError(f"nvml state: {_join(where, name)}: unknown field "
                                  "(docs/simulated-host.md lists them)")
    for name, (kind, default) in fields.items():
        if name not in value:
            if default is None and name not in OPTIONAL_WITHOUT_DEFAULT:
                raise SimulationError(f"nvml state: {_join(where, name)}: is required")
            continue
        _check_value(value[name], kind, _join(where, name))


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_value(value, kind: str, where: str) -> None:
    def bad(what: str):
        raise SimulationError(f"nvml state: {where}: {what}, not {value!r}")

    limits = {"u32": 0xFFFFFFFF, "count": (1 << 63) - 1, "bytes": (1 << 63) - 1, "ms": MAX_LATENCY_MS,
              "pages": 4096, "minor": 253, "pid": (1 << 31) - 1, "gpu-instance": MAX_GPU_INSTANCE_ID,
              "compute-instance": MAX_COMPUTE_INSTANCE_ID}
    if kind in limits:
        if not _whole(value) or not 0 <= value <= limits[kind]:
            bad(f"must be a whole number from 0 to {limits[kind]}")
    elif kind == "format":
        if value != FORMAT:
            bad(f"this gpuhook writes and reads format {FORMAT}")
    elif kind == "bool":
        if not isinstance(value, bool):
            bad("must be true or false")
    elif kind == "text":
        if not isinstance(value, str) or not value or len(value.encode()) >= 96:
            bad("must be a non-empty string shorter than 96 bytes")
    elif kind == "driver-version":
        parts = value.split(".") if isinstance(value, str) else []
        if len(parts) < 2 or not all(p.isdigit() for p in parts) or len(value) >= 64:
            bad("must look like 550.54.15")
    elif kind == "major.minor":
        parts = value.split(".") if isinstance(value, str) else []
        if len(parts) != 2 or not all(p.isdigit() and p.isascii() for p in parts) or int(parts[0]) > 999 \
                or int(parts[1]) > 99:
            bad("must look like 12.4")
    elif kind in ("gpu-uuid", "mig-uuid"):
        prefix = "GPU-" if kind == "gpu-uuid" else "MIG-"
        if not isinstance(value, str) or not value.startswith(prefix) or len(value.encode()) >= 96:
            bad(f"must be a string starting with {prefix}")
    elif kind == "gpu-uuids":
        if not isinstance(value, list) or len(value) > 16 or \
                not all(isinstance(v, str) and v.startswith("GPU-") and len(v.encode()) < 96 for v in value):
            bad("must be a list of at most 16 GPU UUIDs")
    elif kind == "brand":
        if value not in BRANDS:
            bad(f"must be one of {', '.join(BRANDS)}")
    elif kind == "bus-id":
        if not isinstance(value, str) or _bus_key(value) is None:
            bad("must look like 00000000:18:00.0")
    elif kind == "profile":
        if not isinstance(value, str) or not value or len(value) >= 32:
            bad("must be a MIG profile name such as 1g.10gb")
    elif kind == "processes":
        if not isinstance(value, list) or len(value) > 256:
            bad("must be a list of at most 256 processes")
        for i, entry in enumerate(value):
            _check_object(entry, PROCESS_FIELDS, f"{where}[{i}]")
    elif kind == "mig-devices":
        if not isinstance(value, list) or len(value) > MAX_MIG_DEVICES:
            bad(f"must be a list of at most {MAX_MIG_DEVICES} MIG devices")
        for i, entry in enumerate(value):
            _check_object(entry, MIG_FIELDS, f"{where}[{i}]")
    elif kind == "gpus":
        if not isinstance(value, list) or len(value) > MAX_GPUS:
            bad(f"must be a list of at most {MAX_GPUS} GPUs")
        for i, entry in enumerate(value):
            _check_object(entry, GPU_FIELDS, f"gpus[{i}]")
    else:
        raise AssertionError(kind)


def _bus_key(text: str):
    """(domain, bus, device, function) of a PCI bus id in NVML's accepted forms, or None."""
    try:
        head, _, function = text.rpartition(".")
        parts = head.split(":")
        if not function or len(parts) not in (2, 3):
            return None
        numbers = [int(p, 16) for p in parts] + [int(function, 16)]
    except (AttributeError, ValueError):
        return None
    if len(numbers) == 3:
        numbers.insert(0, 0)
    domain, bus, device, function = numbers
    if bus > 0xFF or device > 0x1F or function > 7 or domain > 0xFFFFFFFF:
        return None
    return domain, bus, device, function
