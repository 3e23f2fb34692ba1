"""The check-and-repair engine against a simulated host of its own (it edits the NVML state).

Processes are real. A "registered container" here is what the hook's registry records: a
cgroup of its own with an init in it; its other processes are started in that cgroup by a
subreaper (as a runtime's shim is), which also reaps them once they are killed. Killing the
init makes the container gone and its remaining processes orphans.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid as uuidlib

import pytest

from gpuhook import config as cfg
from gpuhook.request import oci
from gpuhook.kernel import mountinfo
from gpuhook.errors import GpuUnhealthyError, HealthDeadlineError, HostError
from gpuhook.health import engine, hooks, owners, registry, store
from gpuhook.health.owners import Owner
from gpuhook.discover.nvml import Process
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

from conftest import REPO, require, require_root_tools

pytestmark = pytest.mark.root

MIG_GPU = 3
GIB = 1 << 30
TOKEN = "0123456789abcdef0123456789abcdef"  # a device plugin allocation's token: stamps are made for one

# A subreaper that starts one command in a cgroup and reaps everything below it until killed.
SHIM = r"""
import ctypes, os, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
procs, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
    os.execvp(argv[0], argv)
print(pid, flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.02)
"""


# A parent that leaves its child a zombie (it never waits) and says which pid that is.
ZOMBIE_MAKER = r"""
import os, sys, time
child = os.fork()
if child == 0:
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig", "unshare")
    return simhost.build(str(tmp_path_factory.mktemp("health-engine") / "host"), gpus=4, mig={MIG_GPU: []})


@pytest.fixture(scope="module")
def pristine(sim):
    return simnvml.load(sim["nvml_state"])


@pytest.fixture
def nvml_state(sim, pristine, monkeypatch):
    """The host's own state file, healthy again for each test; the library and the reset
    command both read it (a reset child gets a minimal environment, so no copy would do)."""
    monkeypatch.delenv(simnvml.ENV_VAR, raising=False)
    simnvml.save(sim["nvml_state"], pristine)
    yield sim["nvml_state"]
    assert engine.wait_for_stragglers(30), "a cut-off run never ended"


def make_config(sim, tmp_path, **health):
    d = sim["directory"]
    return cfg.from_mapping({"driver-root": f"{d}/driver", "dev-root": f"{d}/dev", "proc-root": f"{d}/proc",
                             "nvml-library": sim["nvml_library"], "state-dir": str(tmp_path / "run"),
                             "log-file": str(tmp_path / "gpuhook.log"), "health": health})


@pytest.fixture
def config(sim, tmp_path, nvml_state):
    return make_config(sim, tmp_path)


def gpu(sim, index) -> str:
    return sim["gpus"][index]["uuid"]


def gpu_state(nvml_state, index) -> dict:
    return simnvml.load(nvml_state)["gpus"][index]


def alive(pid) -> bool:
    stat = registry.read_stat(pid)
    return stat is not None and not stat.zombie


