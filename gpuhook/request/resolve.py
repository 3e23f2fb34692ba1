"""What a container asks for: which GPUs, through which channel, with which driver capabilities.

Channels, in order of trust (docs/requests.md has the whole table):

1. ``/dev/null`` bind mounts at ``/var/run/nvidia-container-devices/<id>``, or at
   ``.../cdi/<vendor>/<class>/<name>`` for a CDI device name — only the runtime or the
   Kubernetes device plugin can add mounts (policy ``accept-volume-mounts``);
2. CDI annotations ``cdi.k8s.io/<anything>`` naming devices of any NVIDIA kind
   (``nvidia.com/gpu``, ``k8s.device-plugin.nvidia.com/gpu``, ``management.nvidia.com/gpu``,
   a DRA claim ``k8s.gpu.nvidia.com/claim``, ...) or of gpuhook's own ``gpuhook.example/gpu``
   — set by the runtime or kubelet, never by the image (policy ``accept-cdi-annotations``);
3. NVIDIA device nodes the runtime already put in ``linux.devices`` (containerd and CRI-O
   after resolving CDI; policy ``accept-runtime-devices``): they are the grant, and the
   environment only says that the container wants the driver;
4. the environment: ``NVIDIA_VISIBLE_DEVICES`` (and the legacy-image rule), which any image
   can set. It is honoured from unprivileged containers (privileged: CAP_SYS_ADMIN in the
   bounding set and device rules allowing every device, oci.Spec.privileged) only while
   ``accept-env-when-unprivileged`` is true, like NVIDIA's default.

An orchestrator's grant (1, 2 or 3) is never widened by the environment: when one is
present, NVIDIA_VISIBLE_DEVICES cannot add a GPU, and a grant that cannot be resolved fails
the start. Resolution is pure: it reads the parsed spec and returns data; CDI names that
only a CDI spec can resolve (a DRA claim) are resolved by gpuhook.discover.cdi, and matching
ids and nodes to real GPUs is planning (gpuhook.plan.select).
"""

from gpuhook.devrules.devices import DeviceRule, char_device
from gpuhook.devrules.policy import RuntimeRules
from gpuhook.driver import (
    CAPABILITIES,
    CDI_KIND,
    DEFAULT_CAPABILITIES,
    IMPLIED_CAPABILITIES,
    MIG_NODE_PREFIX,
    NVIDIA_VENDOR,
    gpu_nodes,
)
from gpuhook.errors import RequestError
from gpuhook.record import record

VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_MOUNT_PREFIX = "cdi/"  # the device plugin's volume mount for a CDI name: cdi/<vendor>/<class>/<name>

# Bounds on what a request may name: far above any real host (NVML supports 64 GPUs, 7 MIG
# devices each), far below what could make parsing or matching slow.
MAX_IDS = 1024
MAX_ID_LENGTH = 256

# What the container wants.
NOTHING = "nothing"  # no request: the hook leaves the container alone
DRIVER_ONLY = "driver-only"  # NVIDIA_VISIBLE_DEVICES=none: driver files, control nodes, no GPU
GPUS = "gpus"  # the GPUs named in `ids`
ALL = "all"

ENV = "env NVIDIA_VISIBLE_DEVICES"
ENV_LEGACY = "env (legacy CUDA image: CUDA_VERSION without NVIDIA_REQUIRE_CUDA)"
MOUNTS = "volume mounts under " + VOLUME_MOUNT_ROOT
CDI = "CDI annotations"
RUNTIME_DEVICES = "runtime devices (linux.devices)"


class Request(record("Request", "wants ids capabilities channel notes mig_config mig_monitor cdi nodes requirements "
                                "features", defaults=((), (), (), (), (), ()))):
    """`ids` are the requested device ids as written (indices, UUIDs, GPU:MIG pairs, MIG
    UUIDs), deduplicated. `mig_config` / `mig_monitor` are the GPU ids (or ("all",)) of
    NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES, honoured for privileged
    containers only. `cdi` are CDI names only a CDI spec can resolve (gpuhook.discover.cdi turns them
    into `nodes`); `nodes` are granted device nodes (oci.Device: GPU and MIG access nodes);
    `requirements` the image's NVIDIA_REQUIRE_* constraints (gpuhook.request.requirements), parsed once
    here for discovery (they decide whether NVML is loaded) and planning (which checks them);
    `features` the optional devices the environment enabled (FEATURES: "nvswitch", "gdrcopy")."""

    __slots__ = ()

    @property
    def empty(self) -> bool:
        return self.wants == NOTHING


