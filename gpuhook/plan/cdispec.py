"""The CDI spec `gpuhook cdi generate` writes for this host, with gpuhook as its hook: pure.

The spec (docs/cdi.md), of gpuhook's own kind `gpuhook.example/gpu`, names every GPU by index
and UUID, every MIG device by `GPU:MIG` and MIG UUID, and `all`. Each device injects its
device nodes and one marker: a read-only bind of /dev/null at
/var/run/nvidia-container-devices/<UUID> (or `all`), the device plugin's volume-mount channel
(gpuhook.request.resolve), which only a runtime or a spec can create. The spec-wide edits
inject the control nodes, read-only mounts of the driver files for the chosen capabilities at
their host paths (as NVIDIA's own generator does), and gpuhook itself as the createRuntime
and poststop hook. The hook finds the exact GPUs through the markers, privileged or not, and
adds what a spec cannot: the files in the image's own library dir, the ld cache, the
/proc/driver/nvidia mask and the health check-and-reset.

`generate` is a function of what discovery found (the inventory, NVML's facts for MIG, the
host's device nodes: gpuhook.discover.survey.host_nodes); gpuhook.cli.cdicmd reads the host
and writes the result.
"""

from gpuhook.driver import CDI_KIND, CONTROL_NODES, DEFAULT_CAPABILITIES, LIBRARY_CAPABILITIES
from gpuhook.request.resolve import VOLUME_MOUNT_ROOT

# 0.5.0: what podman 4.3 (Debian 12) and containerd 1.7 read. Spec-level annotations (0.6.0)
# make their CDI library reject the whole spec, so the spec has none.
CDI_VERSION = "0.5.0"
# The hook stages a spec registers gpuhook for: createRuntime (gpuhook treats it as prestart)
# and poststop, of the stages the hook serves (gpuhook.entry.HOOK_STAGES).
CDI_HOOK_STAGES = ("createRuntime", "poststop")
RO_OPTIONS = ["ro", "nosuid", "nodev", "bind"]


def _node(nodes: dict, path: str, major: int, minor: int) -> dict:
    """A CDI device node: the container path, the host node it comes from (when `nodes`, the
    host's nodes by container path, has it), its numbers and the host node's permissions."""
    found = nodes.get(path)
    node = {"path": path, "type": "c", "major": major, "minor": minor}
    if found is not None:
        mode, uid, gid, host_path = found
        node.update(hostPath=host_path, fileMode=mode, uid=uid, gid=gid)
    return node


def _marker(ident: str) -> dict:
    return {"hostPath": "/dev/null", "containerPath": f"{VOLUME_MOUNT_ROOT}/{ident}", "type": "bind",
            "options": ["ro", "nosuid", "nodev", "noexec", "bind"]}


def _hook(stage: str, hook) -> dict:
    entry = hook.entry(stage)  # gpuhook treats createRuntime as prestart
    return {"hookName": stage, **entry}


def generate(inventory, facts, nodes: dict, driver_root: str, hook, capabilities=DEFAULT_CAPABILITIES) -> dict:
    """The CDI spec document for a host: its `inventory` (gpuhook.discover.types.Inventory),
    NVML's `facts` (for MIG devices; None without), its device `nodes` (container path ->
    (mode, uid, gid, host path)) and `driver_root`. `hook` is gpuhook.install.Hook (how a
    runtime starts this gpuhook); `capabilities` pick the driver files mounted spec-wide."""
    nvidia = inventory.majors["nvidia"]
    devices = []
    every_node = []
    for gpu in inventory.gpus:
        node = _node(nodes, f"/dev/nvidia{gpu.minor}", nvidia, gpu.minor)
        every_node.append(node)
        edits = {"deviceNodes": [node], "mounts": [_marker(gpu.uuid)]}
        devices += [{"name": str(gpu.index), "containerEdits": edits},
                    {"name": gpu.uuid, "containerEdits": edits}]
        known = facts.gpus.get(gpu.uuid) if facts else None
        for mig in (known.mig_devices if known and known.mig_mode else ()):
            mig_nodes = [node] + _mig_nodes(nodes, inventory, gpu, mig)
            mig_edits = {"deviceNodes": mig_nodes, "mounts": [_marker(mig.uuid)]}
            devices += [{"name": f"{gpu.index}:{mig.index}", "containerEdits": mig_edits},
                        {"name": mig.uuid, "containerEdits": mig_edits}]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": every_node, "mounts": [_marker("all")]}})

    control = [_node(nodes, path, inventory.majors[major], minor) for path, major, minor, capability in CONTROL_NODES
               if (capability is None or capability in capabilities) and major in inventory.majors]
    mounts = []
    for lib in inventory.libraries:
        if lib.capability in capabilities and lib.capability in LIBRARY_CAPABILITIES and lib.bits == 64:
            mounts.append({"hostPath": lib.host_path, "containerPath": _container_path(driver_root, lib.host_path),
                           "options": RO_OPTIONS})
    for item in inventory.binaries:
        if item.capability in capabilities:
            mounts.append({"hostPath": item.host_path, "containerPath": item.container_path, "options": RO_OPTIONS})
    if set(capabilities) & {"compute", "utility"}:
        mounts += [{"hostPath": f.host_path, "containerPath": f.container_path, "options": RO_OPTIONS}
                   for f in inventory.firmware]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": devices,
        "containerEdits": {
            "env": [f"NVIDIA_DRIVER_CAPABILITIES={','.join(sorted(capabilities))}"],
            "deviceNodes": control,
            "mounts": mounts,
            "hooks": [_hook(stage, hook) for stage in CDI_HOOK_STAGES],
        },
    }


def _container_path(driver_root: str, host_path: str) -> str:
    """Where a driver file goes in the container: its path on the host without the driver
    root (/run/nvidia/driver/usr/lib/... -> /usr/lib/...)."""
    root = driver_root.rstrip("/")
    return host_path[len(root):] if root and host_path.startswith(root + "/") else host_path


def _mig_nodes(nodes: dict, inventory, gpu, mig) -> list:
    caps_major = inventory.majors.get("nvidia-caps")
    if caps_major is None:
        return []
    found = []
    for key in (f"gpu{gpu.minor}/gi{mig.gpu_instance_id}/access",
                f"gpu{gpu.minor}/gi{mig.gpu_instance_id}/ci{mig.compute_instance_id}/access"):
        minor = inventory.mig_minors.get(key)
        if minor is not None:
            found.append(_node(nodes, f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor))
    return found


def render(spec: dict, fmt: str = "json") -> str:
    if fmt == "yaml":
        import yaml

        class NoAliases(yaml.SafeDumper):
            """Devices share edits (a MIG device's two names): write each in full, with no
            &id001 anchors and *id001 aliases for a reader to chase."""

            def ignore_aliases(self, data):
                return True

        return yaml.dump(spec, Dumper=NoAliases, sort_keys=False)
    import json

    return json.dumps(spec, indent=2) + "\n"
