"""`gpuhook cdi generate`: a CDI spec for this host, with gpuhook as its hook.

The spec (docs/cdi.md), of gpuhook's own kind `gpuhook.example/gpu`, names every GPU by index and UUID, every MIG device by `GPU:MIG` and
MIG UUID, and `all`. Each device injects its device nodes and one marker: a read-only bind
of /dev/null at /var/run/nvidia-container-devices/<UUID> (or `all`), the device plugin's
volume-mount channel (gpuhook.request.resolve), which only a runtime or a spec can create. The
spec-wide edits inject the control nodes, read-only mounts of the driver files for the
chosen capabilities at their host paths (as NVIDIA's own generator does), and gpuhook itself
as the createRuntime and poststop hook. The hook finds the exact GPUs through the markers,
privileged or not, and adds what a spec cannot: the files in the image's own library dir,
the ld cache, the /proc/driver/nvidia mask and the health check-and-reset.

Generation reads the host like the hook does (gpuhook.discover.inventory; NVML only for MIG) and
changes nothing; the command writes the result.
"""

from gpuhook.discover import inventory
from gpuhook.discover import proc, survey
from gpuhook import driver
from gpuhook.request import resolve
from gpuhook.driver import CONTROL_MINOR
from gpuhook.plan.make import LIBRARY_CAPABILITIES

# 0.5.0: what podman 4.3 (Debian 12) and containerd 1.7 read. Spec-level annotations (0.6.0)
# make their CDI library reject the whole spec, so the spec has none.
CDI_VERSION = "0.5.0"
# gpuhook's own kind, not NVIDIA's nvidia.com/gpu: NVIDIA's toolkit (nvidia-cdi-refresh,
# nvidia-ctk cdi generate) names its devices the same ("0", "GPU-<uuid>", "all"), and a device
# defined by two specs is refused by the runtime for both (docs/cdi.md, "Next to NVIDIA's").
KIND = driver.CDI_KIND
DEFAULT_CAPABILITIES = ("compute", "utility")
HOOK_STAGES = ("createRuntime", "poststop")
RO_OPTIONS = ["ro", "nosuid", "nodev", "bind"]


def _node(config, path: str, major: int, minor: int) -> dict:
    """A CDI device node: the container path, the host node it comes from (when it exists),
    its numbers and, from the host node, its permissions' owner."""
    found = survey.host_node(config, path)
    node = {"path": path, "type": "c", "major": major, "minor": minor}
    if found is not None:
        mode, uid, gid, host_path = found
        node.update(hostPath=host_path, fileMode=mode, uid=uid, gid=gid)
    return node


def _marker(ident: str) -> dict:
    return {"hostPath": "/dev/null", "containerPath": f"{resolve.VOLUME_MOUNT_ROOT}/{ident}", "type": "bind",
            "options": ["ro", "nosuid", "nodev", "noexec", "bind"]}


def _hook(stage: str, hook) -> dict:
    entry = hook.entry(stage)  # gpuhook treats createRuntime as prestart
    return {"hookName": stage, **entry}


