"""The health checks in the hook, end to end: real runc containers on a simulated host of
their own (these tests break its GPUs; the runtime gives the hook a minimal environment, so
the hook and the reset command always read this host's own nvml.json)."""

import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import testbed
from gpuhook.kernel import mountinfo
from gpuhook.health import registry, store
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

from conftest import GpuContainers, assert_rootfs_clean, host_mounts, require_root_tools, run_hook_process

pytestmark = pytest.mark.root

K8S = {"io.kubernetes.pod.name": "trainer-0", "io.kubernetes.pod.namespace": "ml",
       "io.kubernetes.container.name": "main"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("health-hook") / "host"), gpus=4, seed="health-hook")


@pytest.fixture(scope="module")
def pristine(sim):
    return simnvml.load(sim["nvml_state"])


@pytest.fixture
def nvml_state(sim, pristine):
    simnvml.save(sim["nvml_state"], pristine)
    return sim["nvml_state"]


class HealthContainers(GpuContainers):
    """GpuContainers on this module's host, with detached containers and the poststop hook."""

    def __init__(self, bed, sim, probe, workdir, **health):
        self.health = health
        super().__init__(bed, sim, probe, workdir)

    def configure(self, **overrides):
        health = {**self.health, **overrides.pop("health", {})}
        return super().configure(**overrides, **({"health": health} if health else {}))

    @property
    def state_dir(self) -> str:
        return f"{self.workdir}/run"

    def with_poststop(self, spec):
        spec["hooks"]["poststop"] = [testbed.hook_entry(self.config, "poststop")]

    def start_detached(self, name, gpu_env, annotations=None, container_id=None, root=None,
                       stages=("prestart", "poststop"), edit=None) -> int:
        """`runc run -d` a container that sleeps, with gpuhook at `stages`; returns its init's
        host pid. `container_id` (default `name`, the bundle's name) and `root` (another runc
        --root than the testbed's) let two containers share an id."""
        hooks = {stage: [testbed.hook_entry(self.config, stage)] for stage in stages} or None
        bundle = self.bed.bundle(name, ["/bin/busybox", "sleep", "600"], env=[gpu_env], hooks=hooks,
                                 annotations=annotations, edit=edit)
        container_id = container_id or name
        with open(f"{self.workdir}/{name}.runc.log", "w") as log:
            done = subprocess.run([self.bed.runc, "--root", root or self.bed.state_root, "run", "-d", "--bundle",
                                   bundle, container_id],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60, cwd="/")
        assert done.returncode == 0, open(f"{self.workdir}/{name}.runc.log").read()
        return self.runc_state(container_id, root)["pid"]

    def runc_state(self, name, root=None) -> dict:
        done = subprocess.run([self.bed.runc, "--root", root or self.bed.state_root, "state", name],
                              capture_output=True, text=True, timeout=30)
        return json.loads(done.stdout)

    def kill(self, name, root=None) -> None:
        """Kill the container's init and wait until runc says it stopped."""
        subprocess.run([self.bed.runc, "--root", root or self.bed.state_root, "kill", name, "KILL"],
                       capture_output=True, timeout=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and self.runc_state(name, root).get("status") != "stopped":
            time.sleep(0.05)

    def stop(self, name, root=None) -> subprocess.CompletedProcess:
        self.kill(name, root)
        return subprocess.run([self.bed.runc, "--root", root or self.bed.state_root, "delete", name],
                              capture_output=True, text=True, timeout=60)

    def records(self, stage) -> list:
        return [line for line in self.log_lines() if line.get("stage") == stage]


@pytest.fixture
def hgpus(bed, sim, probe, tmp_path, nvml_state):
    made = HealthContainers(bed, sim, probe, tmp_path)
    yield made
    for name in os.listdir(f"{bed.workdir}/bundles") if os.path.isdir(f"{bed.workdir}/bundles") else ():
        bed.delete(name)


def gpu_record(nvml_state, index) -> dict:
    return simnvml.load(nvml_state)["gpus"][index]


def gpu_nodes(probes) -> set:
    return {p for p, item in probes.items() if p.startswith("/dev/nvidia") and p[11:].isdigit() and item["exists"]}


def hook_message(result) -> str:
    """The one line gpuhook printed, as runc passes it on (quoted inside its own error line)."""
    (line,) = [line for line in result.stderr.splitlines() if "gpuhook:" in line]
    message = line.split("gpuhook: ", 1)[1]
    assert message.count("\\n") <= 1  # runc quotes our single newline
    return message.split("\\n")[0]


# --- prestart ------------------------------------------------------------------------------

def test_a_healthy_gpu_starts_untouched_and_the_container_is_registered(hgpus, nvml_state):
    result = hgpus.run("healthy", env=["NVIDIA_VISIBLE_DEVICES=0"], annotations=K8S)
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia0"}
    (line,) = hgpus.records("prestart")
    assert (line["decision"], line["pod"], line["namespace"], line["container_name"]) == \
           ("gpus injected", "trainer-0", "ml", "main")
    health = line["health"]
    assert health["mode"] == "fallback" and health["ok"] is True
    (checked,) = health["gpus"]
    assert (checked["uuid"], checked["status"], checked["actions"]) == (hgpus.uuid(0), "healthy", [])
    assert set(checked["steps"]) >= {"lock", "query", "attribute"}
    assert isinstance(line["registered"], dict) and line["registered"]["cgroups"]
    (entry,) = registry.load_id(hgpus.state_dir, "healthy")  # poststop names the pod from it
    assert entry.names == {"pod": "trainer-0", "namespace": "ml", "container_name": "main"}
    assert line["nvml"] == "loaded (1 init)"  # the checks loaded NVML: the log says so
    assert gpu_record(nvml_state, 0)["reset_count"] == 0
    assert store.read_report(hgpus.state_dir, hgpus.uuid(0))["status"] == "healthy"


def test_a_gpu_with_a_fault_a_reset_fixes_is_reset_before_the_container_gets_it(hgpus, nvml_state):
    simnvml.set_gpu(nvml_state, 1, ecc_volatile_uncorrected=4)
    result = hgpus.run("repaired", env=["NVIDIA_VISIBLE_DEVICES=1"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia1"}
    record = gpu_record(nvml_state, 1)
    assert (record["reset_count"], record["ecc_volatile_uncorrected"]) == (1, 0)
    (checked,) = hgpus.records("prestart")[0]["health"]["gpus"]
    assert checked["status"] == "repaired" and checked["checks"]["ecc"] == "repaired"
    assert [(a["action"], a["ok"]) for a in checked["actions"]] == [("reset", True)]


def test_an_unrepairable_gpu_fails_the_start_with_one_line(hgpus, nvml_state):
    """The check runs while the rest of the start is applied (gpuhook.apply.run): its failure
    undoes that too, so nothing of the start is left."""
    simnvml.set_gpu(nvml_state, 2, remapped_rows_failure=True, remapped_rows_uncorrectable=3)
    before = host_mounts()
    result = hgpus.run("broken", env=["NVIDIA_VISIBLE_DEVICES=2"])
    assert result.returncode != 0
    assert host_mounts() == before
    assert_rootfs_clean(result.rootfs)
    assert hook_message(result) == (f"{hgpus.uuid(2)} failed its remapped-rows check: row remapping failed "
                         "(3 uncorrectable, 0 correctable rows remapped): the GPU needs servicing")
    assert result.probes() == {}  # the container's process never ran
    (record,) = hgpus.records("prestart")
    assert record["decision"] == "failed" and record["health"]["gpus"][0]["status"] == "unhealthy"
    assert store.read_report(hgpus.state_dir, hgpus.uuid(2))["healthy"] is False
    assert registry.load_all(hgpus.state_dir) == ()


def test_a_start_that_fails_after_the_check_leaves_no_registry_entry(hgpus, nvml_state):
    """The container is registered while the worker works; when the worker then fails (here
    a mount makes /dev/nvidia0 a directory), the entry is taken back with the rest."""
    def dir_at_node(spec):
        spec["mounts"].append({"destination": "/dev/nvidia0", "type": "tmpfs", "source": "tmpfs"})

    result = hgpus.run("late-failure", env=["NVIDIA_VISIBLE_DEVICES=0"], edit=dir_at_node)
    assert result.returncode != 0 and "exists and is a directory" in hook_message(result)
    (line,) = hgpus.records("prestart")
    assert line["health"]["ok"] is True and line["registered"] == "not registered: the start failed"
    assert registry.load_all(hgpus.state_dir) == ()


def test_warn_mode_starts_the_container_and_logs_the_failure(hgpus, nvml_state):
    hgpus.configure(health={"on-failure": "warn"})
    simnvml.set_gpu(nvml_state, 2, lost=True)
    result = hgpus.run("warned", env=["NVIDIA_VISIBLE_DEVICES=2"])
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia2"}
    (record,) = hgpus.records("prestart")
    assert record["health"]["warning"].endswith("failed its reachable check: NVML reports the GPU lost (fallen off "
                                                "the bus) in nvmlDeviceGetHandleByUUID")


def test_a_health_deadline_fails_the_start_naming_the_gpu_and_the_step(hgpus, nvml_state):
    hgpus.configure(health={"deadline-seconds": 1.0})
    simnvml.set_gpu(nvml_state, 3, handle_latency_ms=5000)
    started = time.monotonic()
    result = hgpus.run("slow", env=["NVIDIA_VISIBLE_DEVICES=3"])
    assert time.monotonic() - started < 4.5
    assert f"health checks cut off by their 1.0 s deadline: {hgpus.uuid(3)} at step query (NVML health queries)" in hook_message(result)


def test_a_health_step_cut_off_by_the_hooks_own_deadline_still_undoes_the_start(hgpus, nvml_state):
    """The health step runs while the rest of the start is applied; when it is the hook's
    deadline (not the health step's own) that cuts it off, there must still be time to undo
    the rest (gpuhook.apply.run.CLEANUP_MARGIN)."""
    hgpus.configure(**{"deadline-seconds": 3}, health={"deadline-seconds": 30.0})
    simnvml.set_gpu(nvml_state, 3, handle_latency_ms=8000)
    before = host_mounts()
    started = time.monotonic()
    result = hgpus.run("slow-hook", env=["NVIDIA_VISIBLE_DEVICES=3"])
    assert time.monotonic() - started < 6
    assert result.returncode != 0
    assert f"{hgpus.uuid(3)} at step query" in hook_message(result)
    assert host_mounts() == before
    assert_rootfs_clean(result.rootfs)


@pytest.fixture(scope="module")
def mig_sim(tmp_path_factory):
    """A host of its own with GPU 1 in MIG mode: the planner asks NVML on MIG hosts, which
    would change what the other tests here measure."""
    require_root_tools("gcc", "ldconfig", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("health-hook-mig") / "host"), gpus=2, mig={1: []},
                         seed="health-hook-mig")


def test_a_mig_device_request_checks_its_parent_gpu_and_never_resets_it(bed, mig_sim, probe, tmp_path):
    state = mig_sim["nvml_state"]
    containers = HealthContainers(bed, mig_sim, probe, tmp_path)
    device = mig_sim["gpus"][1]["mig_devices"][0]
    result = containers.run("mig", env=[f"NVIDIA_VISIBLE_DEVICES={device['uuid']}"])
    assert result.returncode == 0, result.stderr
    (record,) = containers.records("prestart")
    assert [(g["uuid"], g["status"]) for g in record["health"]["gpus"]] == [(containers.uuid(1), "healthy")]
    assert registry.load(containers.state_dir, "mig").gpus == (containers.uuid(1),)
    # A reset could destroy the instances the MIG UUIDs of this and other containers name:
    # a fault only a reset clears fails the start instead.
    simnvml.set_gpu(state, 1, ecc_volatile_uncorrected=1)
    result = containers.run("mig-faulty", env=[f"NVIDIA_VISIBLE_DEVICES={device['uuid']}"])
    assert result.returncode != 0
    assert hook_message(result) == (
        f"{containers.uuid(1)} failed its ecc check: 1 volatile uncorrectable ECC error(s) since the last reset; "
        f"not reset: MIG mode is on ({len(simhost.DEFAULT_MIG_LAYOUT)} MIG device(s)); a reset may destroy the GPU "
        "and compute instances that MIG UUIDs name, so gpuhook does not reset a GPU in MIG mode")
    after = gpu_record(state, 1)
    assert after["reset_count"] == 0 and len(after["mig_devices"]) == len(simhost.DEFAULT_MIG_LAYOUT)


@pytest.fixture(scope="module")
def sim470(tmp_path_factory):
    """Driver 470: NVML without the _v3 process query (all pynvml 13 calls) or the v2 memory call."""
    require_root_tools("gcc", "ldconfig", "runc")
    return simhost.build(str(tmp_path_factory.mktemp("health-hook-470") / "host"), gpus=1,
                         driver_version="470.82.01", seed="health-hook-470")


def test_a_start_on_a_driver_before_510_passes_its_checks(bed, sim470, probe, tmp_path):
    containers = HealthContainers(bed, sim470, probe, tmp_path)
    result = containers.run("driver-470", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    (record,) = containers.records("prestart")
    (checked,) = record["health"]["gpus"]
    assert (checked["status"], checked["checks"]["processes"]) == ("healthy", "ok")


# --- stamps from `gpuhook prepare` ---------------------------------------------------------

TOKEN = "0123456789abcdef0123456789abcdef"  # the device plugin's allocation token (docs/device-plugin.md)
ALLOCATED = [{"destination": f"/var/run/gpuhook-allocation/{TOKEN}", "source": "/dev/null", "type": "bind",
              "options": ["rbind", "ro"]}]


def prepare(hgpus, index, allocation=TOKEN):
    done = subprocess.run([sys.executable, "-m", "gpuhook", "prepare", "--config", hgpus.config, "--devices",
                           str(index), "--allocation", allocation], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr


def test_a_fresh_stamp_makes_the_hook_skip_the_gpu_once(hgpus, nvml_state):
    prepare(hgpus, 0)
    # Broken after prepare: only a check that runs would notice.
    simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
    result = hgpus.run("stamped", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=ALLOCATED)
    assert result.returncode == 0, result.stderr
    health = hgpus.records("prestart")[0]["health"]
    assert health["skipped"][hgpus.uuid(0)].startswith("fresh stamp from prepare") and "gpus" not in health
    assert gpu_record(nvml_state, 0)["reset_count"] == 0
    assert os.listdir(f"{hgpus.state_dir}/health/stamps") == []  # consumed
    result = hgpus.run("stamped-again", env=["NVIDIA_VISIBLE_DEVICES=0"], mounts=ALLOCATED)
    assert result.returncode == 0, result.stderr
    assert gpu_record(nvml_state, 0)["reset_count"] == 1  # no stamp left: the hook did the work


@pytest.mark.parametrize("case", ["no token", "another token", "a token in a tmpfs", "a token from the image"])
def test_a_stamp_serves_only_the_start_carrying_its_allocation(hgpus, nvml_state, case):
    prepare(hgpus, 2)
    simnvml.set_gpu(nvml_state, 2, ecc_volatile_uncorrected=1)
    mounts, setup = {
        "no token": ([], None),
        "another token": ([{**ALLOCATED[0], "destination": "/var/run/gpuhook-allocation/" + "f" * 32}], None),
        # Only a bind of /dev/null is a token: an image or a pod cannot make the runtime add one.
        "a token in a tmpfs": ([{"destination": ALLOCATED[0]["destination"], "source": "tmpfs", "type": "tmpfs",
                                 "options": ["ro"]}], None),
        "a token from the image": ([], lambda rootfs: (os.makedirs(f"{rootfs}/var/run/gpuhook-allocation"),
                                                       open(f"{rootfs}/var/run/gpuhook-allocation/{TOKEN}", "w").close())),
    }[case]
    result = hgpus.run(f"token-{case.replace(' ', '-')}", env=["NVIDIA_VISIBLE_DEVICES=2"], mounts=mounts,
                       rootfs_setup=setup)
    assert result.returncode == 0, result.stderr
    health = hgpus.records("prestart")[0]["health"]
    assert "skipped" not in health and health["gpus"][0]["status"] == "repaired"
    assert gpu_record(nvml_state, 2)["reset_count"] == 1
    assert os.listdir(f"{hgpus.state_dir}/health/stamps") == [f"{hgpus.uuid(2)}@{TOKEN}.json"]  # still its own


@pytest.mark.parametrize("case", ["stale", "missing", "always"])
def test_a_stale_or_missing_stamp_or_mode_always_does_the_work(hgpus, nvml_state, case):
    hgpus.configure(health={"stamp-ttl-seconds": 0.5, "mode": "always" if case == "always" else "fallback"})
    if case != "missing":
        prepare(hgpus, 1)
    if case == "stale":
        time.sleep(0.6)
    simnvml.set_gpu(nvml_state, 1, ecc_volatile_uncorrected=1)
    result = hgpus.run(f"stamp-{case}", env=["NVIDIA_VISIBLE_DEVICES=1"], mounts=ALLOCATED)
    assert result.returncode == 0, result.stderr
    assert gpu_record(nvml_state, 1)["reset_count"] == 1
    health = hgpus.records("prestart")[0]["health"]
    assert "skipped" not in health and health["gpus"][0]["status"] == "repaired"
    if case == "stale":
        assert health["stamps"][hgpus.uuid(1)].startswith("stamp 0.")


# --- sharing, concurrency ------------------------------------------------------------------

def test_a_gpu_shared_with_a_live_container_is_neither_reset_nor_stripped(hgpus, nvml_state):
    holder = hgpus.start_detached("holder", "NVIDIA_VISIBLE_DEVICES=0")
    try:
        simnvml.add_process(nvml_state, 0, pid=holder, used_memory=2 << 30)
        simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
        result = hgpus.run("second", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert hook_message(result).endswith(f"ecc check: 1 volatile uncorrectable ECC error(s) since the last reset; not reset: "
                             f"the GPU is in use by container holder (pid {holder})")
        assert gpu_record(nvml_state, 0)["reset_count"] == 0
        simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=0)
        result = hgpus.run("third", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert result.returncode == 0, result.stderr
        checked = hgpus.records("prestart")[-1]["health"]["gpus"][0]
        assert checked["status"] == "healthy" and checked["users"] == [f"container holder (pid {holder})"]
        assert hgpus.runc_state("holder")["status"] == "running"
        assert [p["pid"] for p in gpu_record(nvml_state, 0)["compute_processes"]] == [holder]
        assert gpu_record(nvml_state, 0)["reset_count"] == 0
    finally:
        hgpus.stop("holder")


def test_concurrent_starts_on_one_gpu_never_run_two_resets_at_once(hgpus, nvml_state):
    simnvml.set_gpu(nvml_state, 3, remapped_rows_pending=True, reset_latency_ms=300)

    def start(i):
        return hgpus.run(f"concurrent{i}", env=["NVIDIA_VISIBLE_DEVICES=3"])

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(start, range(4), timeout=300))
    assert [r.returncode for r in results] == [0] * 4, [r.stderr for r in results]
    record = gpu_record(nvml_state, 3)
    assert (record["reset_count"], record["reset_overlaps"]) == (1, 0)


# --- poststop ------------------------------------------------------------------------------

def container_cgroups(cgroups: dict) -> list:
    """The directories of a registered container's cgroups on this host."""
    return registry.cgroup_directories(cgroups, mountinfo.cgroup_mounts_here())


def join_cgroups(pid, cgroups: dict, child: str = "") -> list:
    """Put `pid` into a container's cgroups (or, with `child`, into a cgroup of that name made
    below each of them); returns the directories it went into."""
    found = []
    for directory in container_cgroups(cgroups):
        if child:
            parent, directory = directory, f"{directory}/{child}"
            os.makedirs(directory, exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):  # a new v1 cpuset takes no process until set
                if os.path.exists(f"{directory}/{name}"):
                    with open(f"{parent}/{name}") as src, open(f"{directory}/{name}", "w") as dst:
                        dst.write(src.read())
        with open(f"{directory}/cgroup.procs", "w") as f:
            f.write(str(pid))
        found.append(directory)
    return found


def remove_cgroups(cgroups: dict) -> None:
    for directory in container_cgroups(cgroups):
        try:
            os.rmdir(directory)
        except OSError:
            pass  # already gone, or runc removed it


def children(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def wait_for(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


class PodNamespace:
    """A pid namespace that outlives a container in it, as a Kubernetes pod's does with
    shareProcessNamespace: its init is a `sleep` that unshare forked."""

    def __init__(self):
        self.holder = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "600"], stdin=subprocess.DEVNULL)
        wait_for(lambda: children(self.holder.pid))
        (self.init,) = children(self.holder.pid)
        self.spawned = []

    def join(self, spec) -> None:
        """A spec edit: the container joins this pid namespace."""
        spec["linux"]["namespaces"] = [ns for ns in spec["linux"]["namespaces"] if ns["type"] != "pid"]
        spec["linux"]["namespaces"].append({"type": "pid", "path": f"/proc/{self.init}/ns/pid"})

    def spawn(self, *argv) -> int:
        """Start `argv` inside the namespace; returns its host pid."""
        entered = subprocess.Popen(["nsenter", f"--target={self.init}", "--pid", "--", *argv], stdin=subprocess.DEVNULL)
        self.spawned.append(entered)
        wait_for(lambda: children(entered.pid))
        return children(entered.pid)[0]

    def close(self) -> None:
        for process in self.spawned + [self.holder]:
            process.kill()
            process.wait()


def hook_state(hgpus, name: str, pid: int) -> bytes:
    """The OCI state runc hands poststop hooks, for running the hook as a runtime would."""
    bundle = f"{hgpus.bed.workdir}/bundles/{name}"
    return json.dumps({"ociVersion": "1.0.2", "id": name, "status": "stopped", "pid": pid, "bundle": bundle,
                       "annotations": K8S}).encode()


@pytest.mark.parametrize("reset_on_release", [False, True])
def test_poststop_kills_what_the_container_left_in_its_cgroup_and_pid_namespace(hgpus, nvml_state, reset_on_release):
    """A container in a pod's pid namespace leaves a process behind in its cgroup; the kernel
    does not end it with the container's init (the namespace lives on). A runtime that runs
    poststop without killing the cgroup first (the OCI runtime spec does not ask it to) has
    gpuhook kill it, and reset the GPU with reset-on-release."""
    require_root_tools("unshare", "nsenter")
    hgpus.configure(health={"reset-on-release": reset_on_release})
    pod = PodNamespace()
    try:
        init = hgpus.start_detached("leaver", "NVIDIA_VISIBLE_DEVICES=1", annotations=K8S, edit=pod.join)
        entry = registry.load(hgpus.state_dir, "leaver")
        assert entry is not None and entry.pid == init and entry.gpus == (hgpus.uuid(1),)
        assert entry.pid_ns == registry.pid_namespace(pod.init) and entry.ns_init[0] == pod.init
        left = pod.spawn("sleep", "600")
        join_cgroups(left, entry.cgroups)
        simnvml.add_process(nvml_state, 1, pid=left, used_memory=1 << 30)
        hgpus.kill("leaver")
        done = run_hook_process(["poststop", "--config", hgpus.config], hook_state(hgpus, "leaver", init))
        assert (done.returncode, done.stderr) == (0, b"")
        assert registry.read_stat(left) is None
        (record,) = hgpus.records("poststop")
        assert (record["container"], record["decision"], record["pod"]) == ("leaver", "cleaned up", "trainer-0")
        (gpu,) = record["health"]["gpus"]
        expected = [("kill", left, True)] + ([("reset", hgpus.uuid(1), True)] if reset_on_release else [])
        assert [(a["action"], a["target"], a["ok"]) for a in gpu["actions"]] == expected
        assert gpu_record(nvml_state, 1)["reset_count"] == (1 if reset_on_release else 0)
        assert registry.load(hgpus.state_dir, "leaver") is None
    finally:
        hgpus.stop("leaver")
        pod.close()


def cgroups_path(name: str):
    """A spec edit: runc's cgroupfs driver puts the container at /gpuhook-test-<name>-<pid>."""
    def edit(spec):
        spec["linux"]["cgroupsPath"] = f"/gpuhook-test-{name}-{os.getpid()}"
    return edit


def test_poststop_never_kills_a_container_that_joined_its_cgroup(hgpus, nvml_state):
    """B, started without gpuhook, joins GPU container A's cgroupsPath after A registered and
    uses GPU 0. B's processes are in A's cgroup, not in A's pid namespace: A's poststop
    leaves them alone, and the GPU they use is not reset."""
    hgpus.configure(health={"reset-on-release": True})
    a = hgpus.start_detached("joined-a", "NVIDIA_VISIBLE_DEVICES=0", edit=cgroups_path("joined"))
    entry = registry.load(hgpus.state_dir, "joined-a")
    b = hgpus.start_detached("joined-b", "NVIDIA_VISIBLE_DEVICES=void", stages=(), edit=cgroups_path("joined"))
    try:
        assert container_cgroups(registry.read_cgroups(b)) == container_cgroups(entry.cgroups)
        simnvml.add_process(nvml_state, 0, pid=b, used_memory=1 << 30)
        hgpus.stop("joined-a")
        assert hgpus.runc_state("joined-b")["status"] == "running"
        (record,) = hgpus.records("poststop")
        (gpu,) = record["health"]["gpus"]
        assert gpu["actions"] == [] and gpu_record(nvml_state, 0)["reset_count"] == 0
        assert gpu["users"] == [f"a container gpuhook did not start (pid {b})"]
        assert a != b
    finally:
        hgpus.bed.delete("joined-b")
        remove_cgroups(entry.cgroups)


def test_poststop_never_kills_a_host_daemon_in_a_child_cgroup(hgpus, nvml_state):
    """A host daemon placed below GPU container A's cgroup after A registered is no process of
    A's: A's poststop does not kill it. (With reset-on-release the stop looks at every
    process on A's GPUs; without it, it looks only in A's own cgroups.)"""
    hgpus.configure(health={"reset-on-release": True})
    hgpus.start_detached("parent-a", "NVIDIA_VISIBLE_DEVICES=0")
    entry = registry.load(hgpus.state_dir, "parent-a")
    daemon = subprocess.Popen(["sleep", "600"])
    made = []
    try:
        made = join_cgroups(daemon.pid, entry.cgroups, child="host-daemon")
        simnvml.add_process(nvml_state, 0, pid=daemon.pid, used_memory=1 << 30)
        hgpus.stop("parent-a")
        assert daemon.poll() is None
        (record,) = hgpus.records("poststop")
        (gpu,) = record["health"]["gpus"]
        assert gpu["actions"] == [] and gpu["users"] == [f"host process (pid {daemon.pid})"]
    finally:
        daemon.kill()
        daemon.wait()
        for directory in made:
            wait_for(lambda d=directory: not open(f"{d}/cgroup.procs").read().strip())
            os.rmdir(directory)
        remove_cgroups(entry.cgroups)


def test_a_stale_entry_never_makes_a_container_that_reuses_its_cgroup_path_a_leftover(hgpus, nvml_state):
    """A registered without a poststop hook leaves a stale entry. B, started without gpuhook,
    later gets A's cgroupsPath (the cgroup made again) and uses GPU 0; the next GPU start
    on GPU 0 must not kill B as A's leftover."""
    hgpus.start_detached("stale-a", "NVIDIA_VISIBLE_DEVICES=0", stages=("prestart",), edit=cgroups_path("stale"))
    entry = registry.load(hgpus.state_dir, "stale-a")
    hgpus.stop("stale-a")  # no poststop: the entry stays
    assert registry.load(hgpus.state_dir, "stale-a") == entry
    b = hgpus.start_detached("stale-b", "NVIDIA_VISIBLE_DEVICES=void", stages=(), edit=cgroups_path("stale"))
    try:
        assert registry.read_cgroups(b)["pids"] == entry.cgroups["pids"]  # the same path, a new cgroup
        simnvml.add_process(nvml_state, 0, pid=b, used_memory=1 << 30)
        result = hgpus.run("stale-next", env=["NVIDIA_VISIBLE_DEVICES=0"])
        assert result.returncode == 0, result.stderr
        assert hgpus.runc_state("stale-b")["status"] == "running"
        (gpu,) = hgpus.records("prestart")[-1]["health"]["gpus"]
        assert gpu["actions"] == [] and gpu["users"] == [f"a container gpuhook did not start (pid {b})"]
    finally:
        hgpus.bed.delete("stale-b")


def test_poststop_of_a_same_id_container_under_another_root_never_resets_the_live_ones_gpu(hgpus, nvml_state,
                                                                                           tmp_path):
    """Two runc roots, one container id "dup" in each, both on GPU 0. The one under the
    second root stops: with reset-on-release its poststop must not reset GPU 0 while the
    other "dup" is alive (registry entries are told apart by init pid and start time)."""
    hgpus.configure(health={"reset-on-release": True})
    other_root = str(tmp_path / "other-runc-root")
    victim = hgpus.start_detached("dup-victim", "NVIDIA_VISIBLE_DEVICES=0", container_id="dup")
    try:
        attacker = hgpus.start_detached("dup-attacker", "NVIDIA_VISIBLE_DEVICES=0", container_id="dup",
                                        root=other_root)
        assert {e.pid for e in registry.load_id(hgpus.state_dir, "dup")} == {victim, attacker}
        hgpus.stop("dup", root=other_root)
        (record,) = hgpus.records("poststop")
        (gpu,) = record["health"]["gpus"]
        assert gpu["actions"] == [] and gpu_record(nvml_state, 0)["reset_count"] == 0
        assert gpu["users"] == [f"container dup (init pid {victim})"]
        assert hgpus.runc_state("dup")["status"] == "running"
    finally:
        subprocess.run([hgpus.bed.runc, "--root", other_root, "delete", "--force", "dup"], capture_output=True,
                       timeout=30)
        hgpus.stop("dup")


def test_poststop_loads_no_nvml_when_no_enabled_action_needs_it(hgpus, nvml_state):
    hgpus.start_detached("quiet-stop", "NVIDIA_VISIBLE_DEVICES=2")
    done = hgpus.stop("quiet-stop")
    assert done.returncode == 0, done.stderr
    (record,) = hgpus.records("poststop")
    assert (record["decision"], record["nvml"]) == ("cleaned up", "not loaded")
    assert "health" not in record and registry.load(hgpus.state_dir, "quiet-stop") is None


def test_poststop_never_fails_a_stop(hgpus, nvml_state):
    hgpus.start_detached("nvml-gone", "NVIDIA_VISIBLE_DEVICES=2")
    hgpus.configure(**{"nvml-library": "/nonexistent/libnvidia-ml.so.1"}, health={"reset-on-release": True})
    done = hgpus.stop("nvml-gone")
    assert done.returncode == 0, done.stderr
    (record,) = hgpus.records("poststop")
    assert record["decision"] == "cleanup failed" and "cannot load /nonexistent" in record["error"]


@pytest.mark.parametrize("state,decision", [
    (b'{"id": "x", "bundle": ', "failed"),
    (b'{"id": "never-started", "bundle": "/nonexistent", "status": "stopped"}',
     "nothing to clean up (container not registered)"),
])
def test_poststop_of_a_broken_or_unknown_state_exits_0_and_logs_why(hgpus, state, decision):
    done = run_hook_process(["poststop", "--config", hgpus.config], state)
    assert (done.returncode, done.stderr) == (0, b"")
    assert hgpus.records("poststop")[0]["decision"] == decision


# --- what mode off costs -------------------------------------------------------------------

def imported(hgpus, name: str, tmp_path) -> set:
    """The modules the hook process loaded for a real GPU start (python -X importtime, its
    stderr kept in a file). The health step runs only once the start is under way in a real
    container (gpuhook.apply.run), so nothing less than a container shows it."""
    errors = tmp_path / f"{name}.importtime"
    entry = testbed.hook_entry(hgpus.config, "prestart")
    python, flags, rest = entry["args"][0], entry["args"][1:3], entry["args"][3:]
    command = " ".join(shlex.quote(a) for a in [python, "-X", "importtime", *flags, *rest])
    entry.update(path="/bin/sh", args=["sh", "-c", f"exec {command} 2>{shlex.quote(str(errors))}"])

    def importtime_hook(spec):
        spec["hooks"]["prestart"] = [entry]

    result = hgpus.run(name, env=["NVIDIA_VISIBLE_DEVICES=0"], edit=importtime_hook)
    assert result.returncode == 0, result.stderr
    return {line.rsplit("|", 1)[1].strip() for line in errors.read_text().splitlines()
            if line.startswith("import time:") and "|" in line}


def test_mode_off_loads_no_nvml_no_threads_and_no_health_code(hgpus, tmp_path):
    hgpus.configure(health={"mode": "off"})
    off = imported(hgpus, "imports-off", tmp_path)
    assert "gpuhook.apply.run" in off  # it went all the way
    assert not off & {"pynvml", "psutil", "threading", "gpuhook.discover.nvml"}
    assert not {m for m in off if m.startswith("gpuhook.health")}
    hgpus.configure(health={"mode": "always"})
    on = imported(hgpus, "imports-on", tmp_path)
    assert {"pynvml", "threading", "gpuhook.health.engine"} <= on  # the converse: the checks did run
