"""`gpuhook plugin` against a fake kubelet that speaks the real v1beta1 gRPC API (the
Registration service on kubelet.sock, and a DevicePlugin client), on a simulated host of
its own (these tests break its GPUs). docs/device-plugin.md."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
import pytest
from conftest import require, require_root_tools, sim_config_values, write_config
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml


pytestmark = pytest.mark.root


grpc = pytest.importorskip("grpc") if not os.environ.get("GPUHOOK_STRICT") else __import__("grpc")


def api():
    try:
        from gpuhook.plugin.generated import deviceplugin_pb2 as pb
        from gpuhook.plugin.generated import deviceplugin_pb2_grpc as rpc
    except ImportError:
        require(False, "the device plugin's stubs are not generated (python3 gpuhook/plugin/build_stubs.py)")
    return pb, rpc


class FakeKubelet:
    """kubelet's side: the Registration service on DIR/kubelet.sock; records registrations."""

    def __init__(self, directory: str):
        pb, rpc = api()
        self.pb = pb
        self.directory = directory
        self.registrations = []
        kubelet = self

        class Registration(rpc.RegistrationServicer):
            def Register(self, request, context):
                kubelet.registrations.append(request)
                return pb.Empty()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc.add_RegistrationServicer_to_server(Registration(), self.server)
        self.server.add_insecure_port(f"unix://{directory}/kubelet.sock")
        self.server.start()

    def stop(self) -> None:
        """As a kubelet restart does: stop, and remove every socket in the plugin dir."""
        self.server.stop(0).wait()
        for name in os.listdir(self.directory):
            if name.endswith(".sock"):
                os.unlink(os.path.join(self.directory, name))

    def plugin(self):
        pb, rpc = api()
        channel = grpc.insecure_channel(f"unix://{self.directory}/gpuhook.sock")
        return pb, rpc.DevicePluginStub(channel), channel


def wait(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "runc")
    api()
    # Two NUMA nodes: GPUs 0 and 1 on node 0, GPUs 2 and 3 on node 1.
    return simhost.build(str(tmp_path_factory.mktemp("plugin") / "host"), gpus=4, seed="plugin", numa_nodes=2)


@contextlib.contextmanager
def running_plugin(sim, tmp_path, recheck_seconds, **overrides):
    """A fake kubelet and `gpuhook plugin` running against it (config `overrides` by table)."""
    pristine = simnvml.load(sim["nvml_state"])
    directory = tempfile.mkdtemp(prefix="gpuhook-dp-", dir="/tmp")  # unix socket paths stay short
    config = write_config(str(tmp_path / "config.toml"), sim_config_values(sim, str(tmp_path / "gpuhook.log")),
                          plugin={"recheck-seconds": recheck_seconds}, **overrides)
    kubelet = FakeKubelet(directory)
    process = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--config", config,
                                "--device-plugin-dir", directory], cwd="/", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    state = {"kubelet": kubelet, "process": process, "dir": directory, "config": config, "sim": sim,
             "state_dir": str(tmp_path / "run"), "log": str(tmp_path / "gpuhook.log")}
    try:
        assert wait(lambda: kubelet.registrations and os.path.exists(f"{directory}/gpuhook.sock")), \
            process.stderr.read1(4096) if process.poll() is not None else "no registration"
        yield state
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        state["kubelet"].stop()
        shutil.rmtree(directory, ignore_errors=True)
        simnvml.save(sim["nvml_state"], pristine)


@pytest.fixture
def cluster(sim, tmp_path):
    with running_plugin(sim, tmp_path, 0.5) as state:
        yield state


@pytest.fixture
def quiet_cluster(sim, tmp_path):
    """A cluster whose plugin re-checks its GPUs only once, at its start: a device's health
    then changes only through the call under test. Yielded once the plugin's health daemon
    listens, so nothing of the start still writes state files."""
    with running_plugin(sim, tmp_path, 3600) as state:
        assert wait(lambda: os.path.exists(f"{state['state_dir']}/health.sock")), "the health daemon never listened"
        yield state


def first_devices(pb, stub) -> dict:
    stream = stub.ListAndWatch(pb.Empty(), timeout=10)
    response = next(stream)
    stream.cancel()
    return {d.ID: d.health for d in response.devices}


