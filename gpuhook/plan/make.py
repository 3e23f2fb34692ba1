"""The plan: everything gpuhook will do to one container, as plain data.

`make_plan` is a pure function of (container state and spec, request, survey.Host, config):
it selects the GPUs, checks NVIDIA_REQUIRE_* and lays out the nodes, rules, mounts, links,
/proc mask, ld cache update and the health step. It reads nothing and changes nothing.
``gpuhook prestart --dry-run`` prints exactly this data, tests compare it, and only
gpuhook.apply.run turns it into system calls (docs/architecture.md).
"""

from gpuhook.devrules.devices import char_device
from gpuhook.driver import CONTROL_NODES, LIBRARY_CAPABILITIES
from gpuhook.errors import HostError, RequestError
from gpuhook.plan import select
from gpuhook.plan.records import BindMount, DeviceNode, HealthStep, LdCacheUpdate, Plan, ProcMask, Symlink  # noqa: F401 (re-exported)
from gpuhook.request import resolve

# Mount options, as in `mount -o`; the apply layer maps them to MS_* flags.
RO_LIB = ("ro", "nosuid", "nodev")
IPC_OPTIONS = ("ro", "nosuid", "nodev", "noexec")
MPS_OPTIONS = ("nosuid", "nodev", "noexec")

DEFAULT_NODE_MODE = 0o666
# What each optional device (gpuhook.request.resolve.FEATURES) needs of the host, for the note when it is missing.
FEATURE_NODES = {"nvswitch": "/dev/nvidia-nvswitch* node (nvidia-nvswitch driver)",
                 "gdrcopy": "/dev/gdrdrv node (gdrdrv module)"}


def empty_plan(state, spec, request) -> Plan:
    return Plan(container_id=state.id, pid=state.pid, rootfs=spec.rootfs, wants=request.wants,
                channel=request.channel, capabilities=frozenset(), gpus=(), nodes=(), mounts=(), symlinks=(),
                rules=(), proc_mask=None, ldcache=None, notes=request.notes)


def make_plan(state, spec, request, host, config) -> Plan:
    """Build the plan from the request and what discovery found (`host`, a survey.Host): match
    the request to real GPUs, check the image's requirements, then lay out each part of the
    plan in its own step below (notes are added in the order the steps run)."""
    if request.empty:
        return empty_plan(state, spec, request)
    if host.cdi_nodes:
        request = request._replace(nodes=request.nodes + host.cdi_nodes)
    inventory = host.inventory
    selection = select.select(request, inventory.gpus, host.facts, inventory)
    if request.requirements:
        from gpuhook.plan import requirements as reqs  # only an image with NVIDIA_REQUIRE_* needs it

        facts = requirement_facts(inventory, host.facts, selection)
        for requirement in request.requirements:
            reqs.check(requirement, facts)
    notes = list(request.notes)
    userns = "user" in spec.namespaces
    cap_names = _mig_capabilities(selection, inventory)
    wanted = _wanted_nodes(request, host, selection.gpus, cap_names, notes)
    nodes = _device_nodes(wanted, host, userns, config, notes)
    mounts, symlinks, ld_dirs = _driver_files(inventory, host.container, request.capabilities, notes)
    rules = _cgroup_rules(nodes, spec, selection, cap_names, inventory, notes)
    _refuse_runtime_denials(rules, nodes, spec)
    ldcache = _ld_cache_update(host, ld_dirs, notes)
    if host.facts_source:
        notes.append(host.facts_source)
    return Plan(
        container_id=state.id, pid=state.pid, rootfs=spec.rootfs, wants=request.wants, channel=request.channel,
        capabilities=request.capabilities, gpus=tuple(selection.gpus), nodes=tuple(nodes), mounts=tuple(mounts),
        symlinks=tuple(symlinks), rules=tuple(rules), proc_mask=_proc_mask(inventory, selection.gpus, cap_names),
        ldcache=ldcache, notes=tuple(notes), migs=tuple(selection.migs), userns=userns,
        proc_in_rootfs=any(m.destination.rstrip("/") == "/proc" and m.type == "proc" for m in spec.mounts),
        health=_health_step(config, selection.gpus, spec), dev_tmpfs=runtime_dev_tmpfs(spec.mounts),
    )


