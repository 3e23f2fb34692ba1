"""`gpuhook plugin`: a Kubernetes device plugin (API v1beta1) that implements PreStartContainer.

kubelet calls PreStartContainer before every container start only for a plugin that
registers with `pre_start_required`. This one does, and runs there exactly what `gpuhook
prepare` does: check every GPU in parallel, kill proven orphans, reset when that is the
remedy, check again, and stamp each GPU that is fine so the hook (health.mode = fallback)
skips it. A GPU that cannot be made clean fails the call (naming the GPU, the check and the
evidence) and goes Unhealthy on ListAndWatch. docs/device-plugin.md has the whole contract.

Device IDs are GPU UUIDs (MIG UUIDs under mig-strategy = single). Allocate returns what makes
gpuhook's hook grant exactly those GPUs (plugin.strategy). grpcio is imported here only: the
hook never imports this package (tests/integration/test_plugin.py checks it).
"""

import os
import secrets
import signal
import stat
import threading
from collections import OrderedDict

import grpc

from gpuhook import journal
from gpuhook.kernel import files
from gpuhook.discover import proc
from gpuhook import driver
from gpuhook.request import resolve
from gpuhook.errors import GpuhookError, HostError, InputError, printable
from gpuhook.health import store

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
ENDPOINT = "gpuhook.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
CDI_ANNOTATION = "cdi.k8s.io/gpuhook"
MAX_DETAILS = 1000  # characters of an error's details: gRPC sends them as a header (8 KiB at most)
MAX_WATCHERS = 4  # ListAndWatch streams at once; each holds one of the server's threads
MAX_ALLOCATIONS = 256  # allocations whose token PreStartContainer can still stamp for


def _api():
    try:
        from gpuhook.plugin.generated import deviceplugin_pb2 as pb
        from gpuhook.plugin.generated import deviceplugin_pb2_grpc as rpc
    except ImportError as err:
        raise InputError("the device plugin's gRPC stubs are missing",
                         "generate them: python3 gpuhook/plugin/build_stubs.py (scripts/setup does)") from err
    return pb, rpc


class Devices:
    """The devices this node offers, their health, and who waits for a change."""

    def __init__(self, ids: list, gpu_of: dict, numa: dict | None = None):
        self.ids = list(ids)  # device IDs, in NVML index order
        self.gpu_of = dict(gpu_of)  # device ID -> parent GPU UUID (itself for a whole GPU)
        self.numa = dict(numa or {})  # device ID -> NUMA node of its GPU; absent when unknown
        self.health = {ident: HEALTHY for ident in ids}
        self.reasons: dict = {}
        self.version = 0
        self.changed = threading.Condition()

    def set(self, ident: str, healthy: bool, reason: str = "") -> None:
        """Set the health of advertised device `ident`; any other id changes nothing."""
        if ident not in self.gpu_of:
            return
        with self.changed:
            state = HEALTHY if healthy else UNHEALTHY
            if self.health.get(ident) != state:
                self.health[ident] = state
                self.version += 1
                self.changed.notify_all()
            if healthy:
                self.reasons.pop(ident, None)
            else:
                self.reasons[ident] = reason


def offered_devices(config) -> Devices:
    """The devices to advertise (plugin.mig-strategy)."""
    gpus = proc.gpus(config.proc_root)
    ids, gpu_of, numa = [], {}, {}
    migs = {}
    if config.plugin.mig_strategy == "single" and proc.has_mig_instances(proc.capabilities(config.proc_root)):
        from gpuhook.discover.inventory import nvml_facts

        facts, _ = nvml_facts(config)
        migs = {uuid: g.mig_devices for uuid, g in facts.gpus.items() if g.mig_mode}
    for gpu in gpus:
        node = proc.numa_node(config.sys_root, gpu.bus_id)
        for ident in [mig.uuid for mig in migs[gpu.uuid]] if gpu.uuid in migs else [gpu.uuid]:
            ids.append(ident)
            gpu_of[ident] = gpu.uuid
            if node is not None:
                numa[ident] = node
    return Devices(ids, gpu_of, numa)