def test_registration_says_v1beta1_its_socket_and_that_prestart_is_required(cluster):
    (request,) = cluster["kubelet"].registrations
    assert (request.version, request.endpoint, request.resource_name) == ("v1beta1", "gpuhook.sock", "nvidia.com/gpu")
    assert request.options.pre_start_required and request.options.get_preferred_allocation_available
    assert oct(os.stat(f"{cluster['dir']}/gpuhook.sock").st_mode & 0o777) == "0o600"
    pb, stub, channel = cluster["kubelet"].plugin()
    with channel:
        assert first_devices(pb, stub) == {g["uuid"]: "Healthy" for g in cluster["sim"]["gpus"]}
        stream = stub.ListAndWatch(pb.Empty(), timeout=10)
        devices = next(stream).devices
        stream.cancel()
        # The NUMA node of each GPU, for kubelet's Topology Manager.
        assert {d.ID: [n.ID for n in d.topology.nodes] for d in devices} == \
            {g["uuid"]: [g["numa_node"]] for g in cluster["sim"]["gpus"]} != {}
        assert [g["numa_node"] for g in cluster["sim"]["gpus"]] == [0, 0, 1, 1]
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert options.pre_start_required


def test_a_gpu_goes_unhealthy_on_the_stream_and_healthy_again(cluster):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    bad = sim["gpus"][2]["uuid"]
    seen = []
    with channel:
        stream = stub.ListAndWatch(pb.Empty(), timeout=30)

        def watch():
            try:
                for response in stream:
                    seen.append({d.ID: d.health for d in response.devices})
            except grpc.RpcError:
                pass

        threading.Thread(target=watch, daemon=True).start()
        assert wait(lambda: seen)
        # A fault no kill or reset can fix, mended from outside (the GPU serviced).
        simnvml.set_gpu(sim["nvml_state"], 2, remapped_rows_failure=True)
        assert wait(lambda: seen[-1][bad] == "Unhealthy"), seen[-1]
        assert all(h == "Healthy" for ident, h in seen[-1].items() if ident != bad)
        simnvml.set_gpu(sim["nvml_state"], 2, remapped_rows_failure=False)
        assert wait(lambda: seen[-1][bad] == "Healthy"), seen[-1]
        stream.cancel()


def test_an_idle_unhealthy_gpu_a_reset_can_fix_is_repaired_and_advertised_healthy(cluster):
    # kubelet never allocates an Unhealthy device, so no PreStartContainer would clean it:
    # the plugin repairs it once nobody holds it.
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    bad = sim["gpus"][1]["uuid"]
    seen = []
    with channel:
        stream = stub.ListAndWatch(pb.Empty(), timeout=60)

        def watch():
            try:
                for response in stream:
                    seen.append({d.ID: d.health for d in response.devices})
            except grpc.RpcError:
                pass

        threading.Thread(target=watch, daemon=True).start()
        assert wait(lambda: seen)
        simnvml.set_gpu(sim["nvml_state"], 1, ecc_volatile_uncorrected=1, reset_fails=True)  # a reset fails for now
        assert wait(lambda: seen[-1][bad] == "Unhealthy"), seen[-1]
        simnvml.set_gpu(sim["nvml_state"], 1, reset_fails=False)
        assert wait(lambda: seen[-1][bad] == "Healthy"), seen[-1]
        record = simnvml.load(sim["nvml_state"])["gpus"][1]
        assert record["ecc_volatile_uncorrected"] == 0 and record["reset_count"] >= 1
        stream.cancel()


def test_an_unhealthy_gpu_a_live_process_uses_is_left_alone(cluster):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    user = subprocess.Popen(["sleep", "600"])
    try:
        simnvml.set_gpu(sim["nvml_state"], 0, ecc_volatile_uncorrected=1,
                        compute_processes=[simnvml.process(user.pid, 1 << 30)])
        with channel:
            assert wait(lambda: first_devices(pb, stub)[sim["gpus"][0]["uuid"]] == "Unhealthy")
            time.sleep(1.5)  # three rechecks
            assert simnvml.load(sim["nvml_state"])["gpus"][0]["reset_count"] == 0
        assert user.poll() is None
    finally:
        user.kill()
        user.wait()