def wait_until(condition, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def cgroup_parent() -> str:
    """A directory in a mounted cgroup hierarchy where tests can make cgroups: cgroup2 if
    mounted, else the v1 pids hierarchy."""
    mounts = mountinfo.cgroup_mounts_here()
    for wanted in ("cgroup2", "pids"):
        for fstype, root, point, options in mounts:
            if fstype == wanted or (fstype == "cgroup" and wanted in options):
                return point
    require(False, "needs a mounted cgroup hierarchy (cgroup2 or v1 pids)")


class FakeContainer:
    """A registered "container": its own cgroup, an init, and processes started in it."""

    def __init__(self, name, parent=None):
        self.cgroup = f"{parent.cgroup if parent else cgroup_parent()}/gpuhook-test-{name}-{uuidlib.uuid4().hex[:8]}"
        os.mkdir(self.cgroup)
        self.id = f"{name}-{uuidlib.uuid4().hex[:12]}"
        self.shims, self.pids = [], []
        self.init = self.spawn("sleep", "600")

    def spawn(self, *argv) -> int:
        shim = subprocess.Popen([sys.executable, "-c", SHIM, f"{self.cgroup}/cgroup.procs", *argv],
                                stdout=subprocess.PIPE, text=True)
        self.shims.append(shim)
        pid = int(shim.stdout.readline())
        assert wait_until(lambda: str(pid) in open(f"{self.cgroup}/cgroup.procs").read().split())
        self.pids.append(pid)
        return pid

    def register(self, state_dir, *gpus) -> registry.Container:
        entry = registry.from_process(self.id, self.init, gpus)
        assert entry.cgroups, "the test cgroup must be the container's own"
        registry.add(state_dir, entry)
        return entry

    def stop_init(self) -> None:
        os.kill(self.init, 9)
        assert wait_until(lambda: registry.read_stat(self.init) is None)

    def close(self) -> None:
        try:
            with open(f"{self.cgroup}/cgroup.procs") as f:
                left = [int(p) for p in f.read().split()]
        except OSError:
            left = []
        for pid in left + self.pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        wait_until(lambda: not open(f"{self.cgroup}/cgroup.procs").read().strip())
        for shim in self.shims:
            shim.kill()
            shim.wait()
        os.rmdir(self.cgroup)


@pytest.fixture
def containers():
    made = []

    def make(name="ctr", parent=None):
        made.append(FakeContainer(name, parent))
        return made[-1]

    yield make
    for container in reversed(made):  # nested ones first
        container.close()


# --- healthy ------------------------------------------------------------------------------

def test_a_healthy_gpu_passes_untouched_and_is_stamped(config, sim, nvml_state):
    report = engine.prepare([gpu(sim, 0), gpu(sim, 1)], config, allocation=TOKEN)
    assert [(g.uuid, g.status, g.actions) for g in report.gpus] == \
           [(gpu(sim, 0), engine.Status.HEALTHY, ()), (gpu(sim, 1), engine.Status.HEALTHY, ())]
    assert all(gpu_state(nvml_state, i)["reset_count"] == 0 for i in range(4))
    written = store.read_report(config.state_dir, gpu(sim, 0))
    assert (written["status"], written["healthy"], written["by"], written["failure"]) == \
           ("healthy", True, "prepare", None)
    assert written["checks"] == {"reachable": "ok", "processes": "ok", "memory": "ok", "ecc": "ok",
                                 "retired-pages": "not supported", "remapped-rows": "ok"}
    assert store.claim_stamp(config.state_dir, gpu(sim, 1), 60, [TOKEN]).fresh
    assert set(report.gpus[0].steps) >= {"lock", "query", "attribute", "report"}


def test_a_mig_device_is_checked_as_its_parent_gpu(config, sim):
    mig = sim["gpus"][MIG_GPU]["mig_devices"][1]["uuid"]
    report = engine.check([mig], config)
    assert [g.uuid for g in report.gpus] == [gpu(sim, MIG_GPU)] and report.ok


def test_a_gpu_nvml_does_not_know_fails_its_reachable_check(config):
    report = engine.check(["GPU-00000000-0000-0000-0000-000000000000"], config)
    assert "reachable check: NVML nvmlDeviceGetHandleByUUID for GPU GPU-00000000" in report.gpus[0].failure()


# --- faults repaired by a reset -------------------------------------------------------------

def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("fault,check", [
    (lambda s, i: simnvml.set_gpu(s, i, ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=2), "ecc"),
    (lambda s, i: simnvml.set_gpu(s, i, compute_capability="7.0", retired_pages_double_bit=1,
                                  retired_pages_pending=True), "retired-pages"),
    (lambda s, i: simnvml.set_gpu(s, i, remapped_rows_uncorrectable=1, remapped_rows_pending=True),
     "remapped-rows"),
    (lambda s, i: simnvml.set_gpu(s, i, memory_used=6 * GIB), "memory"),
    (lambda s, i: simnvml.add_process(s, i, pid=dead_pid(), used_memory=GIB, stale=True), "processes"),
])
def test_a_fault_a_reset_clears_is_repaired_by_one_reset(config, sim, nvml_state, fault, check):
    fault(nvml_state, 1)
    report = engine.prepare([gpu(sim, 1)], config)
    (result,) = report.gpus
    assert result.status is engine.Status.REPAIRED and result.problems == ()
    assert [f.check.value for f in result.fixed] == [check]
    assert result.outcomes[engine.Check(check)] is engine.Outcome.REPAIRED
    assert [(a.action, a.ok) for a in result.actions] == [("reset", True)]
    assert gpu_state(nvml_state, 1)["reset_count"] == 1
    assert store.read_report(config.state_dir, gpu(sim, 1))["status"] == "repaired"
    assert [gpu_state(nvml_state, i)["reset_count"] for i in (0, 2, 3)] == [0, 0, 0]


def fails(config, uuids, **kwargs) -> GpuUnhealthyError:
    with pytest.raises(GpuUnhealthyError) as caught:
        engine.prepare(uuids, config, allocation=TOKEN, **kwargs)
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_reset_that_fails_fails_the_gpu_with_the_reset_output(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, 2, ecc_volatile_uncorrected=1, reset_fails=True)
    err = fails(config, [gpu(sim, 2)])
    assert err.one_line() == (f"{gpu(sim, 2)} failed its ecc check: 1 volatile uncorrectable ECC error(s) since "
                              "the last reset; reset failed: nvidia-smi exited 255: Unable to reset GPU "
                              f"{sim['gpus'][2]['bus_id'].upper().replace('0000:', '00000000:')}: Unknown Error")
    assert (err.gpu, err.check, err.evidence) == (gpu(sim, 2), "ecc",
                                                  "1 volatile uncorrectable ECC error(s) since the last reset")
    assert not store.claim_stamp(config.state_dir, gpu(sim, 2), 60, [TOKEN]).fresh
    written = store.read_report(config.state_dir, gpu(sim, 2))
    assert written["healthy"] is False and written["failure"] == err.report.gpus[0].failure()


def test_a_reset_that_does_not_fix_fails_the_gpu(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, 0, remapped_rows_pending=True, reset_does_not_fix=True)
    err = fails(config, [gpu(sim, 0)])
    assert err.one_line().endswith("remapped-rows check: row remapping pending a reset (0 uncorrectable, "
                                   "0 correctable rows remapped); still there after a reset (nvidia-smi exited 0)")
    assert gpu_state(nvml_state, 0)["reset_count"] == 1


def test_a_reset_that_hangs_is_killed_at_its_timeout(sim, tmp_path, nvml_state):
    config = make_config(sim, tmp_path, **{"reset-timeout-seconds": 1.0})
    simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=3, reset_hangs=True)
    started = time.monotonic()
    err = fails(config, [gpu(sim, 0)])
    assert time.monotonic() - started < 4
    assert err.one_line().endswith("reset failed: nvidia-smi did not finish within 1.0 s and was killed")
    smi = f"{sim['directory']}/driver/usr/bin/nvidia-smi"
    assert subprocess.run(["pgrep", "-f", smi], capture_output=True).stdout == b""


@pytest.mark.parametrize("fault,message", [
    ({"lost": True}, "reachable check: NVML reports the GPU lost (fallen off the bus) in nvmlDeviceGetHandleByUUID"),
    ({"remapped_rows_failure": True, "remapped_rows_uncorrectable": 9},
     "remapped-rows check: row remapping failed (9 uncorrectable, 0 correctable rows remapped): "
     "the GPU needs servicing"),
])
def test_a_fault_no_reset_can_fix_fails_without_a_reset(config, sim, nvml_state, fault, message):
    simnvml.set_gpu(nvml_state, 1, **fault)
    err = fails(config, [gpu(sim, 0), gpu(sim, 1)])
    assert err.one_line() == f"{gpu(sim, 1)} failed its {message}"
    assert gpu_state(nvml_state, 1)["reset_count"] == 0
    assert [g.status for g in err.report.gpus] == [engine.Status.HEALTHY, engine.Status.UNHEALTHY]
    assert store.claim_stamp(config.state_dir, gpu(sim, 0), 60, [TOKEN]).fresh  # the healthy one is stamped all the same


