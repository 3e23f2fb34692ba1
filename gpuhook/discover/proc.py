"""The driver's /proc files: GPUs, driver version, device majors, MIG minors and capabilities.

Everything here is read from files (docs/runtime-facts.md §4): /proc/driver/nvidia gives each
GPU's UUID, minor and PCI bus without loading NVML (whose start-up can take seconds without
persistence mode), /proc/devices gives the majors, the nvidia-caps files the MIG minors.
Roots are parameters so a driver container or a simulated host (gpuhook simulate) is read
exactly like a real one; the driver's files on disk are gpuhook.discover.driverfiles.
"""

import os

from gpuhook.discover.types import Gpu
from gpuhook.driver import is_uuid
from gpuhook.errors import HostError


def _read(path: str, what: str, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except FileNotFoundError:
        raise
    except OSError as err:
        raise HostError(f"cannot read {what} {path}: {err.strerror}") from err


def driver_version(proc_root: str) -> str:
    path = f"{proc_root}/driver/nvidia/version"
    try:
        text = _read(path, "driver version")
    except FileNotFoundError:
        raise HostError(
            f"no NVIDIA driver: {path} does not exist",
            f"is the nvidia kernel module loaded? proc-root is {proc_root}",
        ) from None
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            for token in line.split():
                parts = token.split(".")
                if len(parts) >= 2 and all(p.isdigit() for p in parts):
                    return token
    raise HostError(f"{path}: no driver version in the NVRM line")


def majors(proc_root: str) -> dict:
    path = f"{proc_root}/devices"
    try:
        text = _read(path, "device list")
    except FileNotFoundError:
        raise HostError(f"{path} does not exist") from None
    found = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            in_char = False
            continue
        fields = line.split()
        if in_char and len(fields) == 2 and fields[0].isdigit():
            name = "nvidia" if fields[1] == "nvidia-frontend" else fields[1]
            found.setdefault(name, int(fields[0]))
    if "nvidia" not in found:
        raise HostError(f"{path} lists no nvidia character device major", "is the nvidia module loaded?")
    return found


def gpus(proc_root: str) -> tuple:
    base = f"{proc_root}/driver/nvidia/gpus"
    try:
        buses = sorted(os.listdir(base))
    except FileNotFoundError:
        return ()
    except OSError as err:
        raise HostError(f"cannot list {base}: {err.strerror}") from err
    found = []
    for bus in buses:
        path = f"{base}/{bus}/information"
        try:
            fields = _parse_information(_read(path, "GPU information"))
        except FileNotFoundError:
            continue
        if fields.get("GPU Excluded", "No").lower().startswith("y"):
            continue
        try:
            minor = int(fields["Device Minor"])
            uuid = fields["GPU UUID"]
        except (KeyError, ValueError):
            raise HostError(f"{path}: missing or bad 'GPU UUID' / 'Device Minor'") from None
        if not 0 <= minor < 254:
            raise HostError(f"{path}: device minor {minor} out of range")
        if not is_uuid(uuid):
            raise HostError(f"{path}: 'GPU UUID' is not a GPU UUID (GPU- followed by letters, digits and dashes)")
        bus_id = fields.get("Bus Location", bus).lower()
        found.append((bus_id, uuid, minor, fields.get("Model", "unknown")))
    found.sort()
    return tuple(Gpu(i, uuid, minor, bus_id, model) for i, (bus_id, uuid, minor, model) in enumerate(found))


def _parse_information(text: str) -> dict:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def numa_node(sys_root: str, bus_id: str):
    """The NUMA node of the PCI device `bus_id` (e.g. 0000:07:00.0) from sysfs, or None when
    the machine has no NUMA information for it (a file that is missing or says -1)."""
    if not bus_id or "/" in bus_id or bus_id.startswith("."):
        return None
    try:
        text = _read(f"{sys_root}/bus/pci/devices/{bus_id}/numa_node", "NUMA node", 32)
    except (OSError, HostError):
        return None
    text = text.strip()
    if not text.isdigit() or len(text) > 4:
        return None
    return int(text)


def mig_minors(proc_root: str) -> dict:
    """The driver's nvidia-caps minor table (/proc/driver/nvidia-caps/mig-minors), or {}."""
    path = f"{proc_root}/driver/nvidia-caps/mig-minors"
    try:
        text = _read(path, "MIG minor table")
    except FileNotFoundError:
        return {}
    table = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            table[fields[0]] = int(fields[1])
    return table


def capabilities(proc_root: str) -> tuple:
    """Relative paths of the files under /proc/driver/nvidia/capabilities: mig/config,
    mig/monitor and fabric-imex-mgmt on every host with a current driver, and
    gpu<minor>/mig/gi<G>/access and .../ci<C>/access for each MIG instance that exists."""
    base = f"{proc_root}/driver/nvidia/capabilities"
    found = []
    for directory, _, files in os.walk(base):
        rel = directory[len(base):].lstrip("/")
        found += [f"{rel}/{name}" if rel else name for name in files]
    return tuple(sorted(found))


def has_mig_instances(capabilities) -> bool:
    """Whether the driver's capability files (`capabilities`) show a MIG GPU instance.

    The driver makes mig/config and mig/monitor at load and a gpu<minor>/mig directory for
    every GPU, MIG-capable or not and whatever its MIG mode; gpu<minor>/mig/gi<G>/access
    appears only when GPU instance G is created (NVIDIA's open kernel modules, os.c:
    osRmCapRegisterSys, osRmCapRegisterGpu, osRmCapRegisterSmcPartition), and
    /proc/driver/nvidia-caps/mig-minors lists every possible instance always (nv-caps.c).
    So a GPU instance's access file is the one sign of MIG devices /proc gives without NVML
    (docs/runtime-facts.md §4)."""
    for path in capabilities:
        parts = path.split("/")
        if len(parts) >= 4 and parts[0].startswith("gpu") and parts[1] == "mig" and parts[2].startswith("gi"):
            return True
    return False