ALLOCATION_ROOT = "/var/run/gpuhook-allocation/"


def allocate(pb, stub, ids):
    """kubelet's Allocate of `ids` for one container: its ContainerAllocateResponse."""
    response = stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
                             timeout=10)
    (container,) = response.container_responses
    return container


def allocation_token(container) -> str:
    (token,) = [m.container_path[len(ALLOCATION_ROOT):] for m in container.mounts
                if m.container_path.startswith(ALLOCATION_ROOT) and m.host_path == "/dev/null" and m.read_only]
    return token


def test_prestart_cleans_and_stamps_and_refuses_a_gpu_a_reset_cannot_fix(cluster):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    good, bad = sim["gpus"][0]["uuid"], sim["gpus"][3]["uuid"]
    with channel:
        token = allocation_token(allocate(pb, stub, [good]))
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[good]), timeout=30)
        # The stamp is for that allocation only (docs/device-plugin.md).
        assert os.listdir(f"{cluster['state_dir']}/health/stamps") == [f"{good}@{token}.json"]
        simnvml.set_gpu(sim["nvml_state"], 3, ecc_volatile_uncorrected=1, reset_fails=True)
        with pytest.raises(grpc.RpcError) as caught:
            stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[bad]), timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"{bad} failed its ecc check" in caught.value.details()
        assert first_devices(pb, stub)[bad] == "Unhealthy"


def health_files(state_dir) -> list:
    found = []
    for top, _, files in os.walk(f"{state_dir}/health"):
        found += [os.path.relpath(os.path.join(top, name), state_dir) for name in files]
    return sorted(found)


@pytest.mark.parametrize("case", ["2000 made-up ids", "one made-up id", "a good id and garbage"])
def test_prestart_refuses_ids_it_never_advertised_before_any_work(quiet_cluster, case):
    pb, stub, channel = quiet_cluster["kubelet"].plugin()
    good = quiet_cluster["sim"]["gpus"][0]["uuid"]
    made_up = [f"GPU-{i:08d}-dead-beef-0000-000000000000" for i in range(2000)]
    ids = {"2000 made-up ids": made_up, "one made-up id": made_up[:1], "a good id and garbage": [good, "x"]}[case]
    before = health_files(quiet_cluster["state_dir"])
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=30)
        # What kubelet sees is the plugin's own refusal, in few words (gRPC carries the
        # details in a header of 8 KiB at most).
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert len(caught.value.details()) <= 1000
        assert caught.value.details() == {
            "2000 made-up ids": "2000 device ids: more than the 4 this plugin offers",
            "one made-up id": f"unknown device '{made_up[0]}'",
            "a good id and garbage": "unknown device 'x'"}[case]
        # No check ran: no lock, report or stamp was made, nothing was logged as prepared,
        # and the good GPU named beside garbage stays Healthy.
        assert health_files(quiet_cluster["state_dir"]) == before
        with open(quiet_cluster["log"]) as log:
            assert [r for r in map(json.loads, log) if r.get("stage") == "prepare"] == []
        assert set(first_devices(pb, stub).values()) == {"Healthy"}


@pytest.mark.parametrize("case", ["one id twice", "more ids than advertised"])
def test_allocate_refuses_a_repeated_id_or_more_ids_than_advertised(quiet_cluster, case):
    """Attacker finding P1: Allocate granted a GPU named twice, or 5 of 4 GPUs."""
    pb, stub, channel = quiet_cluster["kubelet"].plugin()
    uuids = [g["uuid"] for g in quiet_cluster["sim"]["gpus"]]
    ids = {"one id twice": [uuids[0], uuids[0]], "more ids than advertised": uuids + [uuids[0]]}[case]
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
                          timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details() == {"one id twice": "a device named twice",
                                      "more ids than advertised": "5 device ids: more than the 4 this plugin offers"}[case]