KEYWORDS = ("all", "none", "void")


def _nothing(notes=()):
    return Request(NOTHING, (), frozenset(), "", tuple(notes))


def _split_ids(value: str, where: str = "NVIDIA_VISIBLE_DEVICES") -> list[str]:
    """The comma-separated ids in `value`, stripped and de-duplicated in order (linear time)."""
    seen: dict = {}
    for part in value.split(","):
        part = part.strip()
        if part.lower() in KEYWORDS:
            part = part.lower()  # ALL and All mean all, as in NVIDIA's toolkit
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
    """NVIDIA_DRIVER_CAPABILITIES: unset or empty = utility,compute, or every capability for
    a legacy CUDA image (CUDA_VERSION without NVIDIA_REQUIRE_CUDA), as NVIDIA's toolkit does;
    plus what each named capability needs (IMPLIED_CAPABILITIES)."""
    caps = _named_capabilities(value, legacy)
    for cap, implied in IMPLIED_CAPABILITIES.items():
        if cap in caps:
            caps = caps | implied
    return caps


def _named_capabilities(value: str | None, legacy: bool) -> frozenset:
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


def is_gpu_kind(kind: str) -> bool:
    """A CDI kind ("vendor/class") that names NVIDIA devices: NVIDIA's (vendor nvidia.com or a
    subdomain of it) or gpuhook's own (CDI_KIND)."""
    vendor, sep, device_class = kind.partition("/")
    return kind == CDI_KIND or (bool(sep and device_class)
                                and (vendor == NVIDIA_VENDOR or vendor.endswith("." + NVIDIA_VENDOR)))


def _is_direct_name(kind: str, name: str) -> bool:
    """Whether a CDI device name of an NVIDIA GPU kind says itself which GPU it is (all, an
    index, a UUID, GPU:MIG, a MIG UUID), as the device plugin's and the toolkit's specs name
    them; anything else (a DRA claim) needs the CDI spec."""
    if kind.rpartition("/")[2] not in ("gpu", "mig"):
        return False
    upper = name.upper()
    if name == "all" or (name.isdigit() and name.isascii()) or upper.startswith(("GPU-", "MIG-")):
        return True
    gpu, sep, mig = name.partition(":")
    return bool(sep) and gpu.isdigit() and gpu.isascii() and mig.isdigit() and mig.isascii()


class _Grant:
    """What the orchestrator's channels (mounts, CDI annotations) name: `ids` for the GPU
    matcher, `cdi` for gpuhook.discover.cdi, and whether any channel was present at all."""

    def __init__(self, where: str):
        self.where = where
        self.ids: dict = {}
        self.cdi: dict = {}
        self.found = False

    def add_cdi(self, entry: str, notes: list) -> None:
        kind, sep, name = entry.partition("=")
        kind, name = kind.strip(), name.strip()
        if not sep or not is_gpu_kind(kind):
            if len(notes) < 16:
                notes.append(f"CDI device {entry[:80]!r} in {self.where} is not an NVIDIA device; left to other tools")
            return
        self.found = True
        if not name:
            raise RequestError(f"{self.where}: empty device name in {entry[:80]!r}")
        if _is_direct_name(kind, name):
            self.add_id(name)
        else:
            self.cdi[f"{kind}={name}"] = None
            _check_id(name, len(self.ids) + len(self.cdi), self.where)

    def add_id(self, ident: str) -> None:
        self.found = True
        self.ids[ident] = None
        _check_id(ident, len(self.ids) + len(self.cdi), self.where)


