"""CDI specs: which device nodes a CDI device name stands for.

A CDI device name that does not say which GPU it is (a DRA claim,
``k8s.gpu.nvidia.com/claim=<uid>-gpu-0``) is resolved through the CDI spec that defines it:
the character device nodes the spec injects for it (its own ``containerEdits`` and, as the
CDI spec says, the spec-wide ones) are the grant, and gpuhook.plan.select.select maps them to
GPUs and MIG devices by major and minor. docs/requests.md says how this fits the channels.

Specs are read from `cdi-spec-dirs` (default /etc/cdi then /var/run/cdi), ``*.json``,
``*.yaml`` and ``*.yml``, each directory's files in name order. As in the CDI spec, a later
directory overrides an earlier one; the same name twice in one directory is an error. A spec
file must be root-owned and writable by nobody else (gpuhook.kernel.files.trusted): it decides
which GPUs a container gets. Reads are bounded (files per directory, bytes per file).

`neighbours` reads the same specs for `gpuhook cdi generate`: which specs next to the one it
writes a runtime would refuse together with it.
"""

import os
import stat

from gpuhook.driver import CDI_KIND
from gpuhook.kernel import files
from gpuhook.errors import HostError, RequestError
from gpuhook.request.oci import Device

SUFFIXES = (".json", ".yaml", ".yml")
MAX_FILES = 256  # per directory
MAX_BYTES = 4 << 20  # per spec file
MAX_NODES = 1024  # device nodes per device


def _load(path: str):
    """The parsed spec at `path`, or None (with the reason) when it is not one gpuhook trusts
    or can parse."""
    try:
        data = files.read_trusted(path, MAX_BYTES + 1)
    except files.UntrustedPath as err:
        return None, err.strerror
    except OSError as err:
        return None, f"cannot open: {err.strerror}"
    if len(data) > MAX_BYTES:
        return None, f"larger than {MAX_BYTES >> 20} MiB"
    try:
        if path.endswith(".json"):
            import json

            doc = json.loads(data)
        else:
            import yaml  # PyYAML: only here, only for a YAML spec (optional in the RPM)

            doc = yaml.safe_load(data)
    except ImportError:
        return None, "a YAML spec, and PyYAML is not installed"
    except Exception as err:  # any parser failure: the spec is skipped, the reason logged
        return None, f"not valid {'JSON' if path.endswith('.json') else 'YAML'}: {type(err).__name__}"
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or not isinstance(doc.get("devices"), list):
        return None, "not a CDI spec (kind and devices missing)"
    return doc, None


def specs(directories) -> list:
    """(directory index, path, spec) of every loadable spec; unloadable ones are skipped."""
    found = []
    for index, directory in enumerate(directories):
        try:
            dir_st = os.stat(directory)
            names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIXES))[:MAX_FILES]
        except OSError:
            continue
        if not files.trusted(dir_st):
            continue
        for name in names:
            doc, _ = _load(f"{directory}/{name}")
            if doc is not None:
                found.append((index, f"{directory}/{name}", doc))
    return found


def devices(directories) -> dict:
    """Every CDI device defined in `directories`: qualified name -> (spec path, device, spec)."""
    table: dict = {}
    for index, path, spec in specs(directories):
        kind = spec["kind"]
        for device in spec["devices"]:
            if not isinstance(device, dict) or not isinstance(device.get("name"), str):
                continue
            qualified = f"{kind}={device['name']}"
            earlier = table.get(qualified)
            if earlier is not None and earlier[0] == index:
                raise HostError(f"CDI device {qualified[:120]} is defined twice in {directories[index]}: "
                                f"{os.path.basename(earlier[1])} and {os.path.basename(path)}")
            table[qualified] = (index, path, device, spec)
    return table


def resolve(names, directories) -> tuple:
    """The character device nodes (oci.Device) that the CDI devices `names` inject. Raises
    RequestError naming the first device no spec defines or that injects no usable node."""
    table = devices(directories)
    nodes: dict = {}
    for name in names:
        entry = table.get(name)
        if entry is None:
            raise RequestError(f"CDI device {name[:120]} is granted but no CDI spec in "
                               f"{', '.join(directories)} defines it")
        _, path, device, spec = entry
        found = [node for edits in (device.get("containerEdits"), spec.get("containerEdits"))
                 for node in _device_nodes(edits, name)]
        if not found:
            raise RequestError(f"CDI device {name[:120]} ({os.path.basename(path)}) injects no device node")
        for node in found:
            nodes[node] = None
    return tuple(nodes)


def _device_nodes(edits, name: str) -> list:
    if not isinstance(edits, dict):
        return []
    raw = edits.get("deviceNodes") or []
    if not isinstance(raw, list) or len(raw) > MAX_NODES:
        raise RequestError(f"CDI device {name[:120]}: deviceNodes must be a list of at most {MAX_NODES}")
    found = []
    for node in raw:
        if not isinstance(node, dict) or not isinstance(node.get("path"), str):
            raise RequestError(f"CDI device {name[:120]}: a device node without a path")
        if node.get("type", "c") not in ("c", "u"):
            continue
        major, minor = node.get("major"), node.get("minor")
        if major is None or minor is None:
            # As a runtime does: numbers left out are the host node's (hostPath, else path).
            host = node.get("hostPath") or node["path"]
            try:
                st = os.stat(host)
            except OSError:
                raise RequestError(f"CDI device {name[:120]} injects {node['path'][:120]}, which does not "
                                   f"exist on this host") from None
            if not stat.S_ISCHR(st.st_mode):
                raise RequestError(f"CDI device {name[:120]}: {node['path'][:120]} is not a character device")
            major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if not all(type(n) is int and 0 <= n < 1 << 32 for n in (major, minor)):
            raise RequestError(f"CDI device {name[:120]}: {node['path'][:120]} has a bad major or minor")
        found.append(Device(node["path"], major, minor))
    return found


# NVIDIA's own kind, which specs of gpuhook before its own kind used (docs/cdi.md).
NVIDIA_KIND = "nvidia.com/gpu"


def neighbours(output: str, directories) -> tuple:
    """(conflicting, stale) spec files next to `output`, the file about to be written.

    `conflicting`: other specs of gpuhook's kind in `output`'s directory. CDI refuses a device
    that two specs of one directory define, for both, so writing would break every gpuhook
    device. `stale`: specs in `directories` (cdi-spec-dirs) or `output`'s directory, other
    than `output`, of NVIDIA's kind whose hooks run gpuhook: written by a gpuhook before it had
    a kind of its own, they collide with NVIDIA's spec the same way."""
    output = os.path.abspath(output)
    here = os.path.dirname(output)
    conflicting, stale = [], []
    for directory in dict.fromkeys([here, *directories]):
        for _, path, doc in specs([directory]):
            if os.path.abspath(path) == output:
                continue
            if directory == here and doc.get("kind") == CDI_KIND:
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