class Allocations:
    """The token of each allocation, by its exact device set: PreStartContainer names only
    devices, and stamps for the allocation holding exactly those (docs/device-plugin.md,
    "Stamps bound to the allocation"). kubelet gives a device to one container at a time, so
    the newest allocation of a device set is the one being started. Bounded: the oldest
    entries go first (their containers then do their own checks)."""

    def __init__(self, limit: int = MAX_ALLOCATIONS):
        self.limit = limit
        self.tokens: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def new(self, ids) -> str:
        token = secrets.token_hex(16)
        with self.lock:
            key = frozenset(ids)
            self.tokens.pop(key, None)
            self.tokens[key] = token
            while len(self.tokens) > self.limit:
                self.tokens.popitem(last=False)
        return token

    def token(self, ids) -> str | None:
        with self.lock:
            return self.tokens.get(frozenset(ids))


def details(text: str) -> str:
    """An RPC error's details: printable and short enough for gRPC's header limit (a longer
    one makes kubelet see a transport error instead of ours)."""
    text = printable(text)
    return text if len(text) <= MAX_DETAILS else text[:MAX_DETAILS - 1] + "…"


def allocate_response(pb, ids: list, strategy: str, token: str | None = None):
    """What makes the hook grant exactly `ids`, by strategy (docs/device-plugin.md), and, with
    `token`, the allocation's token: a read-only /dev/null bind at
    <store.ALLOCATION_ROOT>/<token>, which an image cannot add, so only this allocation's
    container claims the stamps PreStartContainer leaves for it."""
    response = pb.ContainerAllocateResponse()
    if token is not None:
        response.mounts.add(container_path=f"{store.ALLOCATION_ROOT}/{token}", host_path="/dev/null", read_only=True)
    if strategy == "volume-mounts":
        for ident in ids:
            response.mounts.add(container_path=f"{resolve.VOLUME_MOUNT_ROOT}/{ident}", host_path="/dev/null",
                                read_only=True)
        response.envs["NVIDIA_VISIBLE_DEVICES"] = resolve.VOLUME_MOUNT_ROOT  # names no GPU itself
    elif strategy == "envvar":
        response.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
    elif strategy == "cdi-annotations":
        response.annotations[CDI_ANNOTATION] = ",".join(f"{driver.CDI_KIND}={ident}" for ident in ids)
    elif strategy == "cdi-cri":
        for ident in ids:
            response.cdi_devices.add(name=f"{driver.CDI_KIND}={ident}")
    return response


def preferred(devices: Devices, available: list, must: list, size: int, state_dir: str) -> list:
    """`size` of the `available` devices, `must` (must_include) among them, best first.

    Devices rank healthy first, then most recently stamped (cleaned by PreStartContainer),
    then NVML index order. Topology: the NUMA node of each GPU (sysfs). The choice stays on
    one NUMA node when it can: the node of the must_include devices if they share one, else
    the node whose best devices hold the fewest unhealthy ones and rank best. When no node
    has enough devices, the best-ranked ones are taken, whatever their node. NVLink is not
    considered: seeing it needs NVML, which the plugin's allocation path does not load."""
    last = store.last_stamped(state_dir)

    def stamped(ident):
        return last.get(devices.gpu_of.get(ident, ident), 0.0)

    chosen = [ident for ident in must if ident in available]
    order = {ident: i for i, ident in enumerate(devices.ids)}
    rank = {ident: (devices.health.get(ident) != HEALTHY, -stamped(ident), order.get(ident, 1 << 30))
            for ident in available}
    rest = sorted((ident for ident in available if ident not in chosen), key=rank.__getitem__)
    wanted = max(size - len(chosen), 0)
    nodes = {devices.numa.get(ident) for ident in available} - {None}
    if wanted and nodes:
        by_node: dict = {}
        for ident in rest:
            by_node.setdefault(devices.numa.get(ident), []).append(ident)
        pinned = {devices.numa.get(ident) for ident in chosen}
        fitting = [node for node in sorted(nodes) if len(by_node.get(node, ())) >= wanted]
        if len(pinned) == 1 and next(iter(pinned)) in fitting:
            home = next(iter(pinned))
        elif fitting:
            # Fewest unhealthy devices first, then the better-ranked devices.
            home = min(fitting, key=lambda node: (sum(rank[i][0] for i in by_node[node][:wanted]),
                                                  [rank[i] for i in by_node[node][:wanted]]))
        else:
            home = None
        if home is not None:
            rest = by_node[home] + [ident for ident in rest if devices.numa.get(ident) != home]
    return (chosen + rest)[:max(size, len(chosen))]


