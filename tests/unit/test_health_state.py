"""gpuhook.health's files and children: stamps, reports, locks, the registry, the reset command."""

import json
import multiprocessing
import os
import stat
import subprocess
import sys
import threading
import time

import pytest

from gpuhook import config as cfg
from gpuhook.request import oci
from gpuhook.errors import ConfigError, HostError, InputError
from gpuhook.health import actions, registry, store

UUID = "GPU-8f344ce4-a5f9-55f1-bccc-91810349d20b"


@pytest.fixture
def state_dir(tmp_path):
    return str(tmp_path / "run")


# --- stamps -------------------------------------------------------------------------------

TOKEN = "0123456789abcdef0123456789abcdef"  # a device plugin allocation's token
OTHER = "fedcba9876543210fedcba9876543210"


def test_a_fresh_stamp_is_claimed_once(state_dir):
    store.write_stamp(state_dir, UUID, "healthy", TOKEN)
    first = store.claim_stamp(state_dir, UUID, 60, [TOKEN])
    assert first.fresh and first.why.startswith("fresh stamp from prepare")
    again = store.claim_stamp(state_dir, UUID, 60, [TOKEN])
    assert (again.fresh, again.why) == (False, "no stamp")
    assert os.listdir(store.stamps_dir(state_dir)) == []


def test_a_stamp_made_for_one_allocation_is_never_claimed_by_another(state_dir):
    store.write_stamp(state_dir, UUID, "healthy", TOKEN)
    assert (store.claim_stamp(state_dir, UUID, 60, [OTHER]).why) == "no stamp"
    assert store.claim_stamp(state_dir, UUID, 60, []).why == \
        "no stamp for this start (it carries no allocation token)"
    assert os.listdir(store.stamps_dir(state_dir)) == [f"{UUID}@{TOKEN}.json"]  # left for its own start
    assert store.claim_stamp(state_dir, UUID, 60, [OTHER, TOKEN]).fresh


def test_a_stamp_file_renamed_to_another_allocation_is_not_fresh(state_dir):
    store.write_stamp(state_dir, UUID, "healthy", TOKEN)
    os.rename(store.stamp_path(state_dir, UUID, TOKEN), store.stamp_path(state_dir, UUID, OTHER))
    assert store.claim_stamp(state_dir, UUID, 60, [OTHER]).why == "stamp damaged"


def test_a_stale_stamp_is_not_fresh_and_is_consumed(state_dir):
    store.write_stamp(state_dir, UUID, "repaired", TOKEN)
    path = store.stamp_path(state_dir, UUID, TOKEN)
    stamp = json.load(open(path))
    stamp["boottime"] -= 61
    store.write_json(path, stamp)
    claim = store.claim_stamp(state_dir, UUID, 60, [TOKEN])
    assert not claim.fresh and claim.why.startswith("stamp 61.") and "stamp-ttl-seconds 60" in claim.why
    assert not os.path.exists(path)


def test_a_new_stamp_removes_the_gpus_stamps_nobody_can_claim_any_more(state_dir):
    unclaimed = [f"{'a' * 31}{i}" for i in range(3)]
    for token in unclaimed:
        store.write_stamp(state_dir, UUID, "healthy", token)
    stale = store.stamp_path(state_dir, UUID, unclaimed[0])
    store.write_json(stale, {**json.load(open(stale)), "boottime": store.boottime() - 61})
    store.write_stamp(state_dir, "GPU-other", "healthy", unclaimed[0])
    store.write_stamp(state_dir, UUID, "healthy", TOKEN, ttl=60)
    assert sorted(os.listdir(store.stamps_dir(state_dir))) == sorted(
        [f"GPU-other@{unclaimed[0]}.json", f"{UUID}@{unclaimed[1]}.json", f"{UUID}@{unclaimed[2]}.json",
         f"{UUID}@{TOKEN}.json"])


