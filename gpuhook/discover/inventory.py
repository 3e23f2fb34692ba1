"""The host inventory, cached in <state-dir>/inventory.json (docs/architecture.md).

Reading the host the expensive way (parsing the driver root's ld cache, resolving every
library, NVML queries) happens once per host state. The cache key is made of everything
that content depends on, all cheap to read on every start: the driver version
(/proc/driver/nvidia/version), the boot id, the roots and driver dirs in the configuration,
the list of GPU directories in /proc/driver/nvidia/gpus, the driver's capability files (MIG
instances' files come and go with the instances), the nvidia lines of /proc/devices, the
identity of the driver root's ld cache and of every directory discovery looks into for
programs, data files (Xorg module, Vulkan/EGL/GLVND JSON), firmware and libraries no ld
cache lists (`watched_dirs`: a package installed later changes its directory). IPC
sockets are never cached: a daemon can come and go.

The NVML part (CUDA version, each GPU's brand, compute capability and MIG layout) is read
only when something needs it (NVIDIA_REQUIRE_* constraints, MIG requests, a host with MIG
instances) and then kept in the same file: a start on an unchanged host loads no NVML. It
depends only on the driver and the GPUs (NVML_KEY), so a driver file installed later
rebuilds the inventory but keeps NVML's facts.
"""

import os

from gpuhook.discover.driverfiles import LAYOUT_LIB_DIRS, binaries, data_files, firmware, ipc, libraries, under
from gpuhook.discover.proc import capabilities, driver_version, gpus, majors, mig_minors
from gpuhook.discover.types import Gpu, HostFile, Inventory, Library, MigDevice
from gpuhook.driver import BINARY_DIRS, DATA_FILES
from gpuhook.kernel import files
from gpuhook.record import record

FORMAT = 5  # 5: NVML's facts are whole GPU and MIG device records (discover.types)
# The parts of the key NVML's facts depend on: the driver, its GPUs and MIG instances.
NVML_KEY = ("format", "boot_id", "driver_version", "roots", "gpu_dirs", "capabilities", "devices")


class NvmlFacts(record("NvmlFacts", "cuda_version gpus")):
    """The NVML side of the inventory: the CUDA version the driver supports, and `gpus`, GPU
    UUID -> the GPU as NVML sees it (discover.types.Gpu: brand, compute capability, MIG mode
    and MIG devices filled in)."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return {"cuda_version": self.cuda_version,
                "gpus": {uuid: dict(g._asdict(), mig_devices=[m._asdict() for m in g.mig_devices])
                         for uuid, g in self.gpus.items()}}

    @classmethod
    def from_dict(cls, doc: dict) -> "NvmlFacts":
        gpus = {uuid: Gpu(**dict(g, mig_devices=tuple(MigDevice(**m) for m in g["mig_devices"])))
                for uuid, g in doc["gpus"].items()}
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
        ld_cache = files.file_identity(os.stat(under(config.driver_root, "/etc/ld.so.cache")))
    except OSError:
        ld_cache = None
    devices = [line for line in _read_text(f"{proc}/devices").splitlines() if "nvidia" in line]
    return {
        "format": FORMAT,
        "boot_id": files.boot_id(),
        "driver_version": driver_version,
        "roots": [config.driver_root, config.device_root, proc, config.nvml_library],
        "gpu_dirs": gpu_dirs,
        "capabilities": list(capabilities(proc)),
        "devices": devices,
        "ld_cache": ld_cache,
        "driver_dirs": [config.driver_bin_dirs, config.driver_lib_dirs],
        "watched": [_dir_identity(path) for path in watched_dirs(config, driver_version)],
    }


def _dir_identity(path: str):
    """What changes when an entry of directory `path` is added, removed or renamed over."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_mtime_ns]


# cache path -> (the cache document read ahead, its Inventory); see `preload`.
_PRELOADED: dict = {}


def preload(config) -> None:
    """Read and parse the inventory cache now, for a `read` of the same cache later
    (gpuhook.agent: a spare does this while it waits for a request). That `read` still takes
    the host's fingerprint itself and compares it with the document's key, as for a document
    read from the file then. Never raises."""
    _PRELOADED.clear()
    if config is None:
        return
    try:
        _, doc, _ = _cached(config)
        if doc is not None:
            _PRELOADED[cache_path(config)] = (doc, inventory_from_dict(doc["inventory"]))
    except Exception:  # noqa: BLE001 - the request's own read says what is wrong
        _PRELOADED.clear()


def _cached(config):
    """(key, cached document or None, NVML facts document of the same driver and GPUs or
    None) for the host as it is now."""
    version = driver_version(config.proc_root)
    key = fingerprint(config, version)
    early = _PRELOADED.get(cache_path(config))
    doc = early[0] if early is not None else files.read(cache_path(config))
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), dict):
        return key, None, None
    old_key = doc["key"]
    same_gpus = all(old_key.get(part) == key[part] for part in NVML_KEY)
    facts = doc.get("nvml") if same_gpus and isinstance(doc.get("nvml"), dict) else None
    return key, (doc if old_key == key else None), facts


