"""cgroup v1 grants do not outlive their container (gpuhook.apply.grants, docs/security.md).

Two real runc containers share one devices cgroup (one cgroupsPath). B has no GPU. A gets
GPU 0 from gpuhook, which writes its rule into the shared cgroup, so B could open GPU 0 too
(it makes the node itself: runc allows mknod). When A is deleted, runc cannot remove the
cgroup (B is in it), and gpuhook's poststop must take the rule back: B then gets EPERM.
"""

import json
import os
import subprocess
import time

import pytest

from helpers import testbed
from gpuhook.apply.cgroup import hierarchy

from conftest import GpuContainers, fake_ldconfig, require_root_tools, run_hook_process

pytestmark = pytest.mark.root

V1_DEVICES = "/sys/fs/cgroup/devices"


class SharedCgroup(GpuContainers):
    """Detached containers that all live in one cgroup path, with prestart and poststop hooks."""

    def __init__(self, bed, sim, probe, workdir):
        super().__init__(bed, sim, probe, workdir)
        self.cgroup = f"/gpuhook-shared-{os.getpid()}-{os.path.basename(str(workdir))}"

    def start(self, name, env=(), stages=("prestart", "poststop"), allow=None, delay=0.0) -> None:
        """Start `name` detached in the shared cgroup, with gpuhook at `stages`; `allow` is a
        device rule its runtime alone grants ("c 195:0 rw"); `delay` seconds of a sleep hook
        run before gpuhook's prestart (after runc has written the cgroup's rules)."""
        hooks = {stage: [testbed.hook_entry(self.config, stage)] for stage in stages}
        if delay and "prestart" in hooks:
            hooks["prestart"].insert(0, {"path": "/bin/sleep", "args": ["sleep", str(delay)]})
        rootfs = self.bed.rootfs(f"{self.bed.workdir}/bundles/{name}/rootfs", files={"/bin/probe": self.probe})

        def shared(spec):
            spec["linux"]["cgroupsPath"] = self.cgroup
            if allow:
                kind, numbers, access = allow.split()
                major, minor = numbers.split(":")
                spec["linux"].setdefault("resources", {}).setdefault("devices", []).append(
                    {"allow": True, "type": kind, "major": int(major), "minor": int(minor), "access": access})

        bundle = self.bed.bundle(name, ["/bin/busybox", "sleep", "600"], env=list(env), hooks=hooks,
                                 rootfs=rootfs, edit=shared)
        with open(f"{self.workdir}/{name}.runc.log", "w") as log:
            done = subprocess.run([self.bed.runc, "--root", self.bed.state_root, "run", "-d", "--bundle", bundle,
                                   name], stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60, cwd="/")
        assert done.returncode == 0, open(f"{self.workdir}/{name}.runc.log").read()

    def gpu0_from(self, name) -> str:
        """What container `name` gets opening a node for GPU 0 that it makes itself."""
        done = subprocess.run([self.bed.runc, "--root", self.bed.state_root, "exec", name, "/bin/busybox", "sh",
                               "-c", "mknod /dev/g0 c 195 0 2>/dev/null; /bin/probe /dev/g0"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        return line["read"]

    def state(self, name) -> dict:
        done = subprocess.run([self.bed.runc, "--root", self.bed.state_root, "state", name],
                              capture_output=True, text=True, timeout=30)
        return json.loads(done.stdout)

    def delete(self, name) -> None:
        subprocess.run([self.bed.runc, "--root", self.bed.state_root, "kill", name, "KILL"], capture_output=True,
                       timeout=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and self.state(name).get("status") != "stopped":
            time.sleep(0.05)
        subprocess.run([self.bed.runc, "--root", self.bed.state_root, "delete", name], capture_output=True,
                       timeout=60)

    def devices_list(self) -> str:
        with open(f"{V1_DEVICES}{self.cgroup}/devices.list") as f:
            return f.read()


@pytest.fixture
def shared(bed, sim_host, probe, tmp_path):
    require_root_tools("runc")
    if hierarchy.placement(os.getpid()).mode != hierarchy.V1:
        pytest.skip("the devices cgroup is v2 here: this is the cgroup v1 case")
    made = SharedCgroup(bed, sim_host, probe, tmp_path)
    yield made
    for name in os.listdir(f"{bed.workdir}/bundles"):
        bed.delete(name)
    for controller in os.listdir("/sys/fs/cgroup"):
        path = f"/sys/fs/cgroup/{controller}{made.cgroup}"
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                pass


def test_poststop_takes_back_a_grant_from_a_cgroup_that_outlives_the_container(shared):
    shared.start("b-nogpu")
    assert shared.gpu0_from("b-nogpu") == "EPERM"
    shared.start("a-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])
    assert "c 195:0 rw" in shared.devices_list()
    assert shared.gpu0_from("b-nogpu") == "ENXIO"  # the shared cgroup: B has A's GPU while A runs
    shared.delete("a-gpu")
    assert shared.gpu0_from("b-nogpu") == "EPERM"
    assert "c 195:0" not in shared.devices_list()
    (stop,) = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert "took back" in stop["grants"]
    assert not [n for n in os.listdir(f"{shared.workdir}/run/grants") if n.startswith("a-gpu@")]


def test_a_gpu_another_live_container_was_granted_stays(shared):
    shared.start("b-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])
    shared.start("a-gpu", ["NVIDIA_VISIBLE_DEVICES=0,1"])
    assert shared.gpu0_from("b-gpu") == "ENXIO"
    shared.delete("a-gpu")
    assert shared.gpu0_from("b-gpu") == "ENXIO"  # B's own grant: never taken by A's stop
    lines = shared.devices_list()
    assert "c 195:0 rw" in lines and "c 195:1 " not in lines  # A's GPU 1 is taken back


def test_a_poststop_naming_a_live_container_takes_nothing(shared):
    shared.start("b-nogpu")
    shared.start("a-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])
    state = dict(shared.state("a-gpu"), ociVersion="1.0.2")
    done = run_hook_process(["poststop", "--config", shared.config], json.dumps(state).encode())
    assert done.returncode == 0, done.stderr
    assert shared.gpu0_from("a-gpu") == "ENXIO"
    (stop,) = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert "still running" in stop["grants"]


def test_a_cgroup_made_again_at_its_path_is_not_the_one_the_grant_was_made_in(shared):
    """A's grant outlives A (no poststop ran: a runtime without one, or a poststop that comes
    late), runc removed A's cgroup, and another container now lives at the same cgroupsPath
    with GPU 0 from its own runtime. A's late poststop must not take that away: the path is
    the same, the cgroup (its inode) is not."""
    shared.start("a-gpu", ["NVIDIA_VISIBLE_DEVICES=0"], stages=("prestart",))
    state = dict(shared.state("a-gpu"), ociVersion="1.0.2")
    shared.delete("a-gpu")
    assert not os.path.isdir(f"{V1_DEVICES}{shared.cgroup}")  # removed with A (A was alone in it)
    shared.start("c-runtime", stages=(), allow="c 195:0 rw")
    assert shared.gpu0_from("c-runtime") == "ENXIO"
    done = run_hook_process(["poststop", "--config", shared.config], json.dumps(state).encode())
    assert done.returncode == 0, done.stderr
    assert shared.gpu0_from("c-runtime") == "ENXIO"  # its runtime's grant stays
    (stop,) = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert stop["grants"] == "cgroup removed with the container"


def test_two_starts_at_once_leave_no_grant_behind(shared):
    """Attacker pass 6: X and Z (GPU 0 each) start at once in the cgroup Y (no GPU) lives in.
    runc writes Z's rules (resetting the cgroup) before X's hook grants, and Z's hook then
    finds GPU 0 allowed already: it records nothing as its own. X's stop kept GPU 0 for Z and
    forgot it; Z's stop had nothing to take back; Y kept GPU 0 for good. The sleep hooks fix
    that order: X's gpuhook 1 s after its create, Z's create 0.3 s after X's, its gpuhook 1.5 s
    after that."""
    import threading

    shared.start("y-nogpu")
    x = threading.Thread(target=shared.start, args=("x-gpu", ["NVIDIA_VISIBLE_DEVICES=0"]), kwargs={"delay": 1})
    x.start()
    time.sleep(0.3)
    shared.start("z-gpu", ["NVIDIA_VISIBLE_DEVICES=0"], delay=1.5)
    x.join()
    added = {r["container"]: r.get("rules_added") for r in shared.log_lines() if r.get("stage") == "prestart"}
    assert added["x-gpu"] and not added["z-gpu"], added  # the order the test sets up
    shared.delete("x-gpu")
    assert shared.gpu0_from("z-gpu") == "ENXIO"  # Z still has its GPU
    shared.delete("z-gpu")
    assert shared.gpu0_from("y-nogpu") == "EPERM"
    assert "c 195:0" not in shared.devices_list()
    assert not [n for n in os.listdir(f"{shared.workdir}/run/grants") if n.startswith(("x-gpu@", "z-gpu@"))]


def test_a_grant_a_container_in_a_cgroup_below_needs_stays_until_it_stops(shared):
    """Attacker pass 6: X (GPU 0) in /P, Z (GPU 0) in /P/c. X's stop denied GPU 0 in /P, and
    so to Z below it (v1 exceptions are hierarchical). It waits for Z now."""
    shared.start("x-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])
    parent = shared.cgroup
    shared.cgroup = f"{parent}/c"
    try:
        shared.start("z-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])
        shared.delete("x-gpu")
        assert shared.gpu0_from("z-gpu") == "ENXIO"
        shared.delete("z-gpu")
    finally:
        shared.cgroup = parent
    x_stop, z_stop = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert "kept while a container in that cgroup or below needs them" in x_stop["grants"], x_stop
    assert "left by a container stopped earlier" in z_stop["grants"], z_stop
    assert not os.listdir(f"{shared.workdir}/run/grants")


def test_a_grant_whose_container_never_ran_its_poststop_goes_at_the_next_stop(shared):
    """Attacker pass 7: X and Z (GPU 0 each) start at once in the cgroup Y (no GPU) lives in,
    so Z records nothing as its own (see above); X is then deleted without a poststop (a
    runtime that ran none). Z's stop took back nothing and X's rules stayed for good. The
    next stop takes back what no live container needs, whoever's grant it was."""
    import threading

    shared.start("y-nogpu")
    x = threading.Thread(target=shared.start, args=("x-gpu", ["NVIDIA_VISIBLE_DEVICES=0"]),
                         kwargs={"delay": 1, "stages": ("prestart",)})
    x.start()
    time.sleep(0.3)
    shared.start("z-gpu", ["NVIDIA_VISIBLE_DEVICES=0"], delay=1.5)
    x.join()
    shared.delete("x-gpu")
    assert shared.gpu0_from("z-gpu") == "ENXIO"
    shared.delete("z-gpu")
    assert shared.gpu0_from("y-nogpu") == "EPERM"
    (stop,) = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert "left by a container stopped earlier" in stop["grants"], stop
    assert not os.listdir(f"{shared.workdir}/run/grants")


def test_a_start_that_fails_after_a_sibling_stopped_leaves_it_no_gpu(shared, tmp_path):
    """Attacker pass 24: A (prestart only, as dockerd registers gpuhook) waits behind a 2 s hook
    while B is created and granted GPU 0; A's gpuhook then finds GPU 0 allowed (adds nothing)
    and its worker hangs in ldconfig (an image can hold the host's ldconfig on a FIFO) while B
    stops. A grant record written before A's commit made B's poststop keep GPU 0 for A; A
    then failed at its deadline, took its record back, and C, never granted a GPU, kept GPU 0.
    The record is written once the start is committed: B's stop takes GPU 0 back."""
    import threading

    shared.configure(ldconfig=fake_ldconfig(tmp_path, "HANG"), **{"deadline-seconds": 4.0})
    shared.start("c-nogpu")
    out = {}

    def start_a():
        hooks = {"prestart": [{"path": "/bin/sleep", "args": ["sleep", "2"]},
                              testbed.hook_entry(shared.config, "prestart")]}
        rootfs = shared.bed.rootfs(f"{shared.bed.workdir}/bundles/a-gpu/rootfs", files={"/bin/probe": shared.probe})
        os.makedirs(f"{rootfs}/etc", exist_ok=True)
        with open(f"{rootfs}/etc/ld.so.conf", "w") as f:  # a glibc image: ldconfig runs
            f.write("include /etc/ld.so.conf.d/*.conf\n")

        def in_shared_cgroup(spec):
            spec["linux"]["cgroupsPath"] = shared.cgroup
        bundle = shared.bed.bundle("a-gpu", ["/bin/busybox", "sleep", "600"], env=["NVIDIA_VISIBLE_DEVICES=0"],
                                   hooks=hooks, rootfs=rootfs, edit=in_shared_cgroup)
        out["a"] = subprocess.run([shared.bed.runc, "--root", shared.bed.state_root, "run", "-d", "--bundle", bundle,
                                   "a-gpu"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                                  cwd="/")
    a = threading.Thread(target=start_a)
    a.start()
    time.sleep(0.5)
    shared.start("b-gpu", ["NVIDIA_VISIBLE_DEVICES=0"])  # after runc reset A's cgroup, before A's gpuhook
    time.sleep(3.0)  # A's gpuhook is in its worker now, in the hanging ldconfig
    shared.delete("b-gpu")
    assert a.is_alive(), "B stopped after A's start had ended: the race this test is about did not happen"
    a.join()
    assert out["a"].returncode != 0, "A's start was to fail at its deadline"
    (b_stop,) = [r for r in shared.log_lines() if r.get("stage") == "poststop"]
    assert "kept" not in b_stop["grants"], b_stop
    assert shared.gpu0_from("c-nogpu") == "EPERM"
    assert "c 195:0" not in shared.devices_list()