@pytest.mark.parametrize("change,why", [
    ({"boot_id": "another-boot"}, "stamp from another boot"),
    ({"uuid": "GPU-other"}, "stamp damaged"),
    ({"boottime": "yesterday"}, "stamp damaged"),
    ({"boottime": 1e12}, "stamp from the future"),
    ({"format": 1}, "stamp damaged"),  # an older gpuhook's stamp names no allocation
])
def test_a_stamp_from_elsewhere_is_not_fresh(state_dir, change, why):
    store.write_stamp(state_dir, UUID, "healthy", TOKEN)
    path = store.stamp_path(state_dir, UUID, TOKEN)
    store.write_json(path, {**json.load(open(path)), **change})
    assert store.claim_stamp(state_dir, UUID, 60, [TOKEN]).why == why


def test_a_damaged_stamp_file_is_not_fresh(state_dir):
    path = store.stamp_path(state_dir, UUID, TOKEN)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    assert store.claim_stamp(state_dir, UUID, 60, [TOKEN]).why == "stamp damaged"


def _claim(args):
    state_dir, uuid = args
    return store.claim_stamp(state_dir, uuid, 60, [TOKEN]).fresh


def test_of_many_claimants_racing_for_one_stamp_exactly_one_wins(state_dir):
    for _ in range(5):
        store.write_stamp(state_dir, UUID, "healthy", TOKEN)
        with multiprocessing.get_context("fork").Pool(8) as pool:
            assert sorted(pool.map(_claim, [(state_dir, UUID)] * 8)) == [False] * 7 + [True]


@pytest.mark.parametrize("bad", ["../x-0123456789abcdef", "short", "a" * 129, "0123456789abcdef/", "", None])
def test_only_token_forms_become_stamp_file_names(state_dir, bad):
    with pytest.raises(InputError, match="is not an allocation token"):
        store.stamp_path(state_dir, UUID, bad)


def bind(destination, source="/dev/null", kind="bind", options=("rbind", "ro")):
    return oci.Mount(destination, source, kind, list(options))


def test_allocation_tokens_are_dev_null_binds_under_their_root_only():
    mounts = [
        bind(f"/var/run/gpuhook-allocation/{TOKEN}"),
        bind(f"/run/gpuhook-allocation/{OTHER}", kind="none", options=("bind",)),  # /var/run is /run
        bind(f"/var/run/gpuhook-allocation/{TOKEN}"),  # named twice: once
        bind("/var/run/gpuhook-allocation/" + "b" * 32, source="/host/file"),  # not /dev/null
        bind("/var/run/gpuhook-allocation/" + "c" * 32, source="/dev/null", kind="tmpfs", options=()),
        bind("/var/run/gpuhook-allocation/short"),  # too short to be a secret
        bind("/var/run/gpuhook-allocation/" + "d" * 32 + "/deeper"),
        bind("/var/run/gpuhook-allocation-x/" + "e" * 32),
        bind(f"/var/run/nvidia-container-devices/{TOKEN}"),
        bind("//var/./run/gpuhook-allocation//" + "f" * 32),
    ]
    assert store.allocation_tokens(mounts) == (TOKEN, OTHER, "f" * 32)
    many = [bind(f"/var/run/gpuhook-allocation/{i:032d}") for i in range(20)]
    assert len(store.allocation_tokens(many)) == store.MAX_TOKENS


@pytest.mark.parametrize("bad", ["../../etc/passwd", "GPU-../x", "GPU-a/b", "gpu-lower", "GPU-" + "a" * 100, "", 7])
def test_only_gpu_and_mig_uuids_become_file_names(state_dir, bad):
    with pytest.raises(InputError, match="is not a GPU UUID"):
        store.report_path(state_dir, bad)


# --- reports --------------------------------------------------------------------------------