def test_a_prestart_stamp_serves_only_the_allocation_it_was_made_for(quiet_cluster, bed, probe, tmp_path):
    """kubelet's PreStartContainer names devices, not the container; a container that then
    never starts must not lend its stamp to another start on that GPU."""
    from helpers import testbed as runner

    sim, (pb, stub, channel) = quiet_cluster["sim"], quiet_cluster["kubelet"].plugin()
    gpu = sim["gpus"][1]["uuid"]
    hook_config = write_config(str(tmp_path / "hook.toml"), sim_config_values(sim, str(tmp_path / "hook.log")))
    rootfs = bed.rootfs(str(tmp_path / "rootfs"), files={"/bin/probe": probe})

    def start(name, env, mounts=()):
        bundle = bed.bundle(name, ["/bin/probe", "/dev/nvidia1"], env=env, mounts=list(mounts), rootfs=rootfs,
                            hooks={"prestart": [runner.hook_entry(hook_config)]})
        result = bed.run(bundle, name)
        assert result.returncode == 0, result.stderr
        with open(tmp_path / "hook.log") as log:
            return [r for r in map(json.loads, log) if r.get("stage") == "prestart"][-1]

    with channel:
        allocated = allocate(pb, stub, [gpu])
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[gpu]), timeout=30)
        # That container never starts. GPU 1 breaks; another container asks for it.
        simnvml.set_gpu(sim["nvml_state"], 1, ecc_volatile_uncorrected=1)
        record = start("unrelated", ["NVIDIA_VISIBLE_DEVICES=1"])
        assert not any(why.startswith("fresh stamp") for why in record["health"].get("skipped", {}).values())
        assert simnvml.load(sim["nvml_state"])["gpus"][1]["reset_count"] == 1  # checked and repaired

        # The allocation's own start, after its PreStartContainer, takes its stamp: broken
        # after the stamp, the GPU is not checked again (only a check would see it).
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[gpu]), timeout=30)
        simnvml.set_gpu(sim["nvml_state"], 1, ecc_volatile_uncorrected=1)
        mounts = [{"destination": m.container_path, "source": m.host_path, "type": "bind", "options": ["rbind", "ro"]}
                  for m in allocated.mounts]
        record = start("allocated", [f"{k}={v}" for k, v in allocated.envs.items()], mounts)
        assert record["health"]["skipped"][gpu].startswith("fresh stamp from prepare")
        assert simnvml.load(sim["nvml_state"])["gpus"][1]["reset_count"] == 1
        assert os.listdir(f"{quiet_cluster['state_dir']}/health/stamps") == []  # consumed


def test_many_watchers_never_starve_allocate_or_prestart(quiet_cluster):
    pb, stub, channel = quiet_cluster["kubelet"].plugin()
    gpu = quiet_cluster["sim"]["gpus"][2]["uuid"]
    with channel:
        streams = [stub.ListAndWatch(pb.Empty(), timeout=60) for _ in range(20)]
        for stream in streams:
            next(stream)  # each holds a server thread from now on
        # The plugin has 16 threads: without a bound on streams these calls would wait forever.
        allocate(pb, stub, [gpu])
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[gpu]), timeout=10)
        # The newest streams are the ones kept (kubelet's is always its latest).
        assert first_devices(pb, stub)[gpu] == "Healthy"
        for stream in streams:
            stream.cancel()


def test_preferred_allocation_ranks_only_advertised_devices(quiet_cluster):
    pb, stub, channel = quiet_cluster["kubelet"].plugin()
    gpus = [g["uuid"] for g in quiet_cluster["sim"]["gpus"]]
    made_up = [f"GPU-{i:08d}-dead-beef-0000-000000000000" for i in range(5000)]
    with channel:
        answer = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=made_up + [gpus[2]],
                                                   must_include_deviceIDs=made_up[:3], allocation_size=1 << 30)]),
            timeout=30)
    (choice,) = answer.container_responses
    assert list(choice.deviceIDs) == [gpus[2]]  # never a device kubelet could not allocate


