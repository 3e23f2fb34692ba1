"""What a container asks for: which GPUs, through which channel, with which driver capabilities.

Channels, in order of trust (docs/reference section 3):

1. ``/dev/null`` mounts at ``/var/run/nvidia-container-devices/<id>`` — only the runtime or
   the Kubernetes device plugin can add mounts (policy ``accept-volume-mounts``);
2. CDI annotations ``cdi.k8s.io/<anything>`` naming ``nvidia.com/gpu=<index|uuid|all>`` —
   set by the runtime or kubelet, never by the image (policy ``accept-cdi-annotations``:
   where users can set annotations themselves, turn it off);
3. the environment: ``NVIDIA_VISIBLE_DEVICES`` (and the legacy-image rule), which any image
   can set. It is honoured from unprivileged containers only while
   ``accept-env-when-unprivileged`` is true, like NVIDIA's default.

A runtime-provided request (1 or 2) wins over the environment. Resolution is pure: it reads
the parsed spec and returns data; matching ids to real GPUs happens in `select`.
"""


from gpuhook.errors import RequestError
from gpuhook.record import record

VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_KIND = "nvidia.com/gpu"

# Bounds on what a request may name: far above any real host (NVML supports 64 GPUs, 7 MIG
# devices each), far below what could make parsing or matching slow.
MAX_IDS = 1024
MAX_ID_LENGTH = 256
MAX_INDEX_DIGITS = 9

CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
DEFAULT_CAPABILITIES = frozenset({"utility", "compute"})

# What the container wants.
NOTHING = "nothing"  # no request: the hook leaves the container alone
DRIVER_ONLY = "driver-only"  # NVIDIA_VISIBLE_DEVICES=none: driver files, control nodes, no GPU
GPUS = "gpus"  # the GPUs named in `ids`
ALL = "all"

ENV = "env NVIDIA_VISIBLE_DEVICES"
ENV_LEGACY = "env (legacy CUDA image: CUDA_VERSION without NVIDIA_REQUIRE_CUDA)"
MOUNTS = "volume mounts under " + VOLUME_MOUNT_ROOT
CDI = "CDI annotations"


class Request(record("Request", "wants ids capabilities channel notes mig_config mig_monitor",
                         defaults=((), ()))):
    """`ids` are the requested device ids as written (indices, UUIDs, GPU:MIG pairs, MIG
    UUIDs), deduplicated. `mig_config` / `mig_monitor` are the GPU ids (or ("all",)) of
    NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES, honoured for privileged
    containers only."""

    __slots__ = ()

    @property
    def empty(self) -> bool:
        return self.wants == NOTHING

    @property
    def names_mig(self) -> bool:
        """Whether matching the request needs the host's MIG layout (from NVML)."""
        return any(is_mig_id(i) for i in self.ids) or bool(self.mig_config or self.mig_monitor)


class MigTarget(record("MigTarget", "gpu device")):
    """A requested MIG device: its parent `gpu` (discover.Gpu) and `device` (inventory.MigDevice)."""

    __slots__ = ()

    @property
    def label(self) -> str:
        return f"{self.gpu.index}:{self.device.index}"


class Selection(record("Selection", "gpus migs mig_config mig_monitor")):
    """What a request resolves to on this host. `gpus` are the GPUs whose device node the
    container gets (whole GPUs and MIG parents, once each, in request order); `migs` the MIG
    devices; `mig_config` / `mig_monitor` whether the container gets those capabilities."""

    __slots__ = ()


def is_mig_id(ident: str) -> bool:
    return ident.upper().startswith("MIG-") or ":" in ident


def _nothing(notes=()):
    return Request(NOTHING, (), frozenset(), "", tuple(notes))


def _split_ids(value: str, where: str = "NVIDIA_VISIBLE_DEVICES") -> list[str]:
    """The comma-separated ids in `value`, stripped and de-duplicated in order (linear time)."""
    seen: dict = {}
    for part in value.split(","):
        part = part.strip()
        if part:
            seen[part] = None
            _check_id(part, len(seen), where)
    return list(seen)


def _check_id(ident: str, count: int, where: str) -> None:
    if count > MAX_IDS:
        raise RequestError(f"{where} names more than {MAX_IDS} devices")
    if len(ident) > MAX_ID_LENGTH:
        raise RequestError(f"{where}: device id {ident[:40]!r}... is longer than {MAX_ID_LENGTH} characters")


def parse_capabilities(value: str | None, legacy: bool = False) -> frozenset:
    """NVIDIA_DRIVER_CAPABILITIES: unset or empty = utility,compute (all for legacy images)."""
    if value is None:
        return frozenset(CAPABILITIES) if legacy else DEFAULT_CAPABILITIES
    caps = set()
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if part == "all":
            return frozenset(CAPABILITIES)
        if part not in CAPABILITIES:
            raise RequestError(
                f"unknown driver capability {part[:64]!r} in NVIDIA_DRIVER_CAPABILITIES "
                f"(known: all, {', '.join(CAPABILITIES)})"
            )
        caps.add(part)
    return frozenset(caps) if caps else DEFAULT_CAPABILITIES