def test_check_without_repair_changes_nothing(config, sim, nvml_state, containers):
    container = containers("checkonly")
    container.register(config.state_dir, gpu(sim, 0))
    orphan = container.spawn("sleep", "600")
    container.stop_init()
    simnvml.add_process(nvml_state, 0, pid=orphan, used_memory=GIB)
    simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
    report = engine.check([gpu(sim, 0)], config)
    assert not report.ok and report.gpus[0].actions == ()
    assert [f.check.value for f in report.gpus[0].problems] == ["processes", "ecc"]
    assert report.gpus[0].failure().endswith("; not repaired (check only) (also failed: ecc)")  # every failed check named
    assert alive(orphan) and gpu_state(nvml_state, 0)["reset_count"] == 0


# --- processes and their owners -------------------------------------------------------------

def nvml_process(pid) -> Process:
    return Process(pid, GIB, "compute", None, None)


def test_every_kind_of_owner_is_recognised(config, sim, containers):
    live, gone = containers("live"), containers("gone")
    live_entry = live.register(config.state_dir, gpu(sim, 0))
    live_worker = live.spawn("sleep", "600")
    gone_entry = gone.register(config.state_dir, gpu(sim, 0))
    orphan = gone.spawn("sleep", "600")
    gone.stop_init()
    other = subprocess.Popen(["unshare", "--mount", "sleep", "600"])
    zombie = subprocess.Popen(["true"])
    try:
        assert wait_until(lambda: owners.namespaces(other.pid) != owners.namespaces("self")
                          and registry.read_stat(other.pid) is not None)
        assert wait_until(lambda: registry.read_stat(zombie.pid).zombie)
        attributor = owners.Attributor(registry.load_all(config.state_dir))
        found = attributor.attribute([
            nvml_process(live_worker), nvml_process(orphan), nvml_process(other.pid),
            nvml_process(os.getpid()), nvml_process(zombie.pid), nvml_process(dead_pid())])
        assert [(p.owner, p.container and p.container.id) for p in found] == [
            (Owner.CONTAINER, live_entry.id), (Owner.ORPHAN, gone_entry.id), (Owner.OTHER_CONTAINER, None),
            (Owner.HOST, None), (Owner.ZOMBIE, None), (Owner.GONE, None)]
        assert found[1].detail == f"left over from container {gone_entry.id}, whose init (pid {gone.init}) is gone"
        assert found[4].detail == f"zombie not reaped by its parent pid {os.getpid()} (host process)"
    finally:
        other.kill()
        other.wait()
        zombie.wait()


def test_the_checks_refuse_to_run_outside_the_host_pid_namespace():
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                           "from gpuhook.health import owners; print(owners.in_host_pid_namespace())"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr
    assert owners.in_host_pid_namespace()


def test_an_orphaned_process_is_killed_and_the_gpu_passes_without_a_reset(config, sim, nvml_state, containers):
    container = containers("orphan")
    entry = container.register(config.state_dir, gpu(sim, 2))
    orphan = container.spawn("sleep", "600")
    container.stop_init()
    simnvml.add_process(nvml_state, 2, pid=orphan, used_memory=3 * GIB)
    report = engine.prepare([gpu(sim, 2)], config)
    (result,) = report.gpus
    assert result.status is engine.Status.REPAIRED
    assert [(a.action, a.target, a.ok, a.detail) for a in result.actions] == [("kill", orphan, True, "killed")]
    assert result.fixed[0].evidence == (f"pid {orphan} (compute) is left over from container {entry.id}, "
                                        f"whose init (pid {container.init}) is gone")
    assert not alive(orphan) and gpu_state(nvml_state, 2)["reset_count"] == 0


def test_an_orphan_its_parent_has_not_reaped_yet_does_not_fail_the_recheck(config, sim, nvml_state, containers):
    # The orphan's parent is slow to reap (here: this test, which waits only at the end), so
    # the re-check still sees the killed process, now a zombie. It holds nothing any more.
    container = containers("slow-reaper")
    container.register(config.state_dir, gpu(sim, 2))
    orphan = subprocess.Popen(["sleep", "600"])
    try:
        with open(f"{container.cgroup}/cgroup.procs", "w") as f:
            f.write(str(orphan.pid))
        container.stop_init()
        simnvml.add_process(nvml_state, 2, pid=orphan.pid)
        (result,) = engine.prepare([gpu(sim, 2)], config).gpus
        assert registry.read_stat(orphan.pid).zombie, "the parent must not have reaped it yet"
        assert (result.status, result.problems) == (engine.Status.REPAIRED, ())
        assert [(a.action, a.target, a.ok) for a in result.actions] == [("kill", orphan.pid, True)]
        assert gpu_state(nvml_state, 2)["reset_count"] == 0
    finally:
        orphan.kill()
        orphan.wait()


def test_orphans_are_reported_not_killed_when_kill_orphans_is_off(sim, tmp_path, nvml_state, containers):
    config = make_config(sim, tmp_path, **{"kill-orphans": False})
    container = containers("keep")
    container.register(config.state_dir, gpu(sim, 2))
    orphan = container.spawn("sleep", "600")
    container.stop_init()
    simnvml.add_process(nvml_state, 2, pid=orphan)
    err = fails(config, [gpu(sim, 2)])
    assert err.one_line().endswith(f"whose init (pid {container.init}) is gone; not killed: kill-orphans is off")
    assert alive(orphan)


