"""The health checks against a real NVIDIA GPU and its libnvidia-ml (tests/device/target.py).

Read-only by default: the checks run (and write their reports into a temporary state dir),
nothing is killed and no GPU is reset. With GPUHOOK_DEVICE_RESET=1 a GPU that no process
uses is also reset the way the hook resets one (every NVML session closed, persistence mode
off for the reset and back on after) and checked again.

Skipped exactly where there is no NVIDIA kernel module (no /proc/driver/nvidia/version) and
nothing is simulated (GPUHOOK_DEVICE_SIMULATED). Anything else failing fails: a host with a
driver whose NVML gpuhook cannot load or that counts no GPU is what these tests must report.
CI has no GPU, so there these tests skip even under GPUHOOK_STRICT=1.
"""

import os
import time

import pytest

from gpuhook import config as cfg
from gpuhook.discover import nvml
from gpuhook.discover import proc as discover
from gpuhook.health import actions, checks, engine, owners, store

import target

pytestmark = pytest.mark.device


def real_gpus(config) -> tuple:
    """The host's GPUs as its NVML sees them."""
    with nvml.Session(nvml.library_path(config)) as session:
        inventory = session.inventory()
    assert inventory.gpus, "the NVIDIA driver reports no GPU"
    # What answered is this host's driver: /proc and NVML name the same version.
    assert inventory.driver_version == discover.driver_version(config.proc_root), nvml.library_path(config)
    return inventory.gpus


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    target.require_driver()
    return str(tmp_path_factory.mktemp("device-checks"))


@pytest.fixture(scope="module")
def gpus(workdir):
    assert engine.wait_for_stragglers(30)  # no other NVML session may still be open
    return real_gpus(cfg.load(target.config_path(f"{workdir}/conf"), use_cache=False))


def with_changes(config, health=None, **top):
    values = config.as_dict()
    values.update(top)
    values["health"].update(health or {})
    return cfg.from_mapping(values)


@pytest.fixture
def config(workdir, tmp_path):
    base = cfg.load(target.config_path(f"{workdir}/conf"), use_cache=False)
    # This test's own state and log; the host's driver settings as configured.
    return with_changes(base, **{"state-dir": str(tmp_path / "run"), "log-file": str(tmp_path / "gpuhook.log")})


def usable(gpus) -> list:
    return [g.uuid for g in gpus if not g.lost]


def test_memory_leaves_the_drivers_reserve_out_on_drivers_that_report_it(gpus, config):
    with nvml.Session(nvml.library_path(config)) as session:
        version = int(session.driver_version().split(".")[0])
        for gpu in gpus:
            facts = session.health(gpu.uuid)
            if version >= 510:  # nvmlDeviceGetMemoryInfo_v2 (docs/health.md, Drivers)
                assert facts.memory_reserved is not None, gpu.uuid
                print(f"{gpu.uuid}: {facts.memory_used >> 20} MiB used, {facts.memory_reserved >> 20} MiB reserved")
            else:
                assert facts.memory_reserved is None


def test_every_check_gets_an_answer_from_every_gpu(gpus, config):
    with nvml.Session(nvml.library_path(config)) as session:
        for gpu in gpus:
            assert not gpu.lost, f"GPU {gpu.index} is lost"
            facts = session.health(gpu.uuid)
            processes = owners.Attributor(()).attribute(facts.processes)
            problems, outcomes = checks.evaluate(facts, processes, checks.Thresholds.from_config(config))
            assert set(outcomes) == set(checks.Check)
            assert outcomes[checks.Check.REACHABLE] is checks.Outcome.OK
            # Without a registry nothing can be an orphan, so nothing would ever be killed.
            assert not any(p.owner is owners.Owner.ORPHAN for p in processes)
            print(f"{gpu.uuid}: {checks.facts_summary(facts, processes)}; problems: {problems}")


def test_a_read_only_check_of_all_gpus_writes_a_report_each_and_changes_nothing(gpus, config):
    uuids = usable(gpus)
    report = engine.check(uuids, config)
    assert [g.uuid for g in report.gpus] == uuids and report.cut_off == ()
    for result in report.gpus:
        assert result.actions == ()
        written = store.read_report(config.state_dir, result.uuid)
        assert written["status"] == result.status.value and written["by"] == "check"
        if not result.facts.get("processes"):
            # An idle GPU must pass with the defaults: the driver's reserve in NVML's used
            # memory must stay below leftover-memory-mib.
            assert result.outcomes[checks.Check.MEMORY] is not checks.Outcome.FAILED, result.facts
    print(f"{len(uuids)} GPU(s) checked in {report.seconds:.3f} s (one after the other: "
          f"{report.serial_seconds():.3f} s)")


def test_the_checks_run_in_the_host_pid_namespace(gpus):
    assert owners.in_host_pid_namespace()


@pytest.mark.skipif(os.environ.get("GPUHOOK_DEVICE_RESET") != "1",
                    reason="resets a GPU: set GPUHOOK_DEVICE_RESET=1 to allow it")
def test_a_gpu_nobody_uses_is_reset_as_the_hook_resets_it_and_passes_again(gpus, config):
    config = with_changes(config, {"reset-command": "nvidia-smi --gpu-reset -i {uuid}"})
    with nvml.Session(nvml.library_path(config), client_lock=actions.client_lock(config)) as session:
        idle = [g.uuid for g in gpus if not g.lost and not g.mig_mode and not session.health(g.uuid).processes]
        if not idle:
            pytest.skip("every GPU is in use or in MIG mode; resetting one would disturb its users")
        uuid = idle[0]
        before = session.reset_facts(uuid)
        outcome = actions.reset_gpu(config, session, uuid, time.monotonic() + 120, 120)
        print(f"reset of {uuid}: {[a.as_dict() for a in outcome.actions]}")
        assert outcome.refused is None, outcome.refused
        assert session.reset_facts(uuid).persistence == before.persistence  # put back as it was
    started = time.monotonic()
    report = engine.check([uuid], config)
    assert report.ok, report.error().one_line()
    print(f"check after the reset: {time.monotonic() - started:.3f} s")


@pytest.mark.skipif(os.environ.get("GPUHOOK_DEVICE_RESET") != "1",
                    reason="may reset a GPU: set GPUHOOK_DEVICE_RESET=1 to allow it")
def test_a_repairing_check_leaves_every_gpu_healthy_or_in_use(gpus, config):
    # The registry is empty: nothing is anyone's orphan, so nothing is killed; a GPU is reset
    # only if a check needs it and no process uses it.
    report = engine.check(usable(gpus), config, repair=True)
    for result in report.gpus:
        assert result.status in (engine.Status.HEALTHY, engine.Status.REPAIRED) or result.users, result.failure()