def _wanted_nodes(request, host, gpus, cap_names, notes: list) -> list:
    """(path, major, minor) of every device node the container gets: the driver's control
    nodes its capabilities need, its GPUs, the optional devices it enabled that the host has,
    and its MIG devices' capability nodes."""
    inventory = host.inventory
    wanted = _control_nodes(inventory, request.capabilities, notes)
    wanted += [(gpu.node, inventory.majors["nvidia"], gpu.minor) for gpu in gpus]
    wanted += _feature_nodes(request.features, host, notes)
    wanted += _mig_capability_nodes(inventory, cap_names)
    return wanted


def _control_nodes(inventory, caps, notes: list) -> list:
    """The driver's control nodes (driver.CONTROL_NODES) that capabilities `caps` need."""
    wanted = []
    for path, major_name, minor, capability in CONTROL_NODES:
        if capability is not None and capability not in caps:
            continue
        major = inventory.majors.get(major_name)
        if major is None:
            note = f"{major_name} is not loaded on the host: CUDA programs will fail to start"
            if note not in notes:
                notes.append(note)
            continue
        wanted.append((path, major, minor))
    return wanted


def _feature_nodes(features, host, notes: list) -> list:
    """NVIDIA_NVSWITCH / NVIDIA_GDRCOPY=enabled: the host's nodes, or, as NVIDIA's toolkit
    does when they are missing, none (with a note): the container can run without them."""
    wanted = []
    for variable, feature in resolve.FEATURES.items():
        if feature not in features:
            continue
        found = [(path, major, minor) for name, path, major, minor in host.feature_nodes
                 if name == feature and path in host.nodes]
        if not found:
            notes.append(f"{variable}={resolve.FEATURE_ON}, but the host has no {FEATURE_NODES[feature]}: not injected")
        wanted += found
    return wanted


def _mig_capability_nodes(inventory, cap_names) -> list:
    """The nvidia-caps nodes of the MIG capability files `cap_names` (_mig_capabilities)."""
    if not cap_names:
        return []
    caps_major = inventory.majors.get("nvidia-caps")
    if caps_major is None:
        raise HostError("MIG devices need the nvidia-caps device major, which /proc/devices does not list")
    wanted = []
    for name in cap_names:
        minor = inventory.mig_minors.get(_minor_key(name))
        if minor is None:
            raise HostError(f"the driver's MIG minor table has no entry for {_minor_key(name)}")
        wanted.append((f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor))
    return wanted


def _device_nodes(wanted, host, userns: bool, config, notes: list) -> list:
    """DeviceNode of each wanted node, with the host node's mode and owner (0666 root when the
    host has none); in a user namespace, the host node itself, to be bound."""
    nodes = []
    for path, major, minor in wanted:
        found = host.nodes.get(path)
        mode, uid, gid, host_path = found or (DEFAULT_NODE_MODE, 0, 0, None)
        if userns and host_path is None:
            raise HostError(f"{path} must be bound into a container with a user namespace, but the host has "
                            f"no such node (dev-root: {config.device_root})")
        nodes.append(DeviceNode(path, major, minor, mode, uid, gid, host_path if userns else None))
    if userns:
        notes.append("user namespace: device nodes are bind-mounted from the host, files are made as the "
                     "container's root")
    return nodes


def _driver_files(inventory, container, caps, notes: list) -> tuple:
    """(bind mounts, soname symlinks, the image's library dirs they land in) for the driver
    files of capabilities `caps`: libraries into the image's own library dirs (32-bit ones
    only with compat32), programs, data files and firmware at their paths, IPC endpoints."""
    mounts, symlinks, ld_dirs = [], [], []
    for lib in inventory.libraries:
        if lib.capability not in caps or (lib.bits == 32 and "compat32" not in caps):
            continue
        directory = container.lib64 if lib.bits == 64 else container.lib32
        if directory not in ld_dirs:
            ld_dirs.append(directory)
        mounts.append(BindMount(lib.host_path, f"{directory}/{lib.file_name}", "file", RO_LIB))
        symlinks += [Symlink(f"{directory}/{name}", lib.file_name) for name in lib.sonames]
    for cap in sorted(caps & LIBRARY_CAPABILITIES):
        if not any(lib.capability == cap for lib in inventory.libraries):
            notes.append(f"no {cap} libraries found in the host's ld cache")
    for item in inventory.binaries:
        if item.capability in caps:
            mounts.append(BindMount(item.host_path, item.container_path, "file", RO_LIB))
    if caps & {"utility", "compute"}:
        mounts += [BindMount(f.host_path, f.container_path, "file", RO_LIB) for f in inventory.firmware]
    for item in inventory.ipc:
        if item.capability in caps:
            options = MPS_OPTIONS if item.kind == "dir" else IPC_OPTIONS
            mounts.append(BindMount(item.host_path, item.container_path, item.kind, options))
    return mounts, symlinks, ld_dirs


