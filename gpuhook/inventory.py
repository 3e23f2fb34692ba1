"""The host inventory, cached in <state-dir>/inventory.json (issue 4, item 5).

Reading the host the expensive way (parsing the driver root's ld cache, resolving every
library, NVML queries) happens once per host state. The cache key is made of everything
that content depends on, all cheap to read on every start: the driver version
(/proc/driver/nvidia/version), the boot id, the roots in the configuration, the list of GPU
directories in /proc/driver/nvidia/gpus, the nvidia lines of /proc/devices and the identity
of the driver root's ld cache. IPC sockets are never cached: a daemon can come and go.
"""

import os

from gpuhook import cache, discover

FORMAT = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"


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
        "boot_id": _read_text(BOOT_ID).strip(),
        "driver_version": driver_version,
        "roots": [config.driver_root, config.device_root, proc],
        "gpu_dirs": gpu_dirs,
        "devices": devices,
        "ld_cache": ld_cache,
    }


def load(config) -> "discover.Inventory":
    """The host inventory: from the cache when the host is unchanged, else read and cached."""
    version = discover.driver_version(config.proc_root)
    key = fingerprint(config, version)
    path = cache_path(config)
    cached = cache.read(path)
    if isinstance(cached, dict) and cached.get("key") == key:
        try:
            return discover.inventory_from_dict(cached["inventory"])._replace(ipc=discover.ipc(config.driver_root))
        except (KeyError, TypeError, ValueError):
            pass  # damaged or from another version: rebuild below
    inventory = discover.inventory(config)
    cache.write(path, {"key": key, "inventory": discover.inventory_to_dict(inventory)})
    return inventory