def read(config, want_facts: bool = False) -> tuple:
    """(Inventory, NvmlFacts or None, source or None, pending) for this host, changing
    nothing. The inventory comes from the cache when the host is unchanged; NVML's facts
    (only with `want_facts`) from the cache, else from NVML. `pending` is the cache entry to
    write, (path, document), or None when the cache is current: a start writes it
    (gpuhook.apply.statefiles.write_caches); dry runs and commands never do."""
    key, doc, facts_doc = _cached(config)
    inventory = None
    if doc is not None:
        try:
            early = _PRELOADED.pop(cache_path(config), None)
            parsed = early[1] if early is not None and early[0] is doc else inventory_from_dict(doc["inventory"])
            inventory = parsed._replace(ipc=ipc(config.driver_root))
        except (KeyError, TypeError, ValueError, AttributeError):
            doc = None  # damaged or from another version: rebuild below
    pending = None
    if inventory is None:
        inventory = scan(config)
        pending = {"key": key, "inventory": inventory_to_dict(inventory)}
        if facts_doc is not None:
            pending["nvml"] = facts_doc  # the driver and GPUs are the same: NVML would say the same
    if not want_facts:
        return inventory, None, None, _entry(config, pending)
    if facts_doc is not None:
        try:
            return inventory, NvmlFacts.from_dict(facts_doc), CACHED, _entry(config, pending)
        except (KeyError, TypeError, ValueError, AttributeError):
            if pending is not None:
                pending.pop("nvml", None)
    facts, lost = _query_nvml(config)
    if lost:  # a lost GPU is a moment's state, not the host's: never cache it
        return inventory, facts, QUERIED, _entry(config, pending)
    pending = pending or {"key": key, "inventory": inventory_to_dict(inventory)}
    pending["nvml"] = facts.as_dict()
    return inventory, facts, QUERIED, _entry(config, pending)


def _entry(config, document):
    return None if document is None else (cache_path(config), document)


def _query_nvml(config) -> tuple:
    from gpuhook.discover import nvml

    with nvml.Session(nvml.library_path(config)) as session:
        seen = session.inventory()
    facts = NvmlFacts(seen.cuda_version, {gpu.uuid: gpu for gpu in seen.gpus if not gpu.lost})
    return facts, any(gpu.lost for gpu in seen.gpus)


CACHED = "NVML facts from the inventory cache"
QUERIED = "NVML facts queried from NVML"


def load(config) -> "Inventory":
    """The host inventory (`read`), for commands: nothing is written."""
    return read(config)[0]


def nvml_facts(config) -> tuple:
    """(NvmlFacts, CACHED or QUERIED) for this host (`read`), for commands: nothing is written."""
    _, facts, source, _ = read(config, want_facts=True)
    return facts, source




def watched_dirs(config, version: str) -> list:
    """Host paths of the directories whose entries decide what `scan` finds besides the
    ld cache: where the driver's programs, data files, firmware and (ld-cache-less)
    libraries are looked for. A package that adds or replaces a file there (dpkg and rpm
    rename files into place) changes the directory's mtime, which the inventory cache's key
    holds."""
    dirs = list(config.driver_bin_dirs or BINARY_DIRS)
    dirs += [path.format(version=version).rsplit("/", 1)[0] for paths in DATA_FILES.values() for path in paths]
    dirs.append(f"/lib/firmware/nvidia/{version}")
    dirs += config.driver_lib_dirs or LAYOUT_LIB_DIRS
    return [under(config.driver_root, d) for d in dict.fromkeys(dirs)]


def scan(config) -> Inventory:
    """Everything the plan needs to know about the host, read from files only."""
    proc_root = config.proc_root
    version = driver_version(proc_root)
    return Inventory(
        driver_version=version,
        gpus=gpus(proc_root),
        majors=majors(proc_root),
        libraries=libraries(config.driver_root, lib_dirs=config.driver_lib_dirs, version=version),
        binaries=binaries(config.driver_root, config.driver_bin_dirs) + data_files(config.driver_root, version),
        firmware=firmware(config.driver_root, version),
        ipc=ipc(config.driver_root),
        proc_driver_dir=f"{proc_root}/driver/nvidia",
        mig_minors=mig_minors(proc_root),
        capabilities=capabilities(proc_root),
    )


def inventory_to_dict(inventory: Inventory) -> dict:
    """JSON-ready form of an inventory (for the cache)."""
    doc = inventory._asdict()
    doc["gpus"] = [gpu.identity() for gpu in inventory.gpus]  # what /proc says; NVML's facts are kept apart
    for field in ("libraries", "binaries", "firmware", "ipc"):
        doc[field] = [item._asdict() for item in doc[field]]
    return doc


def inventory_from_dict(doc: dict) -> Inventory:
    """Inverse of inventory_to_dict; raises KeyError/TypeError on a damaged document."""
    return Inventory(
        driver_version=doc["driver_version"],
        gpus=tuple(Gpu(**g) for g in doc["gpus"]),
        majors=dict(doc["majors"]),
        libraries=tuple(Library(**dict(lib, sonames=tuple(lib["sonames"]))) for lib in doc["libraries"]),
        binaries=tuple(HostFile(**f) for f in doc["binaries"]),
        firmware=tuple(HostFile(**f) for f in doc["firmware"]),
        ipc=tuple(HostFile(**f) for f in doc["ipc"]),
        proc_driver_dir=doc["proc_driver_dir"],
        mig_minors={str(k): int(v) for k, v in doc["mig_minors"].items()},
        capabilities=tuple(str(p) for p in doc["capabilities"]),
    )