def test_a_zombie_a_gone_container_left_holds_nothing_and_is_not_anyones_problem(config, sim, nvml_state,
                                                                                  containers, tmp_path):
    # The driver drops a process's contexts when its files close, as its last thread exits,
    # before it is a zombie: NVML does not list a zombie, and nothing is killed for it.
    container = containers("zombie")
    container.register(config.state_dir, gpu(sim, 1))
    pidfile = tmp_path / "zombie.pid"
    parent = container.spawn(sys.executable, "-c", ZOMBIE_MAKER, str(pidfile))
    assert wait_until(lambda: pidfile.exists() and pidfile.read_text().strip())
    zombie = int(pidfile.read_text())
    assert wait_until(lambda: registry.read_stat(zombie).zombie)
    container.stop_init()
    simnvml.add_process(nvml_state, 1, pid=zombie, used_memory=GIB)
    simnvml.set_gpu(nvml_state, 1, ecc_volatile_uncorrected=1)
    (result,) = engine.prepare([gpu(sim, 1)], config).gpus
    assert (result.status, [(a.action, a.ok) for a in result.actions]) == (engine.Status.REPAIRED, [("reset", True)])
    assert registry.read_stat(zombie).zombie and alive(parent)


def test_an_exited_process_its_live_parent_has_not_reaped_does_not_fail_the_check(config, sim, nvml_state):
    zombie = subprocess.Popen(["true"])
    try:
        assert wait_until(lambda: registry.read_stat(zombie.pid).zombie)
        simnvml.add_process(nvml_state, 1, pid=zombie.pid, used_memory=GIB)
        report = engine.prepare([gpu(sim, 1)], config)
        assert report.ok and report.gpus[0].actions == () and report.gpus[0].users == ()
    finally:
        zombie.wait()


# A process whose first thread exits (a zombie leader) while a second thread keeps running.
LEADER_EXITS = r"""
import ctypes, os, sys, threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only, not the group
"""


def test_a_process_whose_first_thread_exited_is_judged_by_its_running_threads(config, sim, nvml_state, containers):
    container = containers("leader-exited")
    entry = container.register(config.state_dir, gpu(sim, 2))
    worker = container.spawn(sys.executable, "-c", LEADER_EXITS)
    assert wait_until(lambda: registry.read_stat(worker).zombie)
    simnvml.add_process(nvml_state, 2, pid=worker, used_memory=GIB)
    (found,) = owners.Attributor(registry.load_all(config.state_dir)).attribute([nvml_process(worker)])
    assert (found.owner, found.container) == (Owner.CONTAINER, entry)
    container.stop_init()
    (result,) = engine.prepare([gpu(sim, 2)], config).gpus
    assert result.status is engine.Status.REPAIRED
    assert [(a.action, a.target, a.ok) for a in result.actions] == [("kill", worker, True)]
    assert wait_until(lambda: registry.read_stat(worker) is None)


def test_an_orphan_killed_before_a_reset_is_no_user_while_its_parent_has_not_reaped_it(config, sim, nvml_state,
                                                                                         containers):
    # The orphan's parent (this test) reaps it only at the end: its zombie holds no context,
    # so the reset the ECC error needs runs right after the kill.
    container = containers("orphan-ecc")
    container.register(config.state_dir, gpu(sim, 2))
    orphan = subprocess.Popen(["sleep", "600"])
    try:
        with open(f"{container.cgroup}/cgroup.procs", "w") as f:
            f.write(str(orphan.pid))
        container.stop_init()
        simnvml.add_process(nvml_state, 2, pid=orphan.pid, used_memory=GIB)
        simnvml.set_gpu(nvml_state, 2, ecc_volatile_uncorrected=1)
        (result,) = engine.prepare([gpu(sim, 2)], config).gpus
        assert registry.read_stat(orphan.pid).zombie, "the parent must not have reaped it yet"
        assert (result.status, result.problems) == (engine.Status.REPAIRED, ())
        assert [(a.action, a.target, a.ok) for a in result.actions] == [("kill", orphan.pid, True),
                                                                         ("reset", gpu(sim, 2), True)]
        assert gpu_state(nvml_state, 2)["reset_count"] == 1
    finally:
        orphan.kill()
        orphan.wait()


# --- a GPU someone else uses ----------------------------------------------------------------

def test_a_gpu_used_by_the_host_or_another_container_is_never_reset_nor_stripped(config, sim, nvml_state,
                                                                                  containers):
    other = subprocess.Popen(["unshare", "--mount", "sleep", "600"])
    gone = containers("shared-gone")
    gone.register(config.state_dir, gpu(sim, 0))
    orphan = gone.spawn("sleep", "600")
    gone.stop_init()
    try:
        assert wait_until(lambda: owners.namespaces(other.pid) not in (None, owners.namespaces("self")))
        for pid in (os.getpid(), other.pid, orphan):
            simnvml.add_process(nvml_state, 0, pid=pid, used_memory=GIB)
        simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
        err = fails(config, [gpu(sim, 0)])
        assert err.one_line().endswith(
            f"ecc check: 1 volatile uncorrectable ECC error(s) since the last reset; not reset: the GPU is in use by "
            f"host process (pid {os.getpid()}), a container gpuhook did not start (pid {other.pid})")
        assert [(a.action, a.target) for a in err.report.gpus[0].actions] == [("kill", orphan)]
        assert other.poll() is None and gpu_state(nvml_state, 0)["reset_count"] == 0
    finally:
        other.kill()
        other.wait()


def test_a_gpu_a_live_registered_container_holds_is_not_reset_even_without_processes(config, sim, nvml_state,
                                                                                      containers):
    holder = containers("holder")
    entry = holder.register(config.state_dir, gpu(sim, 0))
    simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
    err = fails(config, [gpu(sim, 0)])
    assert err.one_line().endswith(f"not reset: the GPU is in use by container {entry.id} (init pid {holder.init})")
    assert gpu_state(nvml_state, 0)["reset_count"] == 0
    # A container that only shares its id (another runtime root) is still no owner of it.
    policy = engine.Policy(True, True, None, "needed")
    report = engine.run([gpu(sim, 0)], config, "prestart", policy, time.monotonic() + 10, container_id=entry.id,
                        container_pid=os.getpid())
    assert not report.ok and gpu_state(nvml_state, 0)["reset_count"] == 0
    # The container being started (its id and init) is not its own obstacle (a hook that runs twice).
    report = engine.run([gpu(sim, 0)], config, "prestart", policy, time.monotonic() + 10, container_id=entry.id,
                        container_pid=holder.init)
    assert report.ok and gpu_state(nvml_state, 0)["reset_count"] == 1