def generate(config, hook, capabilities=DEFAULT_CAPABILITIES) -> dict:
    """The CDI spec document for this host. `hook` is gpuhook.install.Hook (how a runtime
    starts this gpuhook); `capabilities` pick the driver files mounted spec-wide."""
    inv, facts, _, _ = inventory.read(config, want_facts=proc.has_mig_instances(proc.capabilities(config.proc_root)))
    nvidia = inv.majors["nvidia"]
    devices = []
    every_node = []
    for gpu in inv.gpus:
        node = _node(config, f"/dev/nvidia{gpu.minor}", nvidia, gpu.minor)
        every_node.append(node)
        edits = {"deviceNodes": [node], "mounts": [_marker(gpu.uuid)]}
        devices += [{"name": str(gpu.index), "containerEdits": edits},
                    {"name": gpu.uuid, "containerEdits": edits}]
        known = facts.gpus.get(gpu.uuid) if facts else None
        for mig in (known.mig_devices if known and known.mig_mode else ()):
            mig_nodes = [node] + _mig_nodes(config, inv, gpu, mig)
            mig_edits = {"deviceNodes": mig_nodes, "mounts": [_marker(mig.uuid)]}
            devices += [{"name": f"{gpu.index}:{mig.index}", "containerEdits": mig_edits},
                        {"name": mig.uuid, "containerEdits": mig_edits}]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": every_node, "mounts": [_marker("all")]}})

    control = [_node(config, "/dev/nvidiactl", nvidia, CONTROL_MINOR)]
    uvm = inv.majors.get("nvidia-uvm")
    if uvm is not None and "compute" in capabilities:
        control += [_node(config, "/dev/nvidia-uvm", uvm, 0), _node(config, "/dev/nvidia-uvm-tools", uvm, 1)]
    mounts = []
    for lib in inv.libraries:
        if lib.capability in capabilities and lib.capability in LIBRARY_CAPABILITIES and lib.bits == 64:
            mounts.append({"hostPath": lib.host_path, "containerPath": _container_path(config, lib.host_path),
                           "options": RO_OPTIONS})
    for item in inv.binaries:
        if item.capability in capabilities:
            mounts.append({"hostPath": item.host_path, "containerPath": item.container_path, "options": RO_OPTIONS})
    if set(capabilities) & {"compute", "utility"}:
        mounts += [{"hostPath": f.host_path, "containerPath": f.container_path, "options": RO_OPTIONS}
                   for f in inv.firmware]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": [f"NVIDIA_DRIVER_CAPABILITIES={','.join(sorted(capabilities))}"],
            "deviceNodes": control,
            "mounts": mounts,
            "hooks": [_hook(stage, hook) for stage in HOOK_STAGES],
        },
    }


def _container_path(config, host_path: str) -> str:
    """Where a driver file goes in the container: its path on the host without the driver
    root (/run/nvidia/driver/usr/lib/... -> /usr/lib/...)."""
    root = config.driver_root.rstrip("/")
    return host_path[len(root):] if root and host_path.startswith(root + "/") else host_path


def _mig_nodes(config, inv, gpu, mig) -> list:
    caps_major = inv.majors.get("nvidia-caps")
    if caps_major is None:
        return []
    nodes = []
    for key in (f"gpu{gpu.minor}/gi{mig.gpu_instance_id}/access",
                f"gpu{gpu.minor}/gi{mig.gpu_instance_id}/ci{mig.compute_instance_id}/access"):
        minor = inv.mig_minors.get(key)
        if minor is not None:
            nodes.append(_node(config, f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor))
    return nodes


# NVIDIA's own kind, which specs of gpuhook before its own kind used (docs/cdi.md).
NVIDIA_KIND = "nvidia.com/gpu"


def neighbours(output: str, directories) -> tuple:
    """(conflicting, stale) spec files next to `output`, the file about to be written.

    `conflicting`: other specs of gpuhook's kind in `output`'s directory. CDI refuses a device
    that two specs of one directory define, for both, so writing would break every gpuhook
    device. `stale`: specs in `directories` (cdi-spec-dirs) or `output`'s directory, other
    than `output`, of NVIDIA's kind whose hooks run gpuhook: written by a gpuhook before it had
    a kind of its own, they collide with NVIDIA's spec the same way."""
    import os

    from gpuhook.discover import cdi

    output = os.path.abspath(output)
    here = os.path.dirname(output)
    conflicting, stale = [], []
    for directory in dict.fromkeys([here, *directories]):
        for _, path, doc in cdi.specs([directory]):
            if os.path.abspath(path) == output:
                continue
            if directory == here and doc.get("kind") == KIND:
                conflicting.append(path)
            elif doc.get("kind") == NVIDIA_KIND and _runs_gpuhook(doc):
                stale.append(path)
    return conflicting, stale


def _runs_gpuhook(doc: dict) -> bool:
    edits = doc.get("containerEdits")
    hooks = edits.get("hooks") if isinstance(edits, dict) else None
    return isinstance(hooks, list) and any(
        isinstance(hook, dict) and isinstance(hook.get("args"), list)
        and any(isinstance(arg, str) and arg.endswith("gpuhook/launch.py") for arg in hook["args"])
        for hook in hooks)


def render(spec: dict, fmt: str = "json") -> str:
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(spec, sort_keys=False)
    import json

    return json.dumps(spec, indent=2) + "\n"