def test_a_plugin_directory_others_can_write_is_refused(sim, tmp_path):
    directory = tempfile.mkdtemp(prefix="gpuhook-dp-", dir="/tmp")
    try:
        os.chmod(directory, 0o777)  # anyone could swap the plugin's socket for their own
        config = write_config(str(tmp_path / "config.toml"), sim_config_values(sim, str(tmp_path / "gpuhook.log")))
        done = subprocess.run([sys.executable, "-m", "gpuhook", "plugin", "--config", config, "--device-plugin-dir",
                               directory], cwd="/", capture_output=True, text=True, timeout=60)
        assert done.returncode == 4, done.stderr
        assert done.stderr.startswith(f"gpuhook: the device plugin directory {directory} is not a directory owned by "
                                      "root and writable only by it")
        assert os.listdir(directory) == []
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_health_daemon_that_cannot_start_is_logged_and_the_plugin_serves_on(sim, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could put their own socket there
    with running_plugin(sim, tmp_path, 3600, health={"daemon-socket": f"{shared}/health.sock"}) as state:
        def logged():
            with open(state["log"]) as log:
                return [r for r in map(json.loads, log) if r.get("decision") == "health daemon not started"]
        assert wait(logged)
        assert logged()[0]["error"] == (f"the health daemon's socket directory {shared} is not usable: not a "
                                        "directory owned by root and writable only by it")
        pb, stub, channel = state["kubelet"].plugin()
        with channel:
            assert set(first_devices(pb, stub).values()) == {"Healthy"}
        assert os.listdir(shared) == [] and state["process"].poll() is None


def test_prestart_checks_gpus_in_parallel(cluster):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    for index in range(4):
        simnvml.set_gpu(sim["nvml_state"], index, handle_latency_ms=1000)
    with channel:
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[g["uuid"] for g in sim["gpus"]]), timeout=30)
    # No wall-clock bound (a loaded CI machine could break one): the run's own report shows
    # the overlap. One after another, the whole run would last the sum of the GPUs' times.
    log = os.path.join(os.path.dirname(cluster["config"]), "gpuhook.log")
    (prepared,) = [r for r in map(json.loads, open(log)) if r.get("stage") == "prepare"]
    per_gpu = [g["seconds"] for g in prepared["health"]["gpus"]]
    assert len(per_gpu) == 4 and min(per_gpu) >= 1.0
    assert prepared["health"]["seconds"] < 0.6 * sum(per_gpu), prepared["health"]["seconds"]


def test_allocate_is_honoured_by_a_real_runc_start_granting_exactly_that_gpu(cluster, bed, probe, tmp_path):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    granted = sim["gpus"][1]["uuid"]
    with channel:
        response = stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
            devices_ids=[granted])]), timeout=10)
        preferred = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=[g["uuid"] for g in sim["gpus"]],
                                                   must_include_deviceIDs=[sim["gpus"][3]["uuid"]],
                                                   allocation_size=2)]), timeout=10)
    (container,) = response.container_responses
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
        (f"{ALLOCATION_ROOT}{allocation_token(container)}", "/dev/null", True),
        (f"/var/run/nvidia-container-devices/{granted}", "/dev/null", True)]
    (choice,) = preferred.container_responses
    # GPU 3's partner is GPU 2, on its NUMA node, not GPU 0 (first in index order).
    assert list(choice.deviceIDs) == [sim["gpus"][3]["uuid"], sim["gpus"][2]["uuid"]]

    # What kubelet and the runtime make of it: the mounts in the container's spec; the image
    # says NVIDIA_VISIBLE_DEVICES=all, as every CUDA image does.
    from helpers import testbed as runner

    mounts = [{"destination": m.container_path, "source": m.host_path, "type": "bind",
               "options": ["rbind", "ro"]} for m in container.mounts]
    env = [f"{k}={v}" for k, v in container.envs.items()] + ["NVIDIA_VISIBLE_DEVICES=all"]
    config = write_config(str(tmp_path / "hook.toml"), sim_config_values(sim, str(tmp_path / "hook.log")))
    rootfs = bed.rootfs(str(tmp_path / "rootfs"), files={"/bin/probe": probe})
    bundle = bed.bundle("allocated", ["/bin/probe", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2"], env=env,
                        mounts=mounts, hooks={"prestart": [runner.hook_entry(config)]}, rootfs=rootfs)
    result = bed.run(bundle, "allocated")
    assert result.returncode == 0, result.stderr
    probes = result.probes()
    assert {p for p, item in probes.items() if item["exists"]} == {"/dev/nvidia1"}
    assert probes["/dev/nvidia1"]["read"] == "ENXIO"


def test_allocate_and_preferred_allocation_are_logged_one_json_line_each(cluster):
    sim, (pb, stub, channel) = cluster["sim"], cluster["kubelet"].plugin()
    uuids = [g["uuid"] for g in sim["gpus"]]
    with channel:
        stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=uuids, must_include_deviceIDs=[uuids[3]],
                                                   allocation_size=2)]), timeout=10)
        stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuids[3], uuids[2]]),
                                                             pb.ContainerAllocateRequest(devices_ids=[uuids[0]])]),
                      timeout=10)
        with pytest.raises(grpc.RpcError):
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-gone"])]),
                          timeout=10)
    log = os.path.join(os.path.dirname(cluster["config"]), "gpuhook.log")
    lines = [json.loads(line) for line in open(log) if '"stage":"plugin"' in line.replace(" ", "")]
    asked = [r for r in lines if r["decision"] in ("preferred allocation", "allocate")]
    assert [r["decision"] for r in asked] == ["preferred allocation", "allocate", "allocate"]
    preferred, allocated, refused = asked
    assert preferred["containers"] == [{"available": uuids, "must_include": [uuids[3]], "size": 2,
                                        "preferred": [uuids[3], uuids[2]]}]
    assert allocated["containers"] == [{"devices": [uuids[3], uuids[2]]}, {"devices": [uuids[0]]}]
    assert allocated["gpus"] == [uuids[3], uuids[2], uuids[0]] and allocated["strategy"] == "volume-mounts"
    assert "error" not in allocated
    assert refused["containers"] == [{"devices": ["GPU-gone"]}] and refused["error"] == "unknown device GPU-gone"