def _from_mounts(spec, notes: list) -> _Grant:
    """The device plugin's volume-mounts channel. Only a bind mount of /dev/null counts:
    that is what the plugin asks for, and nothing an image or a user can add by itself is
    one (an image VOLUME or a tmpfs at that path is ignored, with a note). The device is the
    path under the root: an id, or cdi/<vendor>/<class>/<name> for a CDI device name."""
    grant = _Grant("volume mounts")
    prefix = VOLUME_MOUNT_ROOT + "/"
    for mount in spec.mounts:
        dest = "/" + "/".join(p for p in mount.destination.split("/") if p and p != ".")
        if dest.startswith("/run/nvidia-container-devices/"):
            dest = "/var" + dest
        if not dest.startswith(prefix):
            continue
        device = dest[len(prefix):]
        cdi_parts = device[len(CDI_MOUNT_PREFIX):].split("/") if device.startswith(CDI_MOUNT_PREFIX) else None
        if not device or ("/" in device and (cdi_parts is None or len(cdi_parts) != 3)):
            continue
        is_bind = mount.type == "bind" or "bind" in mount.options or "rbind" in mount.options
        if mount.source != "/dev/null" or not is_bind:
            if len(notes) < 16:
                notes.append(f"mount at {dest[:120]!r} ignored: a device request is a bind mount of /dev/null")
            continue
        if cdi_parts is not None:
            grant.add_cdi(f"{cdi_parts[0]}/{cdi_parts[1]}={cdi_parts[2]}", notes)
        else:
            grant.add_id(device)
    return grant


def _from_cdi(annotations: dict, notes: list) -> _Grant:
    grant = _Grant("CDI annotations")
    for key in sorted(annotations):
        if not key.startswith(CDI_ANNOTATION_PREFIX):
            continue
        grant.where = f"CDI annotation {key[:80]}"
        for entry in annotations[key].split(","):
            if entry.strip():
                grant.add_cdi(entry.strip(), notes)
    grant.where = "CDI annotations"
    return grant


def node_rule(node) -> DeviceRule:
    """The cgroup rule a granted GPU or MIG access node needs: GPUs are opened read-write,
    nvidia-caps nodes read-only (NVIDIA makes them 0444 or 0400)."""
    return char_device(node.major, node.minor, "r" if node.path.startswith(MIG_NODE_PREFIX) else "rw")


def runtime_granted_nodes(spec, notes: list) -> tuple:
    """The GPU and MIG access nodes of linux.devices that the runtime's own device rules
    (linux.resources.devices) open at least in part. A node they do not open is no grant at
    all (docs/requests.md): the runtime made a file, not an allowance, and a hook that
    widened it would give what the runtime denied."""
    nodes = gpu_nodes(spec.devices)
    if not nodes:
        return ()
    rules = RuntimeRules(spec.device_rules)
    found = []
    for node in nodes:
        if rules.grantable(node_rule(node)).access:
            found.append(node)
        elif len(notes) < 16:
            notes.append(f"{node.path[:80]} (c {node.major}:{node.minor}) in linux.devices is no grant: the "
                         f"runtime's device rules do not allow it")
    return tuple(found)


def _as_request(ids: list[str], caps, channel: str, notes: list) -> Request:
    if "all" in ids:
        return Request(ALL, (), caps, channel, tuple(notes))
    if "none" in ids:
        if len(ids) > 1:
            raise RequestError(f"'none' cannot be combined with other devices ({channel}: {','.join(ids)[:200]})")
        return Request(DRIVER_ONLY, (), caps, channel, tuple(notes))
    return Request(GPUS, tuple(ids), caps, channel, tuple(notes))


# Requests NVIDIA's toolkit honours that gpuhook does not implement. A container asking for
# one is refused with a clear line: silently starting it without would fail later, inside.
UNSUPPORTED = {
    "NVIDIA_IMEX_CHANNELS": "IMEX channels (/dev/nvidia-caps-imex-channels)",
    "NVIDIA_GDS": "GPUDirect Storage (nvidia-fs)",
    "NVIDIA_MOFED": "the MOFED (RDMA) driver files",
}
OFF_VALUES = ("", "void", "none", "disabled", "false")
# Optional devices a GPU container turns on with VARIABLE=enabled, as NVIDIA's toolkit does
# (internal/modifier/gated.go: only the exact value "enabled"; internal/discover/nvswitch.go
# and gdrcopy.go: the nodes). gpuhook.discover.survey finds the host's nodes, gpuhook.plan.make adds them.
FEATURES = {
    "NVIDIA_NVSWITCH": "nvswitch",  # /dev/nvidia-nvswitchctl and every /dev/nvidia-nvswitch<N>
    "NVIDIA_GDRCOPY": "gdrcopy",  # /dev/gdrdrv (GDRCopy's gdrdrv module)
}
FEATURE_ON = "enabled"