def _from_mounts(spec, notes: list) -> list[str] | None:
    """Ids from the device plugin's volume-mounts channel. Only a bind mount of /dev/null
    counts: that is what the plugin asks for, and nothing an image or a user can add by
    itself is one (an image VOLUME or a tmpfs at that path is ignored, with a note)."""
    ids: dict = {}
    prefix = VOLUME_MOUNT_ROOT + "/"
    for mount in spec.mounts:
        dest = "/" + "/".join(p for p in mount.destination.split("/") if p and p != ".")
        if dest.startswith("/run/nvidia-container-devices/"):
            dest = "/var" + dest
        if not dest.startswith(prefix):
            continue
        device = dest[len(prefix):]
        if not device or "/" in device:
            continue
        is_bind = mount.type == "bind" or "bind" in mount.options or "rbind" in mount.options
        if mount.source != "/dev/null" or not is_bind:
            if len(notes) < 16:
                notes.append(f"mount at {dest[:120]!r} ignored: a device request is a bind mount of /dev/null")
            continue
        ids[device] = None
        _check_id(device, len(ids), "volume mounts")
    return list(ids) or None


def _from_cdi(annotations: dict, notes: list) -> list[str] | None:
    ids: dict = {}
    found = False
    for key in sorted(annotations):
        if not key.startswith(CDI_ANNOTATION_PREFIX):
            continue
        for entry in annotations[key].split(","):
            entry = entry.strip()
            if not entry:
                continue
            kind, sep, name = entry.partition("=")
            if not sep or kind != CDI_KIND:
                if len(notes) < 16:
                    notes.append(f"CDI device {entry[:80]!r} in {key[:80]} is not {CDI_KIND}; left to other tools")
                continue
            found = True
            name = name.strip()
            if not name:
                raise RequestError(f"CDI annotation {key[:80]}: empty device name in {entry[:80]!r}")
            ids[name] = None
            _check_id(name, len(ids), "CDI annotations")
    return list(ids) if found else None


def _as_request(ids: list[str], caps, channel: str, notes: list) -> Request:
    if "all" in ids:
        return Request(ALL, (), caps, channel, tuple(notes))
    if "none" in ids:
        if len(ids) > 1:
            raise RequestError(f"'none' cannot be combined with other devices ({channel}: {','.join(ids)[:200]})")
        return Request(DRIVER_ONLY, (), caps, channel, tuple(notes))
    return Request(GPUS, tuple(ids), caps, channel, tuple(notes))


def resolve(spec, state_annotations: dict, config) -> Request:
    """Decide what the container asks for. Pure: no host access."""
    env = spec.env
    notes: list[str] = []
    legacy = "CUDA_VERSION" in env and bool(env["CUDA_VERSION"]) and not env.get("NVIDIA_REQUIRE_CUDA")
    annotations = dict(spec.annotations)
    annotations.update(state_annotations)

    trusted: list[str] = []
    channels = []
    mount_ids = _from_mounts(spec, notes)
    if mount_ids is not None:
        if config.accept_volume_mounts:
            trusted += mount_ids
            channels.append(MOUNTS)
        else:
            notes.append("volume-mount request ignored (accept-volume-mounts = false)")
    cdi_ids = _from_cdi(annotations, notes)
    if cdi_ids is not None:
        if config.accept_cdi_annotations:
            trusted = list(dict.fromkeys(trusted + cdi_ids))
            channels.append(CDI)
        else:
            notes.append("CDI annotation request ignored (accept-cdi-annotations = false)")
    if trusted:
        caps = parse_capabilities(env.get("NVIDIA_DRIVER_CAPABILITIES") or None)
        if "NVIDIA_VISIBLE_DEVICES" in env:
            notes.append("NVIDIA_VISIBLE_DEVICES ignored: the runtime's request takes precedence")
        return _with_mig_capabilities(_as_request(trusted, caps, " + ".join(channels), notes), spec)

    value = env.get("NVIDIA_VISIBLE_DEVICES")
    if value is None:
        if not legacy:
            return _nothing(notes)
        ids, channel = ["all"], ENV_LEGACY
    else:
        ids, channel = _split_ids(value), ENV
        if not ids or "void" in ids or ids == [VOLUME_MOUNT_ROOT]:
            return _nothing(notes)
    if not spec.privileged and not config.accept_env_when_unprivileged:
        notes.append(
            "NVIDIA_VISIBLE_DEVICES ignored: container is unprivileged (no CAP_SYS_ADMIN) and "
            "accept-env-when-unprivileged = false"
        )
        return _nothing(notes)
    caps_value = env.get("NVIDIA_DRIVER_CAPABILITIES")
    caps = parse_capabilities(caps_value if caps_value else None, legacy=legacy and channel == ENV_LEGACY)
    return _with_mig_capabilities(_as_request(ids, caps, channel, notes), spec)