def _cgroup_rules(nodes, spec, selection, cap_names, inventory, notes: list) -> list:
    """One device rule per node ("rw"; "r" for the nvidia-caps nodes, which NVIDIA makes 0444
    or 0400), kept within the runtime's own rules when the runtime made the grant, and for
    every device the runtime's rules name, whatever the channel (_within_named_rules)."""
    caps_major = inventory.majors.get("nvidia-caps")
    rules = [char_device(n.major, n.minor, "r" if n.major == caps_major else "rw") for n in nodes]
    if selection.runtime_grant:
        rules = _within_runtime_rules(rules, spec, selection.gpus, cap_names, inventory, notes)
    return _within_named_rules(rules, spec, notes)


def _within_named_rules(rules: list, spec, notes: list) -> list:
    """Never widen a device the runtime's rules name (RuntimeRules.names: `c 195:* r`,
    `podman --device /dev/nvidia2:r`, a node given only `m`): its rule keeps only the letters
    they allow, and is dropped when none is left (the node then opens with EPERM, as without
    the hook). A GPU request exists to add what the runtime's default deny leaves out, never
    what the runtime decided about that very device. Explicit denials are left whole here:
    _refuse_runtime_denials refuses the start for them."""
    from gpuhook.devrules.policy import RuntimeRules  # loaded already (gpuhook.request.resolve)

    runtime = RuntimeRules(spec.device_rules)
    return _narrowed(rules, runtime, lambda rule: runtime.names(rule) and not runtime.denied(rule),
                     "the runtime's own rules for that device", notes)


def _narrowed(rules, runtime, applies, whose: str, notes: list) -> list:
    """`rules`, each one `applies` picks cut down to what `runtime` grants (noted as narrowed
    to `whose`); a rule left with no letter is dropped."""
    kept = []
    for rule in rules:
        if applies(rule):
            narrowed = runtime.grantable(rule)
            if narrowed.access != rule.access and len(notes) < 16:
                notes.append(f"{rule.v1_line()} narrowed to {whose}: "
                             f"{narrowed.v1_line() if narrowed.access else 'not allowed'}")
            rule = narrowed
        if rule.access:
            kept.append(rule)
    return kept


def _refuse_runtime_denials(rules, nodes, spec) -> None:
    """Refuse (exit 3) a request that needs a device the runtime's own rules explicitly deny
    (`deny c 195:0 rwm`, even after `allow a *:* rwm`): granting it would widen what the
    runtime allowed (docs/security.md). Denials of every device (`a`, `c *:*`) are the default
    every GPU grant adds to and are left to gpuhook.devrules.policy's narrowing; any deny that
    names a number (`c *:1` included) is explicit (RuntimeRules.denied)."""
    from gpuhook.devrules.policy import RuntimeRules  # loaded already (gpuhook.request.resolve)

    runtime = RuntimeRules(spec.device_rules)
    paths = {(n.major, n.minor): n.path for n in nodes}
    for rule in rules:
        letters = runtime.denied(rule)
        if letters:
            raise RequestError(f"the runtime's device rules deny {rule.with_access(letters).v1_line()} "
                               f"({paths.get((rule.major, rule.minor), 'a device')[:80]}), which this request "
                               f"needs; gpuhook never grants what the runtime denied")