def resolve(spec, state_annotations: dict, config) -> Request:
    """Decide what the container asks for. Pure: no host access."""
    request = _resolve(spec, state_annotations, config)
    if not request.empty:
        refused = [name for name in UNSUPPORTED if spec.env.get(name, "").strip().lower() not in OFF_VALUES]
        if refused:
            what = "; ".join(f"{name} asks for {UNSUPPORTED[name]}" for name in refused)
            raise RequestError(f"{what}, which gpuhook does not provide",
                               f"unset {', '.join(refused)}, or use NVIDIA's toolkit for this container")
        from gpuhook.request import requirements as reqs

        honoured = spec.privileged or config.accept_env_when_unprivileged
        request = request._replace(requirements=reqs.collect(spec.env),
                                   **_features(spec.env, request.notes, honoured))
        if not honoured and NODE_CAPABILITY in request.capabilities:
            # A capability that adds a device node (display: /dev/nvidia-modeset) is an
            # optional device like FEATURES, from the same environment: not where it is not honoured.
            request = request._replace(
                capabilities=request.capabilities - {NODE_CAPABILITY},
                notes=request.notes + (f"driver capability {NODE_CAPABILITY} ignored: it adds /dev/nvidia-modeset, "
                                       f"and the image's environment is not honoured "
                                       f"(accept-env-when-unprivileged = false)",))
    return request


# The one driver capability that brings a device node of its own (driver.CONTROL_NODES).
NODE_CAPABILITY = "display"


def _features(env: dict, notes: tuple, honoured: bool) -> dict:
    """The `features` (and notes) of FEATURES variables: only the exact value "enabled" turns
    one on, as in NVIDIA's toolkit; any other value that is not off is named in a note. They
    come from the image's environment, so they enable nothing where that environment is not
    honoured (`honoured` false: an unprivileged container under accept-env-when-unprivileged
    = false), whatever channel granted the GPUs."""
    features, more = [], []
    for name, feature in FEATURES.items():
        value = env.get(name, "")
        if not honoured and value.strip().lower() not in OFF_VALUES:
            shown = value if value == FEATURE_ON else repr(value[:40])
            more.append(f"{name}={shown} ignored: the image's environment is not honoured "
                        f"(accept-env-when-unprivileged = false)")
        elif value == FEATURE_ON:
            features.append(feature)
        elif value.strip().lower() not in OFF_VALUES:
            more.append(f"{name}={value[:40]!r} ignored: only {name}={FEATURE_ON} turns it on (as NVIDIA's toolkit)")
    return {"features": tuple(features), "notes": tuple(notes) + tuple(more)}


