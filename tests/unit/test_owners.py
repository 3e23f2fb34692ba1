"""Owner attribution (gpuhook.health.owners) against a literal /proc: tests/data/host-proc-owners.

The classes that decide whether a GPU process is killed, blocks a reset, or fails a start.
"""

import os
import shutil

import pytest

from gpuhook.health import checks, owners, registry
from gpuhook.health.owners import Owner
from gpuhook.discover.nvml import Process

HERE = os.path.dirname(os.path.abspath(__file__))
PROC = os.path.join(os.path.dirname(HERE), "data", "host-proc-owners")
GIB = 1 << 30


HOST_PID_NS = 4026531836
CGROUP = "/kubepods/pod-a/ctr-a"


@pytest.fixture
def cgroupfs(tmp_path):
    """A directory standing in for the cgroup2 mount: its directories' inodes are the cgroups'."""
    root = tmp_path / "cgroup2"
    (root / CGROUP.strip("/") / "sub").mkdir(parents=True)
    return [("cgroup2", "/", str(root), {"rw"})]


def container(init_pid: int, start_time: int, mounts, **identity) -> registry.Container:
    """ctr-a as the hook registered it: cgroup /kubepods/pod-a/ctr-a (its inode now), the
    host's pid namespace, where gpuhook (pid 100) runs too."""
    ids = {"": registry.cgroup_inode("", CGROUP, mounts)}
    fields = dict(cgroup_ids=ids, pid_ns=HOST_PID_NS, ns_init=(0, 0), **identity)
    return registry.Container("ctr-a", init_pid, start_time, {"": CGROUP}, ("GPU-a",), {}, "boot", 0.0, **fields)


def attribute(proc, *pids, containers=(), killed=(), mounts=()):
    attributor = owners.Attributor(containers, proc, mounts=list(mounts))
    for pair in killed:
        attributor.killed(*pair)
    return attributor.attribute([Process(pid, GIB, "compute", None, None) for pid in pids])


def test_the_tree_is_a_host_pid_namespace():
    assert owners.in_host_pid_namespace(PROC)


def test_the_hosts_init_is_a_host_process_from_a_mount_namespace_of_our_own():
    # gpuhook (pid 100) runs in a pod's mount namespace: pid 1's differs, yet pid 1 is the
    # host's init, not "a container gpuhook did not start".
    (init,) = attribute(PROC, 1)
    assert (init.owner, init.detail, init.live) == (Owner.HOST, "the host's init", True)


def test_a_zombie_of_the_hosts_init_names_its_parent_correctly():
    (zombie,) = attribute(PROC, 300)
    assert (zombie.owner, zombie.detail) == (Owner.ZOMBIE, "zombie not reaped by its parent pid 1 (the host's init)")
    (problem,), _ = checks.evaluate(_facts(), (zombie,), checks.Thresholds(256))
    assert problem.remedy is checks.Remedy.NONE


def test_a_process_this_run_killed_is_no_user_while_its_parent_has_not_reaped_it():
    (zombie,) = attribute(PROC, 300, killed=[(300, 8100)])
    assert (zombie.owner, zombie.live) == (Owner.KILLED, False)
    assert zombie.detail == "killed, not yet reaped by its parent pid 1"
    problems, outcomes = checks.evaluate(_facts(), (zombie,), checks.Thresholds(256))
    assert problems == () and outcomes[checks.Check.PROCESSES] is checks.Outcome.OK


def test_a_kill_noted_for_another_start_time_does_not_count():
    (zombie,) = attribute(PROC, 300, killed=[(300, 8099)])
    assert zombie.owner is Owner.ZOMBIE


def test_an_orphan_and_a_live_containers_process(cgroupfs):
    gone_init = container(250, 7000, cgroupfs)  # no /proc/250: the container is gone
    (orphan,) = attribute(PROC, 200, containers=[gone_init], mounts=cgroupfs)
    assert (orphan.owner, orphan.container) == (Owner.ORPHAN, gone_init)
    live_init = container(200, 8000, cgroupfs)  # pid 200 itself is the init
    (process,) = attribute(PROC, 200, containers=[live_init], mounts=cgroupfs)
    assert process.owner is Owner.CONTAINER