# --- what the driver requires of a reset ---------------------------------------------------

def test_the_drivers_reserve_is_not_leftover_memory(config, sim, nvml_state):
    # NVML's first memory call counts the driver's reserve as used (615 MiB on an idle H200);
    # a bigger reserve than leftover-memory-mib must not look like a dead container's memory.
    simnvml.set_gpu(nvml_state, 1, memory_reserved=1100 << 20)
    (result,) = engine.prepare([gpu(sim, 1)], config).gpus
    assert (result.status, result.actions) == (engine.Status.HEALTHY, ())
    assert (result.facts["memory_used_mib"], result.facts["memory_reserved_mib"]) == (0, 1100)
    simnvml.set_gpu(nvml_state, 1, memory_used=1100 << 20)  # real leftovers still count
    (result,) = engine.prepare([gpu(sim, 1)], config).gpus
    assert [f.check.value for f in result.fixed] == ["memory"] and gpu_state(nvml_state, 1)["reset_count"] == 1


def test_a_reset_waits_for_the_other_gpus_nvml_calls_and_they_go_on_after_it(config, sim, nvml_state):
    # GPU 0 needs a reset while GPU 1's thread is inside a slow NVML call on the same run's
    # NVML: the reset runs once that call returned and NVML is closed; GPU 1 is checked after.
    simnvml.set_gpu(nvml_state, 0, ecc_volatile_uncorrected=1)
    simnvml.set_gpu(nvml_state, 1, handle_latency_ms=600)
    report = engine.prepare([gpu(sim, 0), gpu(sim, 1)], config)
    assert [g.status for g in report.gpus] == [engine.Status.REPAIRED, engine.Status.HEALTHY], report.as_dict()
    assert [gpu_state(nvml_state, i)["reset_count"] for i in (0, 1)] == [1, 0]