def _resolve(spec, state_annotations: dict, config) -> Request:
    env = spec.env
    notes: list[str] = []
    legacy = "CUDA_VERSION" in env and bool(env["CUDA_VERSION"]) and not env.get("NVIDIA_REQUIRE_CUDA")
    annotations = dict(spec.annotations)
    annotations.update(state_annotations)

    ids: dict = {}
    cdi: dict = {}
    channels = []
    ignored = []
    for grant, accepted, key in ((_from_mounts(spec, notes), config.accept_volume_mounts, "accept-volume-mounts"),
                                 (_from_cdi(annotations, notes), config.accept_cdi_annotations,
                                  "accept-cdi-annotations")):
        if not grant.found:
            continue
        if grant.where != "volume mounts" and spec.from_podman:
            why = _image_annotation_refused(spec, config, notes)
            if why:
                notes.append(f"CDI annotations ignored: podman copies the image's annotations into the spec, "
                             f"so they count only as the image's environment does, and {why}")
                continue
        if not accepted:
            ignored.append(f"{grant.where} ({key} = false)")
            continue
        ids.update(grant.ids)
        cdi.update(grant.cdi)
        channels.append(MOUNTS if grant.where == "volume mounts" else CDI)
    if channels:
        caps = parse_capabilities(env.get("NVIDIA_DRIVER_CAPABILITIES") or None, legacy=legacy)
        if "NVIDIA_VISIBLE_DEVICES" in env:
            notes.append("NVIDIA_VISIBLE_DEVICES ignored: the runtime's request takes precedence")
        request = _as_request(list(ids), caps, " + ".join(channels), notes)
        if cdi and request.wants == GPUS:
            request = request._replace(cdi=tuple(cdi))
        elif cdi and request.wants == DRIVER_ONLY:
            raise RequestError(f"'none' cannot be combined with other devices ({request.channel})")
        return _with_mig_capabilities(request, spec)
    if ignored:
        # An orchestrator's grant the policy does not accept is never replaced by the image's
        # environment: that could only widen it (docs/requests.md).
        notes.append("device request ignored: " + "; ".join(ignored) + "; NVIDIA_VISIBLE_DEVICES not honoured either")
        return _nothing(notes)

    value = env.get("NVIDIA_VISIBLE_DEVICES")
    if value is None:
        if not legacy:
            return _nothing(notes)
        env_ids, channel = ["all"], ENV_LEGACY
    else:
        env_ids, channel = _split_ids(value), ENV
        if not env_ids or "void" in env_ids or env_ids == [VOLUME_MOUNT_ROOT]:
            return _nothing(notes)
    caps_value = env.get("NVIDIA_DRIVER_CAPABILITIES")
    caps = parse_capabilities(caps_value if caps_value else None, legacy=legacy)
    # A privileged container's linux.devices lists every device of the host (docker and
    # podman --privileged): that is no grant of particular GPUs.
    nodes = () if spec.privileged else runtime_granted_nodes(spec, notes)
    if nodes and not config.accept_runtime_devices:
        # As for mounts and annotations: a grant the policy refuses is never replaced by the
        # image's environment, which could only widen it (docs/requests.md).
        notes.append("device request ignored: GPU nodes in linux.devices (accept-runtime-devices = false); "
                     "NVIDIA_VISIBLE_DEVICES not honoured either")
        return _nothing(notes)
    if nodes and env_ids != ["none"]:
        # The runtime already resolved the grant (CDI in containerd or CRI-O): its GPU nodes
        # decide which GPUs (select); the environment only said that the container wants
        # the driver, and names GPUs only if none of the nodes is an NVIDIA driver's node,
        # and only where the environment may name GPUs at all (never past the env policy).
        if not spec.privileged and not config.accept_env_when_unprivileged:
            env_ids = []
        request = _as_request(env_ids, caps, RUNTIME_DEVICES, notes)._replace(nodes=nodes)
        return _with_mig_capabilities(request, spec)
    if not spec.privileged and not config.accept_env_when_unprivileged:
        notes.append(
            "NVIDIA_VISIBLE_DEVICES ignored: container is unprivileged (not CAP_SYS_ADMIN with every device allowed) and "
            "accept-env-when-unprivileged = false"
        )
        return _nothing(notes)
    return _with_mig_capabilities(_as_request(env_ids, caps, channel, notes), spec)


def _image_annotation_refused(spec, config, notes: list) -> str:
    """Why a CDI annotation in a podman spec (oci.Spec.from_podman: it may be the image's) is no
    grant, or "" when it is one. It is honoured where the image's environment is (privileged,
    or accept-env-when-unprivileged), and never beside GPU nodes the runtime granted, which it
    could only widen (`podman --device /dev/nvidia0` with an image saying nvidia.com/gpu=all)."""
    if not spec.privileged and runtime_granted_nodes(spec, []):
        return "the runtime granted GPU nodes in linux.devices"
    if not spec.privileged and not config.accept_env_when_unprivileged:
        return "the container is unprivileged and accept-env-when-unprivileged = false"
    return ""


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
                               f"bounding set and every device allowed); this one is not")
        found[field] = ("all",) if "all" in ids else tuple(ids)
    return request._replace(**found) if found else request