@pytest.mark.parametrize("pid,why", [
    (500, "joined the cgroup from a pid namespace of its own"),
    (600, "in a child cgroup of the container's"),
])
def test_a_process_the_container_did_not_start_is_never_its_orphan(cgroupfs, pid, why):
    gone = container(250, 7000, cgroupfs)
    (process,) = attribute(PROC, pid, containers=[gone], mounts=cgroupfs)
    assert (process.owner, process.container, process.live) == (Owner.OTHER_CONTAINER, None, True), why


@pytest.mark.parametrize("identity,why", [
    (dict(cgroup_ids={"": 1}), "the cgroup at that path is another one (made again since)"),
    (dict(ns_init=(250, 7000)), "the container's pid namespace ended with its init"),
    (dict(pid_ns=4026532777), "another pid namespace"),
    (dict(cgroup_ids=None), "an entry without kernel identities"),
])
def test_only_the_kernel_identities_the_hook_recorded_make_a_process_the_containers(cgroupfs, identity, why):
    gone = container(250, 7000, cgroupfs)._replace(**identity)
    (process,) = attribute(PROC, 200, containers=[gone], mounts=cgroupfs)
    assert process.owner is Owner.OTHER_CONTAINER, why


def test_a_process_older_than_the_containers_init_is_not_its(cgroupfs):
    gone = container(250, 8001, cgroupfs)  # pid 200 started at 8000, before this init
    (process,) = attribute(PROC, 200, containers=[gone], mounts=cgroupfs)
    assert process.owner is Owner.OTHER_CONTAINER


def test_a_host_process_seen_from_a_pods_mount_namespace_is_never_killed():
    # From a mount namespace of its own gpuhook cannot tell a host process from another
    # container's: either way it is live, a user of the GPU, and never killed.
    (smi,) = attribute(PROC, 400)
    assert (smi.owner, smi.live) == (Owner.OTHER_CONTAINER, True)


@pytest.fixture
def proc(tmp_path):
    copy = tmp_path / "proc"
    shutil.copytree(PROC, copy, symlinks=True)
    return str(copy)


def test_a_process_that_exits_between_two_reads_is_gone_not_another_container(proc, monkeypatch):
    read_cgroups = registry.read_cgroups

    def exits_first(pid, where="/proc"):
        shutil.rmtree(f"{proc}/{pid}")
        return read_cgroups(pid, where)

    monkeypatch.setattr(registry, "read_cgroups", exits_first)
    (process,) = attribute(proc, 400)
    assert (process.owner, process.detail, process.live) == (Owner.GONE, "exited during the check", False)


def test_a_process_that_becomes_a_zombie_between_two_reads_is_judged_as_one(proc, monkeypatch):
    def becomes_zombie(pid, where="/proc"):
        path = f"{proc}/{pid}/stat"
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace(") S ", ") Z ", 1))
        os.unlink(f"{proc}/{pid}/cgroup")
        return None

    monkeypatch.setattr(registry, "read_cgroups", becomes_zombie)
    (process,) = attribute(proc, 400, killed=[(400, 8200)])
    assert process.owner is Owner.KILLED


def test_a_pid_reused_between_two_reads_is_gone(proc, monkeypatch):
    def reused(pid, where="/proc"):
        path = f"{proc}/{pid}/stat"
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace(" 8200 ", " 9999 ", 1))
        os.unlink(f"{proc}/{pid}/ns/mnt")
        return {"": "/system.slice/ssh.service"}

    monkeypatch.setattr(registry, "read_cgroups", reused)
    (process,) = attribute(proc, 400)
    assert (process.owner, process.detail) == (Owner.GONE, "exited during the check")


def test_a_process_whose_files_are_hidden_stays_a_live_unknown(monkeypatch):
    # /proc that hides a process's cgroup (hidepid, another user namespace) is no proof of
    # anything: the process counts as a user and is never killed.
    monkeypatch.setattr(registry, "read_cgroups", lambda pid, where="/proc": None)
    (process,) = attribute(PROC, 400)
    assert (process.owner, process.detail, process.live) == (Owner.OTHER_CONTAINER, "cgroup unreadable", True)


def _facts():
    from gpuhook.discover import nvml

    fields = dict.fromkeys(nvml.Health._fields)
    fields.update(lost=False, memory_used=GIB)
    return nvml.Health(**fields)
