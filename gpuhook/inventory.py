"""The host inventory, cached in <state-dir>/inventory.json (docs/architecture.md).

Reading the host the expensive way (parsing the driver root's ld cache, resolving every
library, NVML queries) happens once per host state. The cache key is made of everything
that content depends on, all cheap to read on every start: the driver version
(/proc/driver/nvidia/version), the boot id, the roots in the configuration, the list of GPU
directories in /proc/driver/nvidia/gpus, the driver's MIG capability files (they change
when MIG instances are made or destroyed), the nvidia lines of /proc/devices and the
identity of the driver root's ld cache. IPC sockets are never cached: a daemon can come
and go.

The NVML part (CUDA version, each GPU's brand, compute capability and MIG layout) is read
only when something needs it (NVIDIA_REQUIRE_* constraints, MIG requests, a MIG host) and
then kept in the same file under the same key: a start on an unchanged host loads no NVML.
"""

import os

from gpuhook import cache, discover
from gpuhook.record import record

FORMAT = 3  # 3: binaries also hold the graphics and display data files


class MigEntry(record("MigEntry", "index uuid gpu_instance_id compute_instance_id name")):
    """A MIG device as requests name it: `index` is NVML's MIG device index on its GPU."""

    __slots__ = ()


class GpuFacts(record("GpuFacts", "uuid brand arch mig_mode mig_devices")):
    """What NVML says about one GPU: brand token, compute capability, MIG mode and devices."""

    __slots__ = ()


class NvmlFacts(record("NvmlFacts", "cuda_version gpus")):
    """The NVML side of the inventory; `gpus` maps GPU UUIDs to GpuFacts."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return {"cuda_version": self.cuda_version,
                "gpus": {uuid: dict(g._asdict(), mig_devices=[m._asdict() for m in g.mig_devices])
                         for uuid, g in self.gpus.items()}}

    @classmethod
    def from_dict(cls, doc: dict) -> "NvmlFacts":
        gpus = {}
        for uuid, g in doc["gpus"].items():
            devices = tuple(MigEntry(**m) for m in g["mig_devices"])
            gpus[uuid] = GpuFacts(g["uuid"], g["brand"], g["arch"], g["mig_mode"], devices)
        return cls(doc["cuda_version"], gpus)


def cache_path(config) -> str:
    return f"{config.state_dir}/inventory.json"


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return ""


def fingerprint(config, driver_version: str) -> dict:
    """Everything the cached inventory depends on, read cheaply."""
    proc = config.proc_root
    try:
        gpu_dirs = sorted(os.listdir(f"{proc}/driver/nvidia/gpus"))
    except OSError:
        gpu_dirs = []
    try:
        ld_cache = cache.file_identity(os.stat(discover.under(config.driver_root, "/etc/ld.so.cache")))
    except OSError:
        ld_cache = None
    devices = [line for line in _read_text(f"{proc}/devices").splitlines() if "nvidia" in line]
    return {
        "format": FORMAT,
        "boot_id": cache.boot_id(),
        "driver_version": driver_version,
        "roots": [config.driver_root, config.device_root, proc, config.nvml_library],
        "gpu_dirs": gpu_dirs,
        "capabilities": list(discover.capabilities(proc)),
        "devices": devices,
        "ld_cache": ld_cache,
    }


def _cached(config):
    """(key, cached document or None) for the host as it is now."""
    version = discover.driver_version(config.proc_root)
    key = fingerprint(config, version)
    doc = cache.read(cache_path(config))
    if isinstance(doc, dict) and doc.get("key") == key:
        return key, doc
    return key, None


def read(config, want_facts: bool = False) -> tuple:
    """(Inventory, NvmlFacts or None, source or None, pending) for this host, changing
    nothing. The inventory comes from the cache when the host is unchanged; NVML's facts
    (only with `want_facts`) from the cache, else from NVML. `pending` is the cache document
    to write (`write_cache`), or None when the cache is current: the caller decides whether
    and where to write (the hook does it in one place; dry runs never)."""
    key, doc = _cached(config)
    inventory = None
    if doc is not None:
        try:
            inventory = discover.inventory_from_dict(doc["inventory"])._replace(ipc=discover.ipc(config.driver_root))
        except (KeyError, TypeError, ValueError, AttributeError):
            doc = None  # damaged or from another version: rebuild below
    pending = None
    if inventory is None:
        inventory = discover.inventory(config)
        pending = {"key": key, "inventory": discover.inventory_to_dict(inventory)}
    if not want_facts:
        return inventory, None, None, pending
    if doc is not None and isinstance(doc.get("nvml"), dict):
        try:
            return inventory, NvmlFacts.from_dict(doc["nvml"]), CACHED, pending
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    facts, lost = _query_nvml(config)
    if lost:
        return inventory, facts, QUERIED, pending  # a lost GPU is a moment's state, not the host's: never cache it
    pending = pending or {"key": key, "inventory": discover.inventory_to_dict(inventory)}
    pending["nvml"] = facts.as_dict()
    return inventory, facts, QUERIED, pending


def write_cache(config, pending) -> None:
    """Write what `read` found out (best effort: a cache that cannot be written is re-read)."""
    if pending is not None:
        cache.write(cache_path(config), pending)


def _query_nvml(config) -> tuple:
    from gpuhook import nvml

    with nvml.Session(nvml.library_path(config)) as session:
        seen = session.inventory()
    facts = NvmlFacts(seen.cuda_version, {
        gpu.uuid: GpuFacts(gpu.uuid, gpu.brand, gpu.arch, bool(gpu.mig_mode), tuple(
            MigEntry(m.index, m.uuid, m.gpu_instance_id, m.compute_instance_id, m.name)
            for m in gpu.mig_devices or ()))
        for gpu in seen.gpus if not gpu.lost
    })
    return facts, any(gpu.lost for gpu in seen.gpus)


CACHED = "NVML facts from the inventory cache"
QUERIED = "NVML facts queried from NVML"


def load(config, write: bool = True) -> "discover.Inventory":
    """The host inventory (`read`), cached at once unless `write` is False: for commands."""
    inventory, _, _, pending = read(config)
    if write:
        write_cache(config, pending)
    return inventory


def nvml_facts(config, write: bool = True) -> tuple:
    """(NvmlFacts, CACHED or QUERIED) for this host (`read`), cached at once unless `write`
    is False: for commands."""
    _, facts, source, pending = read(config, want_facts=True)
    if write:
        write_cache(config, pending)
    return facts, source
