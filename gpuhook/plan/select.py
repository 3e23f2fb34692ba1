"""Which real GPUs and MIG devices a request gets: ids, bus ids, UUIDs and device nodes matched
against what discovery found.

Pure: `select(request, gpus, facts, inventory)` returns a `Selection` (the GPUs whose node the
container gets, MIG parents included, and the MIG devices) or raises RequestError naming an id
that matches nothing. Called by gpuhook.plan.make.
"""

from gpuhook.driver import MIG_NODE_PREFIX, is_mig_id
from gpuhook.errors import RequestError
from gpuhook.record import record
from gpuhook.request.resolve import ALL, GPUS, RUNTIME_DEVICES, Request

MAX_INDEX_DIGITS = 9


class Selection(record("Selection", "gpus migs mig_config mig_monitor runtime_grant", defaults=(False,))):
    """What a request resolves to on this host. `gpus` are the GPUs whose device node the
    container gets (whole GPUs and MIG parents, once each, in request order); `migs` the MIG
    devices (discover.types.MigDevice, their GPU named as the host's /proc names it);
    `mig_config` / `mig_monitor` whether the container gets those capabilities;
    `runtime_grant` whether the GPUs are the NVIDIA nodes the runtime put in linux.devices
    (their access then stays within the runtime's own rules: gpuhook.plan.make)."""

    __slots__ = ()


def _bus_id(text: str):
    """(domain, bus, device, function) of a PCI bus id ("0000:18:00.0", NVML's
    "00000000:18:00.0", or "18:00.0"), or None."""
    parts = text.lower().split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    if len(parts) != 3 or "." not in parts[2]:
        return None
    device, _, function = parts[2].partition(".")
    fields = (parts[0], parts[1], device, function)
    if not all(0 < len(f) <= 8 and all(c in "0123456789abcdef" for c in f) for f in fields):
        return None
    return tuple(int(f, 16) for f in fields)


def select(request: Request, gpus, facts=None, inventory=None) -> Selection:
    """Match a request against the host's GPUs (and, for MIG, NVML's facts).

    `facts` (inventory.NvmlFacts) is needed to name MIG devices and to know which GPUs are
    in MIG mode; without it every GPU counts as a whole GPU. A MIG-mode GPU requested whole
    is refused (its memory and engines belong to its MIG devices); `all` means every whole
    GPU and every MIG device. Unknown ids are errors that list what exists. Granted device
    nodes (`request.nodes`) are matched by major and minor against `inventory`'s majors and
    nvidia-caps table; a node that is no GPU or MIG device here is an error naming it.
    """
    migs_by_gpu = {}
    if facts is not None:
        for gpu in gpus:
            known = facts.gpus.get(gpu.uuid)
            if known is not None and known.mig_mode:
                migs_by_gpu[gpu.uuid] = known.mig_devices
    whole, migs = [], []
    runtime = request.channel == RUNTIME_DEVICES
    matched, nvidia = _match_nodes(request, gpus, migs_by_gpu, inventory, facts is not None, lenient=runtime)
    if runtime and nvidia:
        for gpu, target in matched:
            if target is not None and target not in migs:
                migs.append(target)
            elif target is None and gpu not in whole:
                whole.append(gpu)
    elif request.wants == ALL:
        for gpu in gpus:
            if gpu.uuid in migs_by_gpu:
                migs += [_of(gpu, device) for device in migs_by_gpu[gpu.uuid]]
            else:
                whole.append(gpu)
    elif request.wants == GPUS:
        for ident in request.ids:
            if is_mig_id(ident):
                target = _match_mig(ident, gpus, migs_by_gpu, request.channel, facts is not None)
                if target not in migs:
                    migs.append(target)
                continue
            gpu = match_gpu(ident, gpus)
            if gpu is None:
                raise RequestError(
                    f"requested GPU {ident[:80]!r} ({request.channel}) does not exist on this host; "
                    f"GPUs here: {_available(gpus)}"
                )
            if gpu.uuid in migs_by_gpu:
                devices = ", ".join(f"{gpu.index}:{d.index}" for d in migs_by_gpu[gpu.uuid]) or "none"
                raise RequestError(f"GPU {gpu.index} is in MIG mode: request its MIG devices, "
                                   f"not the whole GPU; MIG devices here: {devices}")
            if gpu not in whole:
                whole.append(gpu)
        for gpu, target in matched:
            if target is not None and target not in migs:
                migs.append(target)
            elif target is None and gpu not in whole:
                whole.append(gpu)
        if not whole and not migs:
            raise RequestError(f"the grant ({request.channel}) names no GPU: nothing to give the container")
    parents = list(whole)
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    for target in migs:
        if by_uuid[target.gpu_uuid] not in parents:
            parents.append(by_uuid[target.gpu_uuid])
    config = _capability_gpus(request.mig_config, "NVIDIA_MIG_CONFIG_DEVICES", gpus, parents)
    monitor = _capability_gpus(request.mig_monitor, "NVIDIA_MIG_MONITOR_DEVICES", gpus, parents)
    return Selection(tuple(parents), tuple(migs), config, monitor, runtime and nvidia)


