"""The health checks against a real NVIDIA GPU and the system's libnvidia-ml.

Read-only by default: the checks run (and write their reports into a temporary state dir),
nothing is killed and no GPU is reset. With GPUHOOK_DEVICE_RESET=1 a GPU that no process
uses is also reset with the default reset command (the host's nvidia-smi) and checked again.

Skipped exactly where there is no NVIDIA driver or GPU: no /proc/driver/nvidia/version (the
kernel module is not loaded), no libnvidia-ml.so.1 in the dynamic linker's cache, NVML says
the driver is not loaded, or it counts no GPU. Any other NVML failure fails. CI has no GPU,
so there these tests skip even under GPUHOOK_STRICT=1.
"""

import os
import subprocess
import time

import pytest

from gpuhook import config as cfg
from gpuhook import discover, nvml
from gpuhook.errors import NvmlError
from gpuhook.health import actions, checks, engine, owners, store

pytestmark = pytest.mark.device

DRIVER_NOT_LOADED = 9  # nvml.h NVML_ERROR_DRIVER_NOT_LOADED
PROC_VERSION = "/proc/driver/nvidia/version"


def system_nvml_library():
    """The absolute path of the system's libnvidia-ml.so.1 (the dynamic linker's cache), or None.

    By path, not by soname: earlier tests in the same process load the *simulated*
    libnvidia-ml.so.1, and dlopen of a bare soname would hand that one back."""
    done = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, env={"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"})
    # How ldconfig -p tags this machine's 64-bit libraries ("(libc6,x86-64)").
    tag = {"x86_64": "x86-64", "aarch64": "aarch64", "ppc64le": "64bit"}.get(os.uname().machine, os.uname().machine)
    for line in done.stdout.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith(nvml.SYSTEM_LIBRARY + " ") and tag.lower() in name.lower():
            return path
    return None


def real_gpus(library: str) -> tuple:
    """The host's GPUs as the real NVML sees them; skips where there is no driver or GPU."""
    try:
        with nvml.Session(library) as session:
            inventory = session.inventory()
    except NvmlError as err:
        if err.code == DRIVER_NOT_LOADED:
            pytest.skip(f"no NVIDIA driver: {err.one_line()}")
        raise
    if not inventory.gpus:
        pytest.skip("the NVIDIA driver reports no GPU")
    # What answered is the real driver, not a simulated library: both name the same version.
    assert inventory.driver_version == discover.driver_version("/proc"), library
    return inventory.gpus


@pytest.fixture(scope="module")
def library():
    if not os.path.exists(PROC_VERSION):
        pytest.skip(f"no NVIDIA driver: {PROC_VERSION} does not exist (the kernel module is not loaded)")
    path = system_nvml_library()
    if path is None:
        pytest.skip(f"no NVIDIA driver: no {nvml.SYSTEM_LIBRARY} in the dynamic linker's cache")
    return path


@pytest.fixture(scope="module")
def gpus(library):
    assert engine.wait_for_stragglers(30)  # no simulated NVML session may still be open
    return real_gpus(library)


@pytest.fixture
def config(tmp_path, library):
    return cfg.from_mapping({"state-dir": str(tmp_path / "run"), "log-file": str(tmp_path / "gpuhook.log"),
                             "nvml-library": library})


def usable(gpus) -> list:
    return [g.uuid for g in gpus if not g.lost]


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
def test_a_gpu_nobody_uses_is_reset_and_passes_again(gpus, config):
    with nvml.Session(nvml.library_path(config)) as session:
        idle = [g.uuid for g in gpus if not g.lost and not g.mig_mode and not session.health(g.uuid).processes]
    if not idle:
        pytest.skip("every GPU is in use or in MIG mode; resetting one would disturb its users")
    uuid = idle[0]
    action = actions.reset(config, uuid, timeout=120)
    assert action.ok, action.detail
    print(f"reset of {uuid}: {action.seconds:.2f} s")
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