# Another gpuhook process with an NVML session open (as a concurrent start's check has).
OTHER_SESSION = r"""
import sys, time
from gpuhook.discover import nvml
with nvml.Session(sys.argv[1], client_lock=sys.argv[2]):
    print("open", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def test_a_reset_waits_for_other_gpuhook_processes_to_close_nvml(config, sim, nvml_state):
    from gpuhook.health import actions

    simnvml.set_gpu(nvml_state, 2, ecc_volatile_uncorrected=1)
    other = subprocess.Popen([sys.executable, "-c", OTHER_SESSION, sim["nvml_library"], actions.client_lock(config),
                              "1.0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert other.stdout.readline().strip() == "open"
        started = time.monotonic()
        (result,) = engine.prepare([gpu(sim, 2)], config).gpus
        assert result.status is engine.Status.REPAIRED, result.failure()
        assert time.monotonic() - started >= 0.5  # it waited for the other session
    finally:
        other.wait(timeout=10)


def test_a_reset_that_cannot_get_nvml_closed_in_time_says_so_and_runs_nothing(sim, tmp_path, nvml_state):
    from gpuhook.health import actions

    config = make_config(sim, tmp_path, **{"deadline-seconds": 1.5})
    simnvml.set_gpu(nvml_state, 2, ecc_volatile_uncorrected=1)
    other = subprocess.Popen([sys.executable, "-c", OTHER_SESSION, sim["nvml_library"], actions.client_lock(config),
                              "5"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert other.stdout.readline().strip() == "open"
        with pytest.raises(HealthDeadlineError):
            engine.prepare([gpu(sim, 2)], config)
        assert gpu_state(nvml_state, 2)["reset_count"] == 0
    finally:
        other.kill()
        other.wait()


def test_persistence_mode_is_turned_off_for_a_reset_and_back_on_after(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, 1, persistence_mode=True, remapped_rows_pending=True)
    (result,) = engine.prepare([gpu(sim, 1)], config).gpus
    assert result.status is engine.Status.REPAIRED, result.failure()
    assert [(a.action, a.ok, a.detail) for a in result.actions] == [
        ("persistence", True, "turned off for the reset"), ("reset", True, "nvidia-smi exited 0"),
        ("persistence", True, "turned back on")]
    record = gpu_state(nvml_state, 1)
    assert (record["persistence_mode"], record["reset_count"]) == (True, 1)
    assert not os.path.exists(f"{config.state_dir}/health/persistence/{gpu(sim, 1)}.json")


def test_a_reset_command_that_cannot_run_leaves_persistence_mode_alone(sim, tmp_path, nvml_state):
    config = make_config(sim, tmp_path, **{"reset-command": "/nonexistent/nvidia-smi -r -i {uuid}"})
    simnvml.set_gpu(nvml_state, 1, persistence_mode=True, ecc_volatile_uncorrected=1)
    err = fails(config, [gpu(sim, 1)])
    assert err.one_line().endswith("reset failed: reset command not found: no executable /nonexistent/nvidia-smi "
                                   "(set health.reset-command)")
    assert [a.action for a in err.report.gpus[0].actions] == ["reset"]
    assert gpu_state(nvml_state, 1)["persistence_mode"] is True


def test_persistence_mode_is_restored_even_after_a_failed_reset(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, 1, persistence_mode=True, ecc_volatile_uncorrected=1, reset_fails=True)
    err = fails(config, [gpu(sim, 1)])
    assert [(a.action, a.ok) for a in err.report.gpus[0].actions] == [
        ("persistence", True), ("reset", False), ("persistence", True)]
    assert gpu_state(nvml_state, 1)["persistence_mode"] is True


def test_persistence_mode_a_killed_check_left_off_is_restored_by_the_next_check(sim, tmp_path, nvml_state):
    path = write_config_file(sim, tmp_path)
    simnvml.set_gpu(nvml_state, 2, persistence_mode=True, remapped_rows_pending=True, reset_latency_ms=3000)
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": path}
    first = subprocess.Popen([sys.executable, "-m", "gpuhook", "prepare", "--devices", "2"], env=env, cwd="/",
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: gpu_state(nvml_state, 2)["persistence_mode"] is False, timeout=10)
        os.killpg(first.pid, signal.SIGKILL)  # the check and its reset die half-way
    finally:
        first.wait()
    assert gpu_state(nvml_state, 2)["persistence_mode"] is False
    simnvml.set_gpu(nvml_state, 2, reset_latency_ms=0)
    config = cfg.load(path, use_cache=False)
    (result,) = engine.check([gpu(sim, 2)], config).gpus  # a check without repair changes nothing
    assert result.actions == () and gpu_state(nvml_state, 2)["persistence_mode"] is False
    (result,) = engine.prepare([gpu(sim, 2)], config).gpus
    assert result.actions[0].action == "persistence" and result.actions[0].ok
    assert result.actions[0].detail == "turned back on (left off by an interrupted reset)"
    assert gpu_state(nvml_state, 2)["persistence_mode"] is True


def test_a_gpu_the_driver_resets_only_with_its_nvlink_peers_is_not_reset(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, 0, reset_peers=[gpu(sim, 1), gpu(sim, 2)], ecc_volatile_uncorrected=1)
    err = fails(config, [gpu(sim, 0)])
    assert err.one_line().endswith(
        "ecc check: 1 volatile uncorrectable ECC error(s) since the last reset; not reset: the driver resets this "
        "GPU only together with its NVLink peers (00000000:28:00.0, 00000000:38:00.0), and gpuhook never resets "
        "other GPUs for one GPU's check")
    assert [gpu_state(nvml_state, i)["reset_count"] for i in range(4)] == [0, 0, 0, 0]


def test_a_gpu_in_mig_mode_is_never_reset(config, sim, nvml_state):
    simnvml.set_gpu(nvml_state, MIG_GPU, ecc_volatile_uncorrected=1)
    mig = sim["gpus"][MIG_GPU]["mig_devices"][0]["uuid"]
    err = fails(config, [mig])
    assert err.one_line().endswith("not reset: MIG mode is on (4 MIG device(s)); a reset may destroy the GPU and "
                                   "compute instances that MIG UUIDs name, so gpuhook does not reset a GPU in MIG mode")
    record = gpu_state(nvml_state, MIG_GPU)
    assert record["reset_count"] == 0 and len(record["mig_devices"]) == 4


@pytest.fixture(scope="module")
def sim470(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("health-470") / "host"), gpus=2, driver_version="470.82.01",
                         seed="driver-470")


def test_the_checks_and_a_repair_work_on_a_driver_without_the_newest_entry_points(sim470, tmp_path, monkeypatch,
                                                                                  containers):
    # Driver 470 has no _v3 process query (pynvml 13 calls only that one) and no v2 memory call.
    monkeypatch.delenv(simnvml.ENV_VAR, raising=False)
    config = make_config(sim470, tmp_path)
    uuid = sim470["gpus"][1]["uuid"]
    container = containers("old-driver")
    container.register(config.state_dir, uuid)
    orphan = container.spawn("sleep", "600")
    container.stop_init()
    simnvml.add_process(sim470["nvml_state"], 1, pid=orphan, used_memory=GIB)
    simnvml.set_gpu(sim470["nvml_state"], 1, ecc_volatile_uncorrected=1)
    (result,) = engine.prepare([uuid], config).gpus
    assert result.status is engine.Status.REPAIRED, result.failure()
    assert [(a.action, a.ok) for a in result.actions] == [("kill", True), ("reset", True)]
    assert result.facts["memory_reserved_mib"] is None  # the reserve is inside "used" on this driver


# --- time -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim16(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("health-16") / "host"), gpus=16, seed="sixteen")


def test_sixteen_gpus_that_take_a_second_each_take_about_a_second_together(sim16, tmp_path, monkeypatch):
    monkeypatch.delenv(simnvml.ENV_VAR, raising=False)
    for index in range(16):
        simnvml.set_gpu(sim16["nvml_state"], index, handle_latency_ms=1000)
    config = make_config(sim16, tmp_path)
    started = time.monotonic()
    report = engine.prepare([g["uuid"] for g in sim16["gpus"]], config)
    elapsed = time.monotonic() - started
    assert report.ok and len(report.gpus) == 16
    assert all(g.seconds >= 0.95 for g in report.gpus)
    assert report.serial_seconds() > 10  # what one GPU after the other would have cost
    assert elapsed < report.serial_seconds() / 3, f"parallel run took {elapsed:.1f} s"


def test_a_deadline_shorter_than_the_work_cuts_off_on_time_naming_gpu_and_step(sim, tmp_path, nvml_state):
    config = make_config(sim, tmp_path, **{"deadline-seconds": 1.0})
    simnvml.set_gpu(nvml_state, 2, handle_latency_ms=3000)
    started = time.monotonic()
    with pytest.raises(HealthDeadlineError) as caught:
        engine.prepare([gpu(sim, 0), gpu(sim, 2)], config, allocation=TOKEN)
    assert time.monotonic() - started < 2.5  # the slow GPU alone would take 3 s
    err = caught.value
    assert err.exit_code == 7 and (err.gpu, err.step) == (gpu(sim, 2), "query")
    assert re.fullmatch(rf"health checks cut off by their 1\.0 s deadline: {gpu(sim, 2)} at step query "
                        r"\(NVML health queries\) after (0\.9\d|1\.\d\d) s", err.one_line()), err.one_line()
    assert [g.status for g in err.report.gpus] == [engine.Status.HEALTHY, engine.Status.UNCHECKED]
    written = store.read_report(config.state_dir, gpu(sim, 2))
    assert written["status"] == "unchecked" and written["failure"].startswith("cut off at step query")
    assert store.claim_stamp(config.state_dir, gpu(sim, 0), 60, [TOKEN]).fresh
    assert not store.claim_stamp(config.state_dir, gpu(sim, 2), 60, [TOKEN]).fresh


def test_a_reset_still_running_at_the_deadline_is_cut_off_and_killed(sim, tmp_path, nvml_state):
    config = make_config(sim, tmp_path, **{"deadline-seconds": 1.5, "reset-timeout-seconds": 30})
    simnvml.set_gpu(nvml_state, 1, ecc_volatile_uncorrected=1, reset_hangs=True)
    started = time.monotonic()
    with pytest.raises(HealthDeadlineError) as caught:
        engine.prepare([gpu(sim, 1)], config)
    assert time.monotonic() - started < 5  # the reset would hang for good (its timeout is 30 s)
    assert caught.value.step == "reset" and "(resetting the GPU)" in caught.value.one_line()
    assert engine.wait_for_stragglers(5)
    smi = f"{sim['directory']}/driver/usr/bin/nvidia-smi"
    assert subprocess.run(["pgrep", "-f", smi], capture_output=True).stdout == b""


def test_a_lock_held_past_the_deadline_is_reported_as_such(config, sim, nvml_state):
    lock = store.GpuLock(config.state_dir, gpu(sim, 0))
    assert lock.acquire(time.monotonic() + 1)
    try:
        with pytest.raises(HealthDeadlineError, match=r"at step lock \(waiting for another check or reset"):
            engine.prepare([gpu(sim, 0)], config, deadline_seconds=0.5)
    finally:
        lock.release()


# --- concurrency ----------------------------------------------------------------------------

def prepare_processes(sim, config_path, index, count):
    env = {"PATH": "/usr/bin:/bin", "GPUHOOK_CONFIG": config_path}
    argv = [sys.executable, "-m", "gpuhook", "prepare", "--devices", str(index)]
    running = [subprocess.Popen(argv, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(count)]
    return [(p.wait(timeout=60), p.stderr.read()) for p in running]


def write_config_file(sim, tmp_path, **health) -> str:
    d = sim["directory"]
    text = (f'driver-root = "{d}/driver"\nproc-root = "{d}/proc"\ndev-root = "{d}/dev"\n'
            f'nvml-library = "{sim["nvml_library"]}"\nstate-dir = "{tmp_path}/run"\nlog-file = "{tmp_path}/log"\n'
            "[health]\n" + "".join(f"{k} = {v}\n" for k, v in health.items()))
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


def test_concurrent_prepares_of_one_gpu_never_reset_it_twice_at_once(sim, tmp_path, nvml_state):
    path = write_config_file(sim, tmp_path)
    simnvml.set_gpu(nvml_state, 1, ecc_volatile_uncorrected=1, reset_does_not_fix=True, reset_latency_ms=300)
    started = time.monotonic()
    outcomes = prepare_processes(sim, path, 1, 4)
    assert [code for code, _ in outcomes] == [6] * 4, outcomes
    record = gpu_state(nvml_state, 1)
    assert (record["reset_count"], record["reset_overlaps"]) == (4, 0), outcomes  # one after the other
    assert time.monotonic() - started >= 1.2


def test_concurrent_prepares_of_a_fixable_gpu_reset_it_once(sim, tmp_path, nvml_state):
    path = write_config_file(sim, tmp_path)
    simnvml.set_gpu(nvml_state, 2, remapped_rows_pending=True, reset_latency_ms=300)
    outcomes = prepare_processes(sim, path, 2, 4)
    assert [code for code, _ in outcomes] == [0] * 4, outcomes
    record = gpu_state(nvml_state, 2)
    assert (record["reset_count"], record["reset_overlaps"]) == (1, 0)


# --- after a stop ---------------------------------------------------------------------------

def stopped_state(container_id) -> oci.State:
    return oci.State("1.0.2", container_id, "stopped", 0, "/nonexistent", {})


def test_after_stop_kills_what_the_container_left_and_forgets_it(config, sim, nvml_state, containers):
    container = containers("stopped")
    container.register(config.state_dir, gpu(sim, 0), gpu(sim, 1))
    left = container.spawn("sleep", "600")
    container.stop_init()
    simnvml.add_process(nvml_state, 1, pid=left, used_memory=GIB)
    record = {}
    hooks.after_stop(stopped_state(container.id), config, time.monotonic() + 10, record)
    assert record["decision"] == "cleaned up"
    actions_done = [(a["action"], a["target"]) for g in record["health"]["gpus"] for a in g["actions"]]
    assert actions_done == [("kill", left)]
    assert not alive(left) and registry.load(config.state_dir, container.id) is None
    assert [gpu_state(nvml_state, i)["reset_count"] for i in (0, 1)] == [0, 0]


def test_after_stop_resets_a_released_gpu_only_when_nobody_else_uses_it(sim, tmp_path, nvml_state, containers):
    config = make_config(sim, tmp_path, **{"reset-on-release": True})
    stopped, running = containers("released"), containers("still-running")
    stopped.register(config.state_dir, gpu(sim, 0), gpu(sim, 1))
    running.register(config.state_dir, gpu(sim, 1))
    stopped.stop_init()
    record = {}
    hooks.after_stop(stopped_state(stopped.id), config, time.monotonic() + 10, record)
    assert [gpu_state(nvml_state, i)["reset_count"] for i in (0, 1)] == [1, 0]
    assert record["decision"] == "cleaned up"


def test_after_stop_with_nothing_left_and_no_reset_on_release_loads_no_nvml(sim, tmp_path, nvml_state, containers):
    # Only an enabled action needs NVML: nothing is left in the container's cgroups to kill,
    # and reset-on-release is off. (An unloadable NVML proves it is not even opened.)
    config = cfg.from_mapping({"nvml-library": "/nonexistent/libnvidia-ml.so.1", "state-dir": str(tmp_path / "run"),
                               "log-file": ""})
    container = containers("nothing-left")
    container.register(config.state_dir, gpu(sim, 0))
    container.stop_init()
    record = {}
    hooks.after_stop(stopped_state(container.id), config, time.monotonic() + 10, record)
    assert record == {"decision": "cleaned up"}
    assert registry.load(config.state_dir, container.id) is None


def test_after_stop_with_kill_orphans_off_keeps_a_container_that_left_processes(sim, tmp_path, nvml_state,
                                                                                 containers):
    config = make_config(sim, tmp_path, **{"kill-orphans": False})
    container = containers("kept")
    entry = container.register(config.state_dir, gpu(sim, 0))
    left = container.spawn("sleep", "600")
    container.stop_init()
    record = {}
    hooks.after_stop(stopped_state(container.id), config, time.monotonic() + 10, record)
    assert record == {"decision": "cleanup incomplete (container kept in the registry)",
                      "left": "1 process(es) in its cgroups; not killed: kill-orphans is off"}
    assert alive(left) and registry.load(config.state_dir, container.id) == entry


def test_after_stop_of_an_unknown_container_does_nothing(config, nvml_state):
    record = {}
    hooks.after_stop(stopped_state("never-registered"), config, time.monotonic() + 10, record)
    assert record == {"decision": "nothing to clean up (container not registered)"}


def test_after_stop_never_raises_even_without_nvml(sim, tmp_path, nvml_state, containers):
    config = cfg.from_mapping({"nvml-library": "/nonexistent/libnvidia-ml.so.1", "state-dir": str(tmp_path / "run"),
                               "log-file": "", "health": {"reset-on-release": True}})
    container = containers("no-nvml")
    container.register(config.state_dir, gpu(sim, 0))
    container.stop_init()
    record = {}
    hooks.after_stop(stopped_state(container.id), config, time.monotonic() + 10, record)
    assert record["decision"] == "cleanup failed" and "cannot load /nonexistent/libnvidia-ml.so.1" in record["error"]
    with pytest.raises(HostError):
        engine.check([gpu(sim, 0)], config)


def test_an_error_inside_a_gpu_check_reaches_the_caller_and_frees_the_lock(config, sim, monkeypatch):
    from gpuhook.health import checks

    def broken(*args):
        raise RuntimeError("a rule broke")

    monkeypatch.setattr(checks, "evaluate", broken)
    with pytest.raises(RuntimeError, match="a rule broke"):
        engine.check([gpu(sim, 0)], config)
    lock = store.GpuLock(config.state_dir, gpu(sim, 0))
    assert lock.acquire(time.monotonic() + 0.5)
    lock.release()


# --- poststop and ownership cannot be turned against live containers or the host ---------------

def test_a_poststop_naming_a_live_container_changes_nothing(sim, tmp_path, nvml_state, containers):
    config = make_config(sim, tmp_path, **{"reset-on-release": True})
    running = containers("live-target")
    entry = running.register(config.state_dir, gpu(sim, 0))
    worker = running.spawn("sleep", "600")
    simnvml.add_process(nvml_state, 0, pid=worker, used_memory=GIB)
    record = {}
    hooks.after_stop(stopped_state(running.id), config, time.monotonic() + 10, record)
    assert record["decision"].startswith("nothing cleaned: container") and "still running" in record["decision"]
    assert alive(worker) and gpu_state(nvml_state, 0)["reset_count"] == 0
    assert registry.load(config.state_dir, running.id) == entry


def test_a_reused_id_only_cleans_up_the_container_that_is_gone(sim, tmp_path, nvml_state, containers):
    """Two runtime roots, one container id: the poststop of the gone one must not drop the
    live one's entry, kill its processes or reset its GPU."""
    config = make_config(sim, tmp_path, **{"reset-on-release": True})
    gone, live = containers("same-id-a"), containers("same-id-b")
    live.id = gone.id
    gone.register(config.state_dir, gpu(sim, 0))
    live_entry = live.register(config.state_dir, gpu(sim, 1))
    worker = live.spawn("sleep", "600")
    simnvml.add_process(nvml_state, 1, pid=worker, used_memory=GIB)
    gone.stop_init()
    record = {}
    hooks.after_stop(stopped_state(gone.id), config, time.monotonic() + 10, record)
    assert record["decision"] == "cleaned up"
    assert registry.load_id(config.state_dir, gone.id) == (live_entry,)
    assert alive(worker) and gpu_state(nvml_state, 1)["reset_count"] == 0


