"""gpuhook.discover.nvml, the NVML backend, against the simulated NVML; and its import boundary."""

import os
import shutil
import subprocess
import sys
import threading
import time
import pytest
from gpuhook import config as cfg
from gpuhook.discover import nvml
from gpuhook.discover import proc as discover
from gpuhook.errors import HostError, NvmlError
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml
from conftest import REPO, private_nvml_state, require_root_tools


MIG_GPU = 1


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("backend") / "host"), gpus=3, mig={MIG_GPU: []},
                         brand="tesla")


@pytest.fixture
def state(sim, tmp_path, monkeypatch):
    """This test's copy of the NVML state; the library and nvidia-smi read it."""
    return private_nvml_state(sim, tmp_path, monkeypatch)


@pytest.fixture
def session(sim, state):
    with nvml.Session(sim["nvml_library"]) as opened:
        yield opened


def test_inventory_matches_the_proc_files_and_the_mig_layout(sim, session):
    inventory = session.inventory()
    assert (inventory.driver_version, inventory.cuda_version) == ("550.54.15", "12.4")
    from_proc = discover.gpus(f"{sim['directory']}/proc")
    assert [(g.index, g.uuid, g.minor, g.bus_id) for g in inventory.gpus] == \
           [(g.index, g.uuid, g.minor, g.bus_id) for g in from_proc]
    for gpu in inventory.gpus:
        assert (gpu.model, gpu.brand, gpu.arch, gpu.lost) == (simhost.DEFAULT_MODEL, "tesla", "9.0", False)
    plain, mig = inventory.gpus[0], inventory.gpus[MIG_GPU]
    assert (plain.mig_mode, plain.mig_mode_pending, plain.mig_devices) == (False, False, ())
    assert (mig.mig_mode, mig.mig_mode_pending) == (True, True)
    expected = sim["gpus"][MIG_GPU]["mig_devices"]
    fields = ("index", "uuid", "gpu_instance_id", "compute_instance_id", "memory_total")
    assert [tuple(getattr(d, f) for f in fields) for d in mig.mig_devices] == \
           [tuple(d[f] for f in fields) for d in expected]
    assert mig.mig_devices[0].name == f"{simhost.DEFAULT_MODEL} MIG {simhost.DEFAULT_MIG_LAYOUT[0]}"


def test_a_gpu_that_cannot_do_mig_reports_none(session, state):
    simnvml.set_gpu(state, 0, mig_capable=False)
    gpu = session.gpu(0)
    assert (gpu.mig_mode, gpu.mig_mode_pending, gpu.mig_devices) == (None, None, ())


def test_a_lost_gpu_is_part_of_the_inventory_not_an_error(session, state):
    simnvml.set_gpu(state, 2, lost=True)
    gpus = session.inventory().gpus
    assert gpus[2].lost and gpus[2].index == 2 and gpus[2].uuid is None
    assert not gpus[0].lost and gpus[0].uuid


def test_every_brand_maps_to_its_constraint_token(session, state):
    for name in nvml.BRANDS:
        simnvml.set_gpu(state, 0, brand=name)
        assert session.gpu(0).brand == name
    assert nvml.brand_name(17) == nvml.brand_name(-1) == "unknown"


def test_a_healthy_gpu(sim, session):
    health = session.health(sim["gpus"][0]["uuid"])
    assert health == nvml.Health(
        uuid=sim["gpus"][0]["uuid"], lost=False, lost_in=None, processes=(), memory_total=simhost.MEMORY_TOTAL,
        memory_used=0, ecc=nvml.EccCounts(0, 0, 0, 0), retired_pages=None,
        remapped_rows=nvml.RemappedRows(0, 0, False, False), memory_reserved=simhost.MEMORY_RESERVED)


def test_every_fault_shows_in_the_health_facts(sim, session, state):
    uuid = sim["gpus"][0]["uuid"]
    simnvml.set_gpu(state, 0, memory_used=5 << 20, ecc_volatile_uncorrected=2, ecc_aggregate_corrected=7,
                    remapped_rows_pending=True, remapped_rows_uncorrectable=1, remapped_rows_failure=True,
                    compute_processes=[simnvml.process(os.getpid(), 1 << 20)],
                    graphics_processes=[simnvml.process(4194000, 2 << 20, stale=True)])
    health = session.health(uuid)
    assert health.processes == (nvml.Process(os.getpid(), 1 << 20, "compute", None, None),
                                nvml.Process(4194000, 2 << 20, "graphics", None, None))
    assert health.memory_used == (5 << 20) + (3 << 20)
    assert health.ecc == nvml.EccCounts(volatile_corrected=0, volatile_uncorrected=2, aggregate_corrected=7,
                                        aggregate_uncorrected=0)
    assert health.remapped_rows == nvml.RemappedRows(correctable=0, uncorrectable=1, pending=True, failure=True)