def _proc_mask(inventory, gpus, cap_names) -> ProcMask:
    """The /proc/driver/nvidia the container sees: its own GPUs' dirs and MIG capability files."""
    return ProcMask(inventory.proc_driver_dir, tuple(g.bus_id for g in gpus),
                    tuple(name for name in cap_names if name in inventory.capabilities))


def _ld_cache_update(host, ld_dirs, notes: list):
    """The host's ldconfig run for the library dirs of a glibc image (None for other images,
    or when no library is mounted); a glibc image without a usable ldconfig fails the start."""
    if not ld_dirs:
        return None
    if not host.container.glibc:
        notes.append("the image has no glibc (no ld cache, ld.so.conf or loader): ld cache not updated")
        return None
    ldconfig = host.ldconfig  # discover.find_ldconfig: a static one, or why there is none
    if ldconfig.path is None:
        raise HostError(ldconfig.problem, ldconfig.hint)
    if ldconfig.note:
        notes.append(ldconfig.note)
    return LdCacheUpdate(ldconfig.path, tuple(ld_dirs))


def _health_step(config, gpus, spec):
    """Check and repair the GPUs while the rest is applied (docs/health.md); None with health off."""
    if config.health.mode == "off" or not gpus:
        return None
    from gpuhook.health import store

    h = config.health
    return HealthStep(h.mode, tuple(dict.fromkeys(g.uuid for g in gpus)), h.on_failure, h.kill_orphans,
                      h.deadline_seconds, store.allocation_tokens(spec.mounts))


def _within_runtime_rules(rules: list, spec, gpus, cap_names, inventory, notes: list) -> list:
    """A grant the runtime made through linux.devices is never widened (docs/security.md):
    each GPU and MIG capability node's rule keeps only the letters the runtime's own device
    rules already allow (gpuhook.devrules.policy), and is dropped when none is left. The
    control nodes (nvidiactl, nvidia-uvm, ...) are the driver's, not the grant's."""
    from gpuhook.devrules.policy import RuntimeRules

    nvidia, caps_major = inventory.majors["nvidia"], inventory.majors.get("nvidia-caps")
    granted = {(nvidia, gpu.minor) for gpu in gpus}
    granted |= {(caps_major, inventory.mig_minors.get(_minor_key(name))) for name in cap_names}
    return _narrowed(rules, RuntimeRules(spec.device_rules), lambda rule: (rule.major, rule.minor) in granted,
                     "the runtime's own device rules", notes)


def runtime_dev_tmpfs(mounts) -> bool:
    """Whether the last mount the spec makes at /dev is a fresh tmpfs (not a bind of a host
    directory, which would be a volume)."""
    last = None
    for m in mounts:
        if m.destination.rstrip("/") == "/dev":
            last = m
    return last is not None and last.type == "tmpfs" and not {"bind", "rbind"} & set(last.options)


def requirement_facts(inventory, facts, selection):
    """What NVIDIA_REQUIRE_* constraints are checked against: the CUDA and driver versions
    and, per GPU the container gets, its compute capability and brand."""
    gpus = []
    for gpu in selection.gpus:
        known = facts.gpus.get(gpu.uuid) if facts else None
        gpus.append(gpu._replace(arch=known.arch, brand=known.brand) if known else gpu)
    from gpuhook.plan.requirements import HostFacts

    return HostFacts(facts.cuda_version if facts else None, inventory.driver_version, gpus)


def _mig_capabilities(selection, inventory) -> list:
    """Capability file names (as under /proc/driver/nvidia/capabilities) the selection needs."""
    names = []
    if selection.mig_config:
        names.append("mig/config")
    if selection.mig_monitor:
        names.append("mig/monitor")
    for mig in selection.migs:
        gi, ci = mig.gpu_instance_id, mig.compute_instance_id
        names.append(f"gpu{mig.gpu_minor}/mig/gi{gi}/access")
        names.append(f"gpu{mig.gpu_minor}/mig/gi{gi}/ci{ci}/access")
    unique = []
    for name in names:
        if name not in unique:
            unique.append(name)
    return unique


def _minor_key(capability: str) -> str:
    """The mig-minors key of a capability file: "gpu0/mig/gi1/access" -> "gpu0/gi1/access"."""
    if capability.startswith("mig/"):
        return capability[len("mig/"):]
    return capability.replace("/mig/", "/", 1)