def test_a_cgroup_that_held_other_processes_is_never_the_containers(config, sim, nvml_state, containers):
    """A container placed in a cgroup a host daemon already runs in: the daemon is not the
    container's, and its poststop must not kill it."""
    shared = containers("shared-cgroup")
    daemon = shared.spawn("sleep", "600")  # there before the container registers
    entry = registry.from_process(shared.id, shared.init, [gpu(sim, 0)])
    assert entry.cgroups == {}
    registry.add(config.state_dir, entry)
    simnvml.add_process(nvml_state, 0, pid=daemon, used_memory=GIB)
    shared.stop_init()
    record = {}
    hooks.after_stop(stopped_state(shared.id), config, time.monotonic() + 10, record)
    assert alive(daemon)


def test_in_nested_cgroups_a_live_inner_container_owns_its_processes(config, sim, nvml_state, containers):
    outer = containers("outer")
    inner = containers("inner", parent=outer)
    outer.register(config.state_dir, gpu(sim, 0))
    inner_entry = inner.register(config.state_dir, gpu(sim, 0))
    worker = inner.spawn("sleep", "600")
    outer.stop_init()
    attributor = owners.Attributor(registry.load_all(config.state_dir))
    (found,) = attributor.attribute([nvml_process(worker)])
    assert (found.owner, found.container) == (Owner.CONTAINER, inner_entry)
    simnvml.add_process(nvml_state, 0, pid=worker, used_memory=GIB)
    hooks.after_stop(stopped_state(outer.id), config, time.monotonic() + 10, {})
    assert alive(worker)