def repairable_when_idle(result) -> bool:
    """Whether a read-only check's GpuResult is an unhealthy GPU nobody uses whose remaining
    problems include one a kill or a reset can fix."""
    from gpuhook.health.checks import Remedy

    return (not result.ok and result.status.value == "unhealthy" and not result.users
            and any(problem.remedy in (Remedy.KILL, Remedy.RESET) for problem in result.problems))


class Plugin:
    """The DevicePlugin service and the loops around it."""

    def __init__(self, config, plugin_dir: str):
        self.config = config
        self.dir = os.path.abspath(plugin_dir)
        self.socket = os.path.join(self.dir, ENDPOINT)
        self.devices = offered_devices(config)
        self.allocations = Allocations()
        self.watchers: list = []  # one stop event per ListAndWatch stream, oldest first
        self.watchers_lock = threading.Lock()
        self.stop = threading.Event()
        self.server = None
        self.pb, self.rpc = _api()

    # --- the service -------------------------------------------------------------------

    def GetDevicePluginOptions(self, request, context):
        return self.pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        # kubelet keeps one stream; each holds a server thread for its lifetime. Beyond
        # MAX_WATCHERS the oldest stream ends, so streams can never take every thread from
        # Allocate and PreStartContainer.
        ended = threading.Event()
        with self.watchers_lock:
            self.watchers.append(ended)
            while len(self.watchers) > MAX_WATCHERS:
                self.watchers.pop(0).set()
        try:
            yield from self._watch(context, ended)
        finally:
            with self.watchers_lock:
                if ended in self.watchers:
                    self.watchers.remove(ended)

    def _watch(self, context, ended):
        seen = -1
        while not self.stop.is_set() and not ended.is_set() and context.is_active():
            with self.devices.changed:
                if self.devices.version == seen:
                    self.devices.changed.wait(timeout=1.0)
                    continue
                seen = self.devices.version
                snapshot = [(ident, self.devices.health[ident]) for ident in self.devices.ids]
            yield self.pb.ListAndWatchResponse(devices=[self._device(i, h) for i, h in snapshot])

    def _device(self, ident: str, health: str):
        """A Device message; its NUMA node, when known, lets kubelet's Topology Manager align
        the GPU with the CPUs and memory it gives the pod."""
        node = self.devices.numa.get(ident)
        if node is None:
            return self.pb.Device(ID=ident, health=health)
        return self.pb.Device(ID=ident, health=health,
                              topology=self.pb.TopologyInfo(nodes=[self.pb.NUMANode(ID=node)]))

    def GetPreferredAllocation(self, request, context):
        response = self.pb.PreferredAllocationResponse()
        asked = []
        for ask in request.container_requests:
            # Only advertised devices are ranked (an unknown id costs nothing and is never
            # preferred); a size beyond them means all of them.
            available = [i for i in dict.fromkeys(ask.available_deviceIDs) if i in self.devices.gpu_of]
            must = [i for i in dict.fromkeys(ask.must_include_deviceIDs) if i in self.devices.gpu_of]
            size = min(max(ask.allocation_size, 0), len(available))
            ids = preferred(self.devices, available, must, size, self.config.state_dir)
            response.container_responses.add(deviceIDs=ids)
            asked.append({"available": list(ask.available_deviceIDs), "must_include": list(ask.must_include_deviceIDs),
                          "size": ask.allocation_size, "preferred": ids})
        # kubelet's v1beta1 requests name no pod (api.proto): the hook's line at the
        # container's start names it, with the same GPUs (docs/device-plugin.md, "Logging").
        self._log("preferred allocation", containers=asked)
        return response

    def Allocate(self, request, context):
        response = self.pb.AllocateResponse()
        asked = [list(ask.devices_ids) for ask in request.container_requests]
        strategy = self.config.plugin.strategy
        unknown = [i for ids in asked for i in ids if i not in self.devices.gpu_of]
        # A container asking for more devices than advertised, or for one device twice,
        # is refused like an unknown id: kubelet never sends either (attacker finding P1).
        too_many = next((ids for ids in asked if len(ids) > len(self.devices.ids)), None)
        twice = next((ids for ids in asked if len(set(ids)) != len(ids)), None)
        error = (f"{len(too_many)} device ids: more than the {len(self.devices.ids)} this plugin offers"
                 if too_many is not None else f"unknown device {unknown[0][:100]}" if unknown
                 else "a device named twice" if twice is not None else None)
        self._log("allocate", strategy=strategy, gpus=list(dict.fromkeys(
                      self.devices.gpu_of[i] for ids in asked for i in ids if i in self.devices.gpu_of)),
                  containers=[{"devices": ids[:64]} for ids in asked[:16]],
                  **({"error": error} if error else {}))
        if error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        for ids in asked:
            response.container_responses.append(allocate_response(self.pb, ids, strategy,
                                                                   self.allocations.new(ids)))
        return response

    def PreStartContainer(self, request, context):
        from gpuhook import health

        ids = self._advertised(request.devices_ids, context)
        uuids = list(dict.fromkeys(self.devices.gpu_of[i] for i in ids))
        try:
            health.prepare(uuids, self.config, self.config.plugin.prestart_deadline_seconds,
                           self.allocations.token(ids))
        except GpuhookError as err:
            report = getattr(err, "report", None)
            if report is not None and report.gpus:
                failed = {g.uuid for g in report.gpus if not g.ok}
            else:
                failed = {getattr(err, "gpu", None)} if getattr(err, "gpu", None) else set(uuids)
            for ident in ids:
                if self.devices.gpu_of[ident] in failed:
                    self.devices.set(ident, False, err.one_line())
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, details(err.one_line()))
        for ident in ids:
            self.devices.set(ident, True)
        return self.pb.PreStartContainerResponse()

    def _advertised(self, ids, context) -> list:
        """`ids` when each is a device this plugin advertises, named once; otherwise the call
        ends with INVALID_ARGUMENT before any work, lock, report or stamp (kubelet only ever
        names devices it got from ListAndWatch)."""
        ids = list(ids)
        if len(ids) > len(self.devices.ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{len(ids)} device ids: more than the {len(self.devices.ids)} this plugin offers")
        unknown = [i for i in ids if i not in self.devices.gpu_of]
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(f"unknown device {unknown[0][:100]!r}"))
        if len(set(ids)) != len(ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a device named twice")
        return ids

    # --- the loops ---------------------------------------------------------------------

    def recheck(self) -> None:
        """Checks of every GPU, in parallel; update the health of its devices.

        An unhealthy GPU nobody holds (no process of a live owner on it, no live container
        gpuhook started with it) whose fault a kill or a reset can fix is repaired right away
        and advertised Healthy at once: kubelet never allocates an Unhealthy device, so no
        PreStartContainer would ever clean it (docs/device-plugin.md, Health)."""
        from gpuhook import health

        uuids = list(dict.fromkeys(self.devices.gpu_of.values()))
        deadline = min(self.config.plugin.recheck_seconds, 20.0)
        try:
            report = health.check(uuids, self.config, repair=False, deadline_seconds=deadline)
            results = {g.uuid: g for g in report.gpus}
            idle = [g.uuid for g in report.gpus if repairable_when_idle(g)]
            if idle:
                repaired = health.check(idle, self.config, repair=True,
                                        deadline_seconds=self.config.health.deadline_seconds)
                results.update({g.uuid: g for g in repaired.gpus if g.status.value != "unchecked"})
                self._log("repaired idle GPUs", gpus={g.uuid: g.status.value for g in repaired.gpus})
        except GpuhookError as err:
            results, reason = {}, err.one_line()
        else:
            reason = "not checked before the deadline"
        for ident in self.devices.ids:
            result = results.get(self.devices.gpu_of[ident])
            if result is None:
                self.devices.set(ident, False, reason)
            else:
                self.devices.set(ident, result.ok, "" if result.ok else result.failure())

    def _recheck_loop(self) -> None:
        # run() checked every GPU just before serving: the loop's first check is one period on.
        while not self.stop.wait(self.config.plugin.recheck_seconds):
            self.recheck()

    def serve(self) -> None:
        from concurrent import futures

        if os.path.lexists(self.socket):
            os.unlink(self.socket)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.rpc.add_DevicePluginServicer_to_server(self, self.server)
        # 0600 from the moment it exists: a chmod after the bind leaves a moment in which,
        # under a umask of 0, anyone could connect and call Allocate or PreStartContainer.
        mask = os.umask(0o177)
        try:
            self.server.add_insecure_port(f"unix://{self.socket}")
            self.server.start()
        finally:
            os.umask(mask)

    def register(self) -> None:
        kubelet = os.path.join(self.dir, KUBELET_SOCKET)
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            stub = self.rpc.RegistrationStub(channel)
            stub.Register(self.pb.RegisterRequest(
                version=API_VERSION, endpoint=ENDPOINT, resource_name=self.config.plugin.resource_name,
                options=self.pb.DevicePluginOptions(pre_start_required=True,
                                                    get_preferred_allocation_available=True)), timeout=10)
        self._log("registered", kubelet=kubelet, devices=len(self.devices.ids))

    def _identity(self, path: str):
        try:
            st = os.stat(path)
            return st.st_dev, st.st_ino
        except OSError:
            return None

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; register again whenever kubelet's socket is new or
        ours was removed (kubelet removes plugin sockets when it restarts)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        self.recheck()
        self.serve()
        threading.Thread(target=self._recheck_loop, daemon=True).start()
        from gpuhook.health import daemon  # the hook's health daemon: NVML stays loaded here

        health_daemon = daemon.Daemon(self.config)
        health_daemon.stop = self.stop
        health_thread = threading.Thread(target=self._run_daemon, args=(health_daemon,), daemon=True)
        health_thread.start()
        kubelet = os.path.join(self.dir, KUBELET_SOCKET)
        registered_with = None
        waiting = False  # said so in the log, once for each time kubelet's socket is missing
        while not self.stop.is_set():
            if not os.path.exists(self.socket):
                self.server.stop(0)
                self.serve()
                registered_with = None
            current = self._identity(kubelet)
            if current is None and not waiting:
                self._log("waiting for kubelet", kubelet=kubelet)
            waiting = current is None
            if current is not None and current != registered_with:
                try:
                    self.register()
                    registered_with = current
                except grpc.RpcError as err:
                    self._log("registration failed", error=str(err.details() or err.code())[:200])
            self.stop.wait(0.5)
        self.server.stop(grace=2).wait()
        # The health daemon sees the same stop event; wait (bounded) for it to remove its
        # socket, or a SIGTERM left health.sock behind for the next start to trip on.
        health_thread.join(timeout=5)
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        self._log("stopped")
        return 0

    def _run_daemon(self, health_daemon) -> None:
        """The health daemon, for as long as the plugin runs; one it cannot start (a socket
        directory others can write) is logged, and the hooks then do their own checks."""
        try:
            health_daemon.run()
        except GpuhookError as err:
            self._log("health daemon not started", error=err.one_line())

    def _log(self, decision: str, **fields) -> None:
        journal.write(self.config.log_file, {"stage": "plugin", "decision": decision, **fields},
                      self.config.log_target, self.config.syslog_socket)


def main(config, plugin_dir: str) -> int:
    os.makedirs(plugin_dir, mode=0o750, exist_ok=True)
    st = os.lstat(plugin_dir)
    # Whoever can write the directory can swap our socket for theirs (kubelet would then
    # Allocate through them) or remove it at will.
    if not stat.S_ISDIR(st.st_mode) or not files.trusted(st):
        raise HostError(f"the device plugin directory {printable(plugin_dir)[:200]} is not a directory owned by root "
                         "and writable only by it", "kubelet's own is /var/lib/kubelet/device-plugins (0750 or 0755)")
    return Plugin(config, plugin_dir).run()