def test_reports_are_replaced_whole_and_readable_by_root_only(state_dir):
    store.write_report(state_dir, {"uuid": UUID, "status": "healthy"})
    store.write_report(state_dir, {"uuid": UUID, "status": "unhealthy"})
    assert store.read_report(state_dir, UUID) == {"uuid": UUID, "status": "unhealthy"}
    directory = store.health_dir(state_dir)
    assert os.listdir(directory) == [f"{UUID}.json"]  # no temporary file left
    assert stat.S_IMODE(os.stat(f"{directory}/{UUID}.json").st_mode) == 0o600  # pods, pids, GPUs
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_report_never_follows_a_planted_symlink(state_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.makedirs(store.health_dir(state_dir))
    os.symlink(victim, store.report_path(state_dir, UUID))
    store.write_report(state_dir, {"uuid": UUID})
    assert victim.read_text() == "keep"
    assert not os.path.islink(store.report_path(state_dir, UUID))


# --- locks ----------------------------------------------------------------------------------

def test_a_gpu_lock_excludes_a_second_holder_until_released(state_dir):
    first, second = store.GpuLock(state_dir, UUID), store.GpuLock(state_dir, UUID)
    assert first.acquire(time.monotonic() + 1)
    started = time.monotonic()
    assert not second.acquire(time.monotonic() + 0.3)
    assert 0.25 < time.monotonic() - started < 2
    first.release()
    assert second.acquire(time.monotonic() + 1)
    second.release()


def test_a_gpu_lock_held_by_another_process_is_waited_for_and_dies_with_it(state_dir):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from gpuhook.health import store\n"
        f"lock = store.GpuLock({state_dir!r}, {UUID!r}); assert lock.acquire(time.monotonic() + 5)\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        lock = store.GpuLock(state_dir, UUID)
        assert not lock.acquire(time.monotonic() + 0.2)
        holder.kill()
        holder.wait()
        assert lock.acquire(time.monotonic() + 2)  # the kernel dropped the dead holder's lock
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_waiting_for_a_lock_stops_when_told(state_dir):
    first = store.GpuLock(state_dir, UUID)
    assert first.acquire(time.monotonic() + 1)
    started = time.monotonic()
    assert not store.GpuLock(state_dir, UUID).acquire(time.monotonic() + 30, cancelled=lambda: True)
    assert time.monotonic() - started < 10  # not the 30 s it would wait uncancelled
    first.release()


# --- the registry ---------------------------------------------------------------------------

def test_an_entry_written_without_kernel_identities_owns_nothing():
    """Entries of an older gpuhook name cgroups by path only: no process is theirs."""
    entry = registry.Container("abc", 1, 1, {"": "/ctr/abc"}, (UUID,), {}, "b", 0.0)
    assert entry.cgroup_ids is None and not registry.belongs(entry, os.getpid())


def test_only_cgroups_of_the_container_itself_are_recorded():
    container = {"pids": "/ctr/abc", "memory": "/runtime", "cpu": "/", "": "/ctr/abc", "devices": "/a"}
    runtime = {"pids": "/", "memory": "/runtime", "cpu": "/", "": "/", "devices": "/a/b"}
    assert registry.own_cgroups(container, runtime) == {"pids": "/ctr/abc", "": "/ctr/abc"}


def test_registry_entries_round_trip_and_identify_the_init_by_start_time(state_dir):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        entry = registry.from_process("ctr-1", sleeper.pid, [UUID], {"pod": "p"})
        registry.add(state_dir, entry)
        assert registry.load(state_dir, "ctr-1") == entry
        # It shares this test's pid namespace: the one gpuhook runs in, which nothing else can be.
        assert entry.pid_ns == registry.pid_namespace(os.getpid()) and entry.ns_init == (0, 0)
        assert registry.is_alive(entry)
        assert not registry.is_alive(entry._replace(start_time=entry.start_time + 1))  # a reused pid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not registry.is_alive(entry)
    registry.forget(state_dir, "ctr-1")
    assert registry.load(state_dir, "ctr-1") is None


def test_a_zombie_or_missing_init_cannot_be_registered():
    zombie = subprocess.Popen(["true"])
    while registry.read_stat(zombie.pid).state != "Z":
        time.sleep(0.01)
    with pytest.raises(LookupError, match=f"pid {zombie.pid}"):
        registry.from_process("z", zombie.pid, [UUID])
    zombie.wait()
    with pytest.raises(LookupError):
        registry.from_process("z", 0, [UUID])


@pytest.mark.parametrize("container_id", ["../../etc/cron.d/x", "a" * 300, ".hidden", "id with spaces", "é"])
def test_odd_container_ids_get_a_hashed_file_name(state_dir, container_id):
    name = registry.entry_name(container_id)
    assert name.startswith("sha256-") and "/" not in name
    entry = registry.Container(container_id, 1, 1, {}, (UUID,), {}, store.boot_id(), 0.0)
    registry.add(state_dir, entry)
    assert registry.load(state_dir, container_id) == entry


def test_reading_the_registry_drops_entries_nothing_can_depend_on(state_dir):
    live = registry.Container("live", os.getpid(), registry.read_stat(os.getpid()).start_time, {"": "/x"},
                              (UUID,), {}, store.boot_id(), 0.0, {"": 1}, registry.pid_namespace(os.getpid()),
                              (0, 0))
    kept_dead = live._replace(id="dead-with-cgroup", pid=999999999, cgroups={})  # nowhere to look: kept
    ended_ns = live._replace(id="ended-namespace", pid=999999999, cgroups={}, ns_init=(999999999, 1))
    old_boot = live._replace(id="old-boot", boot_id="another")
    gone_cgroup = live._replace(id="gone", pid=999999999, cgroups={"": "/gpuhook-test-no-such-cgroup"})
    for entry in (live, kept_dead, old_boot, gone_cgroup, ended_ns):
        registry.add(state_dir, entry)
    mounts = [("cgroup2", "/", "/sys/fs/cgroup/unified", {"rw"})]
    assert registry.cgroups_exist(gone_cgroup, mounts) is False
    assert registry.cgroups_exist(gone_cgroup, []) is True  # cannot be located: assume it exists
    found = {e.id for e in registry.load_all(state_dir)}
    assert {"live", "dead-with-cgroup"} <= found and not found & {"old-boot", "ended-namespace"}
    assert not os.path.exists(registry.entry_path(state_dir, old_boot))


# --- the reset command --------------------------------------------------------------------

def health_config(driver_root, **health) -> "cfg.Config":
    return cfg.from_mapping({"driver-root": str(driver_root), "health": health})


def fake_driver(tmp_path, script: str, name="nvidia-smi", directory="usr/bin") -> str:
    root = tmp_path / "driver"
    (root / directory).mkdir(parents=True, exist_ok=True)
    program = root / directory / name
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(0o755)
    return str(root)


def test_the_reset_program_is_found_in_the_driver_root_only(tmp_path, monkeypatch):
    root = fake_driver(tmp_path, "exit 0\n", directory="usr/sbin")
    monkeypatch.setenv("PATH", f"{tmp_path}/elsewhere:/usr/bin:/bin")
    argv = actions.reset_argv(health_config(root), UUID)
    assert argv == [f"{root}/usr/sbin/nvidia-smi", "--gpu-reset", "-i", UUID]
    with pytest.raises(HostError, match=r"no executable nvidia-smi in /usr/bin.*of driver root /nonexistent"):
        actions.reset_argv(health_config("/nonexistent"), UUID)


def test_a_symlink_in_the_driver_root_stays_inside_it(tmp_path):
    root = fake_driver(tmp_path, "exit 0\n", name="nvidia-smi.real")
    os.symlink("/usr/bin/nvidia-smi.real", f"{root}/usr/bin/nvidia-smi")  # absolute, as in a driver container
    assert actions.reset_argv(health_config(root), UUID)[0] == f"{root}/usr/bin/nvidia-smi.real"
    os.symlink("../../../../../../bin/true", f"{root}/usr/bin/escape")
    with pytest.raises(HostError, match="reset command not found"):
        actions.reset_argv(health_config(root, **{"reset-command": "escape {uuid}"}), UUID)


@pytest.mark.parametrize("command,message", [
    ("", "health.reset-command is empty"),
    ("'unclosed", "No closing quotation"),
    ("bin/nvidia-smi -r", "must be a name or an absolute path"),
])
def test_a_bad_reset_command_is_a_config_error(tmp_path, command, message):
    with pytest.raises(ConfigError, match=message):
        actions.reset_argv(health_config(tmp_path, **{"reset-command": command}), UUID)


def test_an_absolute_reset_command_is_used_as_written_with_quoting(tmp_path):
    config = health_config(tmp_path, **{"reset-command": "/bin/echo 'reset now' --id={uuid}"})
    assert actions.reset_argv(config, UUID) == ["/bin/echo", "reset now", f"--id={UUID}"]


def test_the_reset_runs_with_a_minimal_environment_from_slash(tmp_path, monkeypatch):
    out = tmp_path / "env.txt"
    root = fake_driver(tmp_path, f'env > {out}; pwd >> {out}; echo "$@" >> {out}\n')
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    monkeypatch.chdir(tmp_path)
    action = actions.reset(health_config(root), UUID, timeout=5)
    assert action.ok and action.detail == "nvidia-smi exited 0"
    lines = out.read_text().splitlines()
    env = {line.split("=", 1)[0] for line in lines if "=" in line}
    assert env <= {"PATH", "LANG", "PWD", "SHLVL", "_"} and "LD_PRELOAD" not in env
    assert lines[-2:] == ["/", f"--gpu-reset -i {UUID}"]


def test_a_failing_reset_says_how(tmp_path):
    root = fake_driver(tmp_path, "echo 'Unable to reset GPU: in use' >&2; exit 255\n")
    action = actions.reset(health_config(root), UUID, timeout=5)
    assert not action.ok and action.detail == "nvidia-smi exited 255: Unable to reset GPU: in use"


def test_a_hanging_reset_is_killed_with_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild"
    root = fake_driver(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait\n")
    started = time.monotonic()
    action = actions.reset(health_config(root), UUID, timeout=0.5)
    assert not action.ok and action.detail == "nvidia-smi did not finish within 0.5 s and was killed"
    assert time.monotonic() - started < 3
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and registry.read_stat(grandchild) is not None \
            and not registry.read_stat(grandchild).zombie:
        time.sleep(0.02)
    stat_now = registry.read_stat(grandchild)
    assert stat_now is None or stat_now.zombie


# --- killing --------------------------------------------------------------------------------

def test_kill_hits_only_the_process_that_was_checked():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        start_time = registry.read_stat(victim.pid).start_time
        spared = actions.kill(victim.pid, start_time + 1, time.monotonic() + 2)  # "pid reused since"
        assert spared.ok and spared.detail == "pid now belongs to another process: not killed"
        assert victim.poll() is None
        asked = []
        moved = actions.kill(victim.pid, start_time, time.monotonic() + 2,
                             belongs=lambda pid: asked.append(pid))  # "left the container's cgroup since"
        assert (moved.ok, moved.detail) == (False, "no longer in the container's cgroups and pid namespace: not killed")
        assert asked == [victim.pid] and victim.poll() is None
        threading.Thread(target=victim.wait, daemon=True).start()  # the parent reaps, as a shim would
        done = actions.kill(victim.pid, start_time, time.monotonic() + 5)
        assert done.ok and done.detail == "killed" and victim.wait(timeout=5) == -9
    finally:
        victim.kill()
        victim.wait()
    assert actions.kill(victim.pid, start_time, time.monotonic() + 1).detail == "already gone"


@pytest.mark.parametrize("output,peers", [
    # The simulated nvidia-smi's wording (docs/simulated-host.md).
    ("Unable to reset GPU 00000000:18:00.0: it is connected through NVLink to GPUs that must be reset in the same "
     "command: 00000000:28:00.0, 00000000:38:00.0\n", ["00000000:28:00.0", "00000000:38:00.0"]),
    # Any wording that speaks of NVLink counts; the bus ids after it are the peers.
    ("GPU 0000:1A:00.0: NVLINK peers 0000:1B:00.0 and 0000:1C:00.0 must be reset too", ["0000:1B:00.0",
                                                                                       "0000:1C:00.0"]),
    ("Reset of this GPU requires resetting its NVLink peers.", []),
    ("The following GPUs could not be reset:\n  GPU 00000000:1A:00.0: In use by another client\n", None),
    ("", None),
])
def test_a_reset_refused_for_nvlink_peers_is_told_apart_and_names_them(output, peers):
    assert actions.nvlink_peers(output) == peers