@pytest.fixture(scope="module")
def old_drivers(tmp_path_factory):
    """Hosts whose NVML has only what driver 470 (no _v3 process query, no v2 memory call) and
    driver 450 (no _v2 process query either) export."""
    require_root_tools("gcc", "ldconfig")
    base = tmp_path_factory.mktemp("old-drivers")
    return {470: simhost.build(str(base / "470"), gpus=1, driver_version="470.82.01", mig={0: []}),
            450: simhost.build(str(base / "450"), gpus=1, driver_version="450.80.02", cuda_version="11.0")}


@pytest.mark.parametrize("branch", [470, 450])
def test_an_older_driver_answers_through_the_versions_it_has(old_drivers, tmp_path, monkeypatch, branch):
    host = old_drivers[branch]
    state = private_nvml_state(host, tmp_path, monkeypatch)
    uuid = host["gpus"][0]["uuid"]
    simnvml.set_gpu(state, 0, memory_used=100 << 20,
                    compute_processes=[simnvml.process(os.getpid(), 1 << 30)],
                    graphics_processes=[simnvml.process(os.getpid(), 2 << 20)])
    with nvml.Session(host["nvml_library"]) as session:
        health = session.health(uuid)
        assert health.processes == (nvml.Process(os.getpid(), 1 << 30, "compute", None, None),
                                    nvml.Process(os.getpid(), 2 << 20, "graphics", None, None))
        # Without the v2 memory call, "used" includes the driver's reserve and none is reported apart.
        assert (health.memory_used, health.memory_reserved) == \
               ((100 << 20) + (1 << 30) + (2 << 20) + simhost.MEMORY_RESERVED, None)
        assert session.health(uuid) == health  # what the library lacks is remembered, not tried again


def test_processes_on_a_mig_device_keep_their_instance_ids_on_driver_470(old_drivers, tmp_path, monkeypatch):
    host = old_drivers[470]
    state = private_nvml_state(host, tmp_path, monkeypatch)
    mig = host["gpus"][0]["mig_devices"][0]
    simnvml.set_gpu(state, 0, compute_processes=[simnvml.process(os.getpid(), 1 << 20,
                                                                 gpu_instance_id=mig["gpu_instance_id"])])
    with nvml.Session(host["nvml_library"]) as session:
        assert session.health(mig["uuid"]).processes == \
               (nvml.Process(os.getpid(), 1 << 20, "compute", mig["gpu_instance_id"], 0),)


def test_persistence_and_mig_mode_for_a_reset(sim, session, state):
    simnvml.set_gpu(state, 0, persistence_mode=True)
    assert session.reset_facts(sim["gpus"][0]["uuid"]) == nvml.ResetFacts(True, False, 0)
    session.set_persistence(sim["gpus"][0]["uuid"], False)
    assert simnvml.load(state)["gpus"][0]["persistence_mode"] is False
    assert session.reset_facts(sim["gpus"][MIG_GPU]["uuid"]) == \
           nvml.ResetFacts(False, True, len(simhost.DEFAULT_MIG_LAYOUT))
    simnvml.set_gpu(state, 2, mig_capable=False)
    assert session.reset_facts(sim["gpus"][2]["uuid"]) == nvml.ResetFacts(False, None, 0)


def test_page_retirement_on_a_pre_ampere_gpu(sim, session, state):
    simnvml.set_gpu(state, 2, compute_capability="7.0", retired_pages_single_bit=2, retired_pages_pending=True)
    health = session.health(sim["gpus"][2]["uuid"])
    assert health.retired_pages == nvml.RetiredPages(single_bit=2, double_bit=0, pending=True)
    assert health.remapped_rows is None


def test_unsupported_queries_read_as_none(sim, session, state):
    simnvml.set_gpu(state, 0, ecc_enabled=False)
    health = session.health(sim["gpus"][0]["uuid"])
    assert (health.ecc, health.retired_pages) == (None, None) and health.remapped_rows is not None
    mig = sim["gpus"][MIG_GPU]["mig_devices"][0]
    simnvml.set_gpu(state, MIG_GPU, compute_processes=[
        simnvml.process(os.getpid(), 1 << 20, gpu_instance_id=mig["gpu_instance_id"])])
    on_mig = session.health(mig["uuid"])
    assert (on_mig.ecc, on_mig.retired_pages, on_mig.remapped_rows) == (None, None, None)
    assert on_mig.memory_total == mig["memory_total"] and on_mig.memory_used == 1 << 20
    assert on_mig.processes == (nvml.Process(os.getpid(), 1 << 20, "compute", mig["gpu_instance_id"], 0),)


