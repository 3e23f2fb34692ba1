"""Discovery for one container start: everything planning needs, read once, returned frozen.

`survey(request, spec, config)` is the only step of a start that reads the host and the
image before planning (docs/architecture.md). It changes nothing: the inventory cache it
would refresh comes back as `Host.cache`, which the hook writes in one place
(`write_caches`) and a dry run never does. gpuhook.plan.make_plan then plans from the Host
alone.
"""

import os

from gpuhook import discover
from gpuhook import inventory as inv
from gpuhook import request as req
from gpuhook.record import record

MAX_CAPS_NODES = 4096  # /dev/nvidia-caps entries looked at


class Host(record("Host", "inventory facts facts_source container nodes cdi_nodes cache ldconfig")):
    """What one start needs to know.

    `inventory` (discover.Inventory) and `facts` (inventory.NvmlFacts, None when nothing
    needs NVML; `facts_source` says where they came from); `container` (discover.
    ContainerFacts) the image's library dirs and glibc; `nodes` maps a container device path
    (/dev/nvidia0) to the host node's (mode, uid, gid, host path); `cdi_nodes` the GPU nodes
    of CDI names only a spec resolves (gpuhook.cdi); `cache` the inventory cache document to
    write, or None; `ldconfig` the host's ldconfig (discover.HostLdconfig) for a glibc
    image, None for others."""

    __slots__ = ()


def survey(request, spec, config) -> Host:
    """Read what planning `request` for the container of `spec` needs."""
    cdi_nodes = ()
    if request.cdi:
        from gpuhook import cdi

        cdi_nodes = req.gpu_nodes(cdi.resolve(request.cdi, config.cdi_spec_dirs))
    names_mig = request._replace(nodes=request.nodes + cdi_nodes).names_mig
    # NVML only when something needs it: NVIDIA_REQUIRE_* constraints, a request naming MIG
    # devices, or a host with MIG instances (their capability files; the cached inventory
    # first). The capability files every driver makes (mig/config, mig/monitor) say nothing
    # about MIG mode: an H200 with MIG off has them too (discover.has_mig_instances).
    inventory, _, _, pending = inv.read(config)
    facts = source = None
    if request.requirements or names_mig or discover.has_mig_instances(inventory.capabilities):
        inventory, facts, source, pending = inv.read(config, want_facts=True)
    container = discover.container_facts(spec.rootfs, config)
    ldconfig = discover.find_ldconfig(config.ldconfig, config.driver_root) if container.glibc else None
    return Host(inventory, facts, source, container, host_nodes(config, inventory), cdi_nodes, pending, ldconfig)


def write_caches(config, host: Host) -> None:
    """The one place a start writes gpuhook's own caches."""
    inv.write_cache(config, host.cache)


def host_nodes(config, inventory) -> dict:
    """(mode, uid, gid, host path) of every NVIDIA device node the host has that a plan can
    ask for: control, uvm, modeset, one per GPU, and the nvidia-caps nodes that exist."""
    paths = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
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
    found = {}
    for path in paths:
        node = discover.host_node(config, path)
        if node is not None:
            found[path] = node
    return found