def test_the_plugin_registers_again_when_kubelet_restarts(cluster):
    cluster["kubelet"].stop()  # kubelet removes every socket in the dir, the plugin's included
    cluster["kubelet"] = FakeKubelet(cluster["dir"])
    assert wait(lambda: len(cluster["kubelet"].registrations) == 1 and os.path.exists(f"{cluster['dir']}/gpuhook.sock"))
    pb, stub, channel = cluster["kubelet"].plugin()
    with channel:
        assert len(first_devices(pb, stub)) == 4


def test_a_plugin_waiting_for_kubelet_says_so_once_and_then_that_it_registered(sim, tmp_path):
    """Without kubelet's socket the plugin printed and logged nothing: one 'waiting for
    kubelet' record naming the socket, however long the wait, then one 'registered'."""
    directory = tempfile.mkdtemp(prefix="gpuhook-dp-", dir="/tmp")
    log = tmp_path / "gpuhook.log"
    config = write_config(str(tmp_path / "config.toml"), sim_config_values(sim, str(log)),
                          plugin={"recheck-seconds": 3600})
    process = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--config", config,
                                "--device-plugin-dir", directory], cwd="/", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    kubelet = None

    def records(decision):
        if not log.exists():
            return []
        return [r for r in map(json.loads, log.read_text().splitlines()) if r.get("decision") == decision]

    try:
        assert wait(lambda: records("waiting for kubelet")), "no 'waiting for kubelet' record"
        time.sleep(2)  # four more turns of the plugin's loop without kubelet
        waiting = records("waiting for kubelet")
        assert len(waiting) == 1, waiting
        assert waiting[0]["stage"] == "plugin" and waiting[0]["kubelet"] == f"{directory}/kubelet.sock"
        kubelet = FakeKubelet(directory)
        assert wait(lambda: kubelet.registrations and records("registered"))
        time.sleep(1)
        assert len(records("registered")) == 1 and len(records("waiting for kubelet")) == 1
        assert process.poll() is None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_sigterm_stops_serving_removes_the_socket_and_exits_0(cluster):
    process = cluster["process"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert not os.path.exists(f"{cluster['dir']}/gpuhook.sock")


def test_sigterm_waits_for_the_health_daemon_to_remove_its_socket(sim, tmp_path):
    shared = tmp_path / "health"
    shared.mkdir(mode=0o755)
    sock = f"{shared}/health.sock"
    with running_plugin(sim, tmp_path, 3600, health={"daemon-socket": sock}) as state:
        assert wait(lambda: os.path.exists(sock))
        state["process"].send_signal(signal.SIGTERM)
        assert state["process"].wait(timeout=15) == 0
        assert os.listdir(shared) == []