def _match_nodes(request: Request, gpus, migs_by_gpu: dict, inventory, have_facts: bool,
                 lenient: bool = False) -> tuple:
    """([(GPU, MigDevice or None) for each granted node (gpuhook.request.oci.Device)], whether any
    node is the NVIDIA driver's). With `lenient`
    (nodes the runtime put in linux.devices), a node of another driver's major that only
    carries an NVIDIA name is not NVIDIA's and is skipped; from an orchestrator's grant it
    is an error."""
    if not request.nodes:
        return [], False
    majors = inventory.majors if inventory is not None else {}
    by_caps_minor = {minor: name for name, minor in (inventory.mig_minors if inventory is not None else {}).items()}
    found: list = []
    nvidia = False  # whether any node is the NVIDIA driver's (a grant, even if it adds no device)
    for node in request.nodes:
        where = f"{node.path[:80]} (c {node.major}:{node.minor}, {request.channel})"
        if node.path.startswith(MIG_NODE_PREFIX):
            if node.major != majors.get("nvidia-caps"):
                if lenient:
                    continue
                raise RequestError(f"granted node {where} is not an nvidia-caps device on this host")
            nvidia = True
            name = by_caps_minor.get(node.minor, "")
            parts = name.split("/")  # gpu<minor>/gi<id>/ci<id>/access names one MIG device
            if len(parts) != 4 or not parts[0].startswith("gpu") or parts[3] != "access":
                continue  # a GPU instance's access node, or config/monitor: no device by itself
            gpu = next((g for g in gpus if f"gpu{g.minor}" == parts[0]), None)
            if gpu is None or not have_facts:
                raise RequestError(f"granted MIG node {where} names no MIG device NVML reports here")
            device = next((d for d in migs_by_gpu.get(gpu.uuid, ())
                           if f"gi{d.gpu_instance_id}" == parts[1] and f"ci{d.compute_instance_id}" == parts[2]), None)
            if device is None:
                raise RequestError(f"granted MIG node {where} names MIG device {name[:60]}, which NVML does not "
                                   f"report on GPU {gpu.index}")
            found.append((gpu, _of(gpu, device)))
            continue
        if node.major != majors.get("nvidia") and lenient:
            continue
        nvidia = True
        gpu = next((g for g in gpus if g.minor == node.minor), None) if node.major == majors.get("nvidia") else None
        if gpu is None:
            raise RequestError(f"granted node {where} is no GPU on this host; GPUs here: {_available(gpus)}")
        if gpu.uuid in migs_by_gpu:
            continue  # a MIG device's parent node: its MIG devices come with their own nodes
        found.append((gpu, None))
    return found, nvidia


def _available(gpus) -> str:
    """The host's GPUs for a start error, by index only: the error reaches whoever made the
    container (a pod's events), and other GPUs' UUIDs are host data (`gpuhook list` shows them)."""
    return ", ".join(str(g.index) for g in gpus) or "none"


def _of(gpu, device):
    """MIG device `device` of `gpu`, its GPU named by the host's index, UUID and minor."""
    return device._replace(gpu_index=gpu.index, gpu_uuid=gpu.uuid, gpu_minor=gpu.minor)


def _match_mig(ident: str, gpus, migs_by_gpu: dict, channel: str, have_facts: bool):
    if not have_facts:
        raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}) but NVML could not be asked for the "
                           f"MIG layout")
    every = [(gpu, device) for gpu in gpus for device in migs_by_gpu.get(gpu.uuid, ())]
    if ident.upper().startswith("MIG-"):
        for gpu, device in every:
            if device.uuid.lower() == ident.lower():
                return _of(gpu, device)
    else:
        parent_id, _, mig_index = ident.partition(":")
        gpu = match_gpu(parent_id, gpus)
        if gpu is not None and mig_index.isdigit() and mig_index.isascii() and len(mig_index) <= MAX_INDEX_DIGITS:
            if gpu.uuid not in migs_by_gpu:
                raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}), but GPU {gpu.index} "
                                   "is not in MIG mode")
            for device in migs_by_gpu[gpu.uuid]:
                if device.index == int(mig_index):
                    return _of(gpu, device)
    here = ", ".join(f"{g.index}:{d.index}" for g, d in every) or "none"
    raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}) does not exist on this host; "
                       f"MIG devices here: {here}")


def _capability_gpus(ids, variable: str, gpus, parents) -> bool:
    """Check NVIDIA_MIG_{CONFIG,MONITOR}_DEVICES names only GPUs the container gets."""
    if not ids:
        return False
    if ids == ("all",):
        return True
    for ident in ids:
        gpu = match_gpu(ident, gpus)
        if gpu is None:
            raise RequestError(f"{variable} names GPU {ident[:80]!r}, which does not exist; GPUs here: "
                               f"{_available(gpus)}")
        if gpu not in parents:
            raise RequestError(f"{variable} names GPU {gpu.index}, which the container does not get")
    return True


def match_gpu(ident: str, gpus):
    """The GPU of `gpus` that `ident` names (index, UUID in any case, PCI bus id), or None."""
    if ident.isdigit() and ident.isascii():
        if len(ident) > MAX_INDEX_DIGITS:
            return None
        index = int(ident)
        for gpu in gpus:
            if gpu.index == index:
                return gpu
        return None
    lowered = ident.lower()
    for gpu in gpus:
        if gpu.uuid.lower() == lowered:
            return gpu
    bus = _bus_id(ident) if ":" in ident else None
    if bus is not None:
        for gpu in gpus:
            if _bus_id(gpu.bus_id) == bus:
                return gpu
    return None