def _with_mig_capabilities(request: Request, spec) -> Request:
    """Add NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: they let a container
    reconfigure or watch MIG on its GPUs, so only privileged containers may ask (as NVIDIA)."""
    found = {}
    for name, field in (("NVIDIA_MIG_CONFIG_DEVICES", "mig_config"), ("NVIDIA_MIG_MONITOR_DEVICES", "mig_monitor")):
        ids = _split_ids(spec.env.get(name, ""), name)
        if not ids or request.empty:
            continue
        if not spec.privileged:
            raise RequestError(f"{name} is only honoured for privileged containers (CAP_SYS_ADMIN in the "
                               f"bounding set); this one is not")
        found[field] = ("all",) if "all" in ids else tuple(ids)
    return request._replace(**found) if found else request


def select(request: Request, gpus, facts=None) -> Selection:
    """Match a request against the host's GPUs (and, for MIG, NVML's facts).

    `facts` (inventory.NvmlFacts) is needed to name MIG devices and to know which GPUs are
    in MIG mode; without it every GPU counts as a whole GPU. A MIG-mode GPU requested whole
    is refused (its memory and engines belong to its MIG devices); `all` means every whole
    GPU and every MIG device. Unknown ids are errors that list what exists.
    """
    migs_by_gpu = {}
    if facts is not None:
        for gpu in gpus:
            known = facts.gpus.get(gpu.uuid)
            if known is not None and known.mig_mode:
                migs_by_gpu[gpu.uuid] = known.mig_devices
    whole, migs = [], []
    if request.wants == ALL:
        for gpu in gpus:
            if gpu.uuid in migs_by_gpu:
                migs += [MigTarget(gpu, device) for device in migs_by_gpu[gpu.uuid]]
            else:
                whole.append(gpu)
    elif request.wants == GPUS:
        for ident in request.ids:
            if is_mig_id(ident):
                target = _match_mig(ident, gpus, migs_by_gpu, request.channel, facts is not None)
                if target not in migs:
                    migs.append(target)
                continue
            gpu = _match(ident, gpus)
            if gpu is None:
                raise RequestError(
                    f"requested GPU {ident[:80]!r} ({request.channel}) does not exist on this host; "
                    f"GPUs here: {_available(gpus)}"
                )
            if gpu.uuid in migs_by_gpu:
                devices = ", ".join(f"{gpu.index}:{d.index} ({d.uuid})" for d in migs_by_gpu[gpu.uuid]) or "none"
                raise RequestError(f"GPU {gpu.index} ({gpu.uuid}) is in MIG mode: request its MIG devices, "
                                   f"not the whole GPU; MIG devices here: {devices}")
            if gpu not in whole:
                whole.append(gpu)
    parents = list(whole)
    for target in migs:
        if target.gpu not in parents:
            parents.append(target.gpu)
    config = _capability_gpus(request.mig_config, "NVIDIA_MIG_CONFIG_DEVICES", gpus, parents)
    monitor = _capability_gpus(request.mig_monitor, "NVIDIA_MIG_MONITOR_DEVICES", gpus, parents)
    return Selection(tuple(parents), tuple(migs), config, monitor)


def _available(gpus) -> str:
    return ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"


def _match_mig(ident: str, gpus, migs_by_gpu: dict, channel: str, have_facts: bool) -> MigTarget:
    if not have_facts:
        raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}) but NVML could not be asked for the "
                           f"MIG layout")
    every = [(gpu, device) for gpu in gpus for device in migs_by_gpu.get(gpu.uuid, ())]
    if ident.upper().startswith("MIG-"):
        for gpu, device in every:
            if device.uuid.lower() == ident.lower():
                return MigTarget(gpu, device)
    else:
        parent_id, _, mig_index = ident.partition(":")
        gpu = _match(parent_id, gpus)
        if gpu is not None and mig_index.isdigit() and mig_index.isascii() and len(mig_index) <= MAX_INDEX_DIGITS:
            if gpu.uuid not in migs_by_gpu:
                raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}), but GPU {gpu.index} "
                                   f"({gpu.uuid}) is not in MIG mode")
            for device in migs_by_gpu[gpu.uuid]:
                if device.index == int(mig_index):
                    return MigTarget(gpu, device)
    here = ", ".join(f"{g.index}:{d.index} ({d.uuid})" for g, d in every) or "none"
    raise RequestError(f"requested MIG device {ident[:80]!r} ({channel}) does not exist on this host; "
                       f"MIG devices here: {here}")


def _capability_gpus(ids, variable: str, gpus, parents) -> bool:
    """Check NVIDIA_MIG_{CONFIG,MONITOR}_DEVICES names only GPUs the container gets."""
    if not ids:
        return False
    if ids == ("all",):
        return True
    for ident in ids:
        gpu = _match(ident, gpus)
        if gpu is None:
            raise RequestError(f"{variable} names GPU {ident[:80]!r}, which does not exist; GPUs here: "
                               f"{_available(gpus)}")
        if gpu not in parents:
            raise RequestError(f"{variable} names GPU {gpu.index} ({gpu.uuid}), which the container does not get")
    return True


def _match(ident: str, gpus):
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
    return None
