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
import signal
import threading

import grpc

from gpuhook import discover, journal
from gpuhook import request as req
from gpuhook.errors import GpuhookError, InputError
from gpuhook.health import store

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
ENDPOINT = "gpuhook.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
CDI_ANNOTATION = "cdi.k8s.io/gpuhook"


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
    gpus = discover.gpus(config.proc_root)
    ids, gpu_of, numa = [], {}, {}
    migs = {}
    if config.plugin.mig_strategy == "single" and discover.capabilities(config.proc_root):
        from gpuhook.inventory import nvml_facts

        facts, _ = nvml_facts(config, write=False)
        migs = {uuid: g.mig_devices for uuid, g in facts.gpus.items() if g.mig_mode}
    for gpu in gpus:
        node = discover.numa_node(config.sys_root, gpu.bus_id)
        for ident in [mig.uuid for mig in migs[gpu.uuid]] if gpu.uuid in migs else [gpu.uuid]:
            ids.append(ident)
            gpu_of[ident] = gpu.uuid
            if node is not None:
                numa[ident] = node
    return Devices(ids, gpu_of, numa)


def allocate_response(pb, ids: list, strategy: str):
    """What makes the hook grant exactly `ids`, by strategy (docs/device-plugin.md)."""
    response = pb.ContainerAllocateResponse()
    if strategy == "volume-mounts":
        for ident in ids:
            response.mounts.add(container_path=f"{req.VOLUME_MOUNT_ROOT}/{ident}", host_path="/dev/null",
                                read_only=True)
        response.envs["NVIDIA_VISIBLE_DEVICES"] = req.VOLUME_MOUNT_ROOT  # names no GPU itself
    elif strategy == "envvar":
        response.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
    elif strategy == "cdi-annotations":
        response.annotations[CDI_ANNOTATION] = ",".join(f"{req.CDI_KIND}={ident}" for ident in ids)
    elif strategy == "cdi-cri":
        for ident in ids:
            response.cdi_devices.add(name=f"{req.CDI_KIND}={ident}")
    return response


def preferred(devices: Devices, available: list, must: list, size: int, state_dir: str) -> list:
    """`size` of the `available` devices, `must` (must_include) among them, best first.

    Devices rank healthy first, then most recently stamped (cleaned by PreStartContainer),
    then NVML index order. Topology: the NUMA node of each GPU (sysfs). The choice stays on
    one NUMA node when it can: the node of the must_include devices if they share one, else
    the node whose best devices hold the fewest unhealthy ones and rank best. When no node
    has enough devices, the best-ranked ones are taken, whatever their node. NVLink is not
    considered: seeing it needs NVML, which the plugin's allocation path does not load."""
    def stamped(ident):
        try:
            return os.stat(store.stamp_path(state_dir, devices.gpu_of.get(ident, ident))).st_mtime
        except (OSError, ValueError, GpuhookError):
            return 0.0

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
        self.stop = threading.Event()
        self.server = None
        self.pb, self.rpc = _api()

    # --- the service -------------------------------------------------------------------

    def GetDevicePluginOptions(self, request, context):
        return self.pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        seen = -1
        while not self.stop.is_set() and context.is_active():
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
        for ask in request.container_requests:
            ids = preferred(self.devices, list(ask.available_deviceIDs), list(ask.must_include_deviceIDs),
                            ask.allocation_size, self.config.state_dir)
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request, context):
        response = self.pb.AllocateResponse()
        for ask in request.container_requests:
            unknown = [i for i in ask.devicesIDs if i not in self.devices.gpu_of]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown device {unknown[0][:100]}")
            response.container_responses.append(allocate_response(self.pb, list(ask.devicesIDs),
                                                                   self.config.plugin.strategy))
        return response

    def PreStartContainer(self, request, context):
        from gpuhook import health

        ids = list(request.devicesIDs)
        uuids = list(dict.fromkeys(self.devices.gpu_of.get(i, i) for i in ids))
        try:
            health.prepare(uuids, self.config, self.config.plugin.prestart_deadline_seconds)
        except GpuhookError as err:
            failed = getattr(err, "gpu", None)
            for ident in ids:
                if failed is None or self.devices.gpu_of.get(ident, ident) == failed:
                    self.devices.set(ident, False, err.one_line())
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, err.one_line())
        for ident in ids:
            self.devices.set(ident, True)
        return self.pb.PreStartContainerResponse()

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
        while not self.stop.is_set():
            self.recheck()
            self.stop.wait(self.config.plugin.recheck_seconds)

    def serve(self) -> None:
        from concurrent import futures

        if os.path.lexists(self.socket):
            os.unlink(self.socket)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.rpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        os.chmod(self.socket, 0o600)

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
        threading.Thread(target=health_daemon.run, daemon=True).start()
        kubelet = os.path.join(self.dir, KUBELET_SOCKET)
        registered_with = None
        while not self.stop.is_set():
            if not os.path.exists(self.socket):
                self.server.stop(0)
                self.serve()
                registered_with = None
            current = self._identity(kubelet)
            if current is not None and current != registered_with:
                try:
                    self.register()
                    registered_with = current
                except grpc.RpcError as err:
                    self._log("registration failed", error=str(err.details() or err.code())[:200])
            self.stop.wait(0.5)
        self.server.stop(grace=2).wait()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        self._log("stopped")
        return 0

    def _log(self, decision: str, **fields) -> None:
        journal.write(self.config.log_file, {"stage": "plugin", "decision": decision, **fields},
                      self.config.log_target, self.config.syslog_socket)


def main(config, plugin_dir: str) -> int:
    os.makedirs(plugin_dir, exist_ok=True)
    return Plugin(config, plugin_dir).run()