def test_a_lost_gpu_is_a_health_fact_naming_the_call(sim, session, state):
    uuid = sim["gpus"][2]["uuid"]
    simnvml.set_gpu(state, 2, lost=True)
    health = session.health(uuid)
    assert (health.uuid, health.lost, health.lost_in) == (uuid, True, "nvmlDeviceGetHandleByUUID")
    assert health.processes is None and health.ecc is None


def test_nvml_errors_name_the_call_and_the_gpu(session):
    with pytest.raises(NvmlError) as err:
        session.health("GPU-00000000-0000-0000-0000-000000000000")
    assert err.value.message == ("NVML nvmlDeviceGetHandleByUUID for GPU GPU-00000000-0000-0000-0000-000000000000 "
                                 "failed: Not Found")
    assert err.value.code == 6 and err.value.call == "nvmlDeviceGetHandleByUUID"
    assert isinstance(err.value, HostError)
    with pytest.raises(NvmlError, match=r"NVML nvmlDeviceGetHandleByIndex for GPU 9 failed: Invalid Argument"):
        session.gpu(9)


def test_a_missing_driver_fails_the_session_with_nvmls_reason(sim, state):
    os.unlink(state)
    with pytest.raises(NvmlError, match="NVML nvmlInit failed: Driver Not Loaded"):
        nvml.Session(sim["nvml_library"]).open()


def test_the_session_always_shuts_nvml_down(sim, state):
    with pytest.raises(RuntimeError, match="boom"):
        with nvml.Session(sim["nvml_library"]) as opened:
            pynvml = opened.pynvml
            assert pynvml._nvmlLib_refcount == 1
            raise RuntimeError("boom")
    assert pynvml._nvmlLib_refcount == 0
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    closed = nvml.Session(sim["nvml_library"])
    with pytest.raises(HostError, match="not open"):
        closed.inventory()


def test_sessions_nest_on_one_library_but_not_across_two(sim, state, tmp_path):
    with nvml.Session(sim["nvml_library"]) as outer:
        with nvml.Session(sim["nvml_library"]) as inner:
            assert inner.driver_version() == outer.driver_version()
        assert outer.cuda_version() == "12.4"
        other = str(tmp_path / "libnvidia-ml.so.1")
        shutil.copy(sim["nvml_library"], other)
        with pytest.raises(NvmlError, match="cannot also load"):
            nvml.Session(other).open()
    with nvml.Session(other) as switched:  # once nothing is open, another library is fine
        assert switched.driver_version() == "550.54.15"


def test_health_of_many_gpus_runs_in_parallel(sim, session, state):
    for index in range(3):
        simnvml.set_gpu(state, index, handle_latency_ms=500)
    results = {}

    def check(uuid):
        results[uuid] = session.health(uuid)

    threads = [threading.Thread(target=check, args=(g["uuid"],)) for g in sim["gpus"]]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert len(results) == 3 and all(not h.lost for h in results.values())
    # Parallel: well below the 1.5 s one GPU after the other would take (a loaded machine
    # may be slow, but not 3x slow at sleeping).
    assert 0.5 <= elapsed < 1.5 * 0.8, f"3 GPUs with 0.5 s each took {elapsed:.2f} s"


def test_library_path_follows_the_config(sim, tmp_path):
    assert nvml.library_path(cfg.load(sim["config"])) == sim["nvml_library"]
    assert nvml.library_path(cfg.from_mapping({})) == "libnvidia-ml.so.1"
    from_cache = nvml.library_path(cfg.from_mapping({"driver-root": f"{sim['directory']}/driver"}))
    assert os.path.realpath(from_cache) == os.path.realpath(sim["nvml_library"])
    empty = tmp_path / "root"
    (empty / "etc").mkdir(parents=True)
    shutil.copy("/etc/ld.so.cache", empty / "etc" / "ld.so.cache")
    with pytest.raises(HostError, match="no libnvidia-ml.so.1 among the driver.s libraries"):
        nvml.library_path(cfg.from_mapping({"driver-root": str(empty)}))


def test_the_backend_finds_pynvml_under_the_hooks_interpreter_flags(sim, state):
    # The runtime starts the hook as `python3 -I -S launch.py`: no site-packages until asked.
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from gpuhook.discover import nvml\n"
            f"with nvml.Session({sim['nvml_library']!r}) as s: print(s.driver_version())")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", simnvml.ENV_VAR: state}, cwd="/")
    assert (done.returncode, done.stdout.strip()) == (0, "550.54.15"), done.stderr
