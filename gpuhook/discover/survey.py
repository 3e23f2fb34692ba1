"""Discovery for one container start: everything planning needs, read once, returned frozen.

`survey(request, spec, config)` is the only step of a start that reads the host and the
image before planning (docs/architecture.md). It changes nothing: the inventory cache it
would refresh comes back as `Host.cache`, which a start writes in one place
(gpuhook.apply.statefiles.write_caches) and a dry run never does. gpuhook.plan.make.make_plan
then plans from the Host alone.
"""

import os
import stat

from gpuhook import driver
from gpuhook.discover.container import container_facts
from gpuhook.discover import driverfiles, proc
from gpuhook.discover import inventory as inv
from gpuhook.record import record

MAX_CAPS_NODES = 4096  # /dev/nvidia-caps entries looked at


class Host(record("Host", "inventory facts facts_source container nodes cdi_nodes cache ldconfig feature_nodes",
                  defaults=((),))):
    """What one start needs to know.

    `inventory` (discover.Inventory) and `facts` (inventory.NvmlFacts, None when nothing
    needs NVML; `facts_source` says where they came from); `container` (discover.
    ContainerFacts) the image's library dirs and glibc; `nodes` maps a container device path
    (/dev/nvidia0) to the host node's (mode, uid, gid, host path); `cdi_nodes` the GPU nodes
    of CDI names only a spec resolves (gpuhook.discover.cdi); `cache` the cache entries discovery refreshed,
    (path, document) pairs to write (none when the caches were current); `ldconfig` the host's ldconfig (discover.HostLdconfig) for a glibc
    image, None for others; `feature_nodes` the (feature, path, major, minor) of the host's
    nodes for the request's `features` (NVIDIA_NVSWITCH, NVIDIA_GDRCOPY)."""

    __slots__ = ()


def survey(request, spec, config) -> Host:
    """Read what planning `request` for the container of `spec` needs."""
    cdi_nodes = ()
    if request.cdi:
        from gpuhook.discover import cdi

        cdi_nodes = driver.gpu_nodes(cdi.resolve(request.cdi, config.cdi_spec_dirs))
    names_mig = driver.needs_mig_layout(request.ids, request.mig_config, request.mig_monitor, request.nodes + cdi_nodes)
    # NVML only when something needs it: NVIDIA_REQUIRE_* constraints, a request naming MIG
    # devices, or a host with MIG instances (their capability files; the cached inventory
    # first). The capability files every driver makes (mig/config, mig/monitor) say nothing
    # about MIG mode: an H200 with MIG off has them too (discover.has_mig_instances).
    inventory, _, _, pending = inv.read(config)
    facts = source = None
    if request.requirements or names_mig or proc.has_mig_instances(inventory.capabilities):
        inventory, facts, source, pending = inv.read(config, want_facts=True)
    container = container_facts(spec.rootfs, config)
    ldconfig = driverfiles.find_ldconfig(config.ldconfig, config.driver_root) if container.glibc else None
    features = feature_nodes(config, request.features)
    nodes = host_nodes(config, inventory, [path for _, path, _, _ in features])
    return Host(inventory, facts, source, container, nodes, cdi_nodes, () if pending is None else (pending,),
                ldconfig, features)


MAX_DEV_NAMES = 8192  # /dev entries looked at for the optional devices' nodes


def _dev_names(config) -> set:
    """Names in the host's /dev where discover.host_node looks: dev-root, else
    <driver-root>/dev falling back to /dev."""
    names = set()
    for directory in dict.fromkeys([config.device_root] + ([] if config.dev_root else ["/dev"])):
        try:
            with os.scandir(directory) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_DEV_NAMES:
                        break
                    names.add(entry.name)
        except OSError:
            pass
    return names


# The optional devices' nodes, as NVIDIA's kernel modules make them: the nvswitch driver's
# control node is minor 255 (NVSWITCH_CTL_MINOR in open-gpu-kernel-modules' linux_nvswitch.c),
# switch N is minor N; gdrdrv registers one node, minor 0.
NVSWITCH_PREFIX, NVSWITCH_CTL_MINOR = "nvidia-nvswitch", 255
GDRDRV_MINOR = 0


def feature_nodes(config, features) -> tuple:
    """(feature, path, major, minor) of the device nodes the host has for `features`
    (gpuhook.request.resolve.FEATURES): /dev/gdrdrv; /dev/nvidia-nvswitchctl and each
    /dev/nvidia-nvswitch<N>. A node counts only while its driver's major is in /proc/devices,
    read now: the inventory cache keys only the nvidia lines, and gdrdrv may load later."""
    if not features:
        return ()
    majors = proc.majors(config.proc_root)
    found = []
    names = _dev_names(config)
    if "gdrcopy" in features and "gdrdrv" in majors and "gdrdrv" in names:
        found.append(("gdrcopy", "/dev/gdrdrv", majors["gdrdrv"], GDRDRV_MINOR))
    if "nvswitch" in features and NVSWITCH_PREFIX in majors:
        for name in sorted(names):
            tail = name[len(NVSWITCH_PREFIX):] if name.startswith(NVSWITCH_PREFIX) else ""
            if tail == "ctl":
                minor = NVSWITCH_CTL_MINOR
            elif tail.isdigit() and tail.isascii() and int(tail) < NVSWITCH_CTL_MINOR:
                minor = int(tail)
            else:
                continue
            found.append(("nvswitch", f"/dev/{name}", majors[NVSWITCH_PREFIX], minor))
    return tuple(found)


def host_nodes(config, inventory, extra=()) -> dict:
    """(mode, uid, gid, host path) of every NVIDIA device node the host has that a plan can
    ask for: control, uvm, modeset, one per GPU, the nvidia-caps nodes that exist, and the
    `extra` paths (the optional devices' nodes)."""
    paths = [path for path, _, _, _ in driver.CONTROL_NODES]
    paths += [f"/dev/nvidia{gpu.minor}" for gpu in inventory.gpus]
    if inventory.mig_minors:
        # Where discover.host_node looks: dev-root, else <driver-root>/dev falling back to /dev.
        names = set()
        for caps_dir in dict.fromkeys([config.device_root + "/nvidia-caps"]
                                      + ([] if config.dev_root else ["/dev/nvidia-caps"])):
            try:
                names.update(sorted(os.listdir(caps_dir))[:MAX_CAPS_NODES])
            except OSError:
                pass
        paths += [f"/dev/nvidia-caps/{name}" for name in sorted(names)]
    paths += list(extra)
    found = {}
    for path in paths:
        node = host_node(config, path)
        if node is not None:
            found[path] = node
    return found




def host_node(config, path: str):
    """(mode, uid, gid, host path) of the host's device node for `path` (/dev/...), or None.

    Looked for under dev-root, else <driver-root>/dev falling back to /dev (a driver
    container's root usually has no /dev of its own)."""
    candidates = [config.device_root + path[len("/dev"):]]
    if not config.dev_root and candidates[0] != path:
        candidates.append(path)
    for host in candidates:
        try:
            st = os.stat(host)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, host
    return None
