"""The simulated NVML (gpuhook simulate's libnvidia-ml) driven by the real nvidia-ml-py.

Every test gets its own copy of the host's nvml.json (GPUHOOK_NVML_STATE points the library
and nvidia-smi at it), so tests edit GPUs freely on one shared simulated host.
"""

import ctypes
import os
import subprocess
import threading
import time

import pynvml
import pytest

from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

from conftest import private_nvml_state, require_root_tools

MIG_GPU = 3
MIG_LAYOUT = ["3g.40gb", "2g.20gb", "1g.10gb"]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("nvmlsim") / "host"), gpus=4, mig={MIG_GPU: MIG_LAYOUT})


@pytest.fixture
def state(sim, tmp_path, monkeypatch):
    """This test's copy of the NVML state; the library and nvidia-smi read it."""
    return private_nvml_state(sim, tmp_path, monkeypatch)


def load_library(sim):
    with pynvml.libLoadLock:
        pynvml.nvmlLib = ctypes.CDLL(sim["nvml_library"])
        pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def nv(sim, state):
    """pynvml initialised against the simulated library; shut down afterwards."""
    load_library(sim)
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


def error_of(call, *args) -> int:
    with pytest.raises(pynvml.NVMLError) as err:
        call(*args)
    return err.value.value


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def smi(sim, state, *args, timeout=20):
    return subprocess.run([f"{sim['directory']}/driver/usr/bin/nvidia-smi", *args], capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", simnvml.ENV_VAR: state})


def test_system_queries_report_the_simulated_driver(nv, sim):
    assert nv.nvmlSystemGetDriverVersion() == sim["driver_version"] == "550.54.15"
    assert nv.nvmlSystemGetCudaDriverVersion() == nv.nvmlSystemGetCudaDriverVersion_v2() == 12040
    assert nv.nvmlSystemGetNVMLVersion() == "12.550.54.15"
    assert nv.nvmlDeviceGetCount() == 4


def test_each_gpu_has_the_identity_of_its_proc_files(nv, sim):
    for gpu in sim["gpus"]:
        by_index = nv.nvmlDeviceGetHandleByIndex(gpu["index"])
        nvml_bus = "0000" + gpu["bus_id"].upper()
        others = [nv.nvmlDeviceGetHandleByUUID(gpu["uuid"])]
        others += [nv.nvmlDeviceGetHandleByPciBusId(bus) for bus in (nvml_bus, gpu["bus_id"], gpu["bus_id"][5:])]
        for other in others:
            assert ctypes.addressof(other.contents) == ctypes.addressof(by_index.contents)
        assert nv.nvmlDeviceGetUUID(by_index) == gpu["uuid"]
        assert nv.nvmlDeviceGetName(by_index) == gpu["model"]
        assert nv.nvmlDeviceGetMinorNumber(by_index) == gpu["minor"]
        assert nv.nvmlDeviceGetIndex(by_index) == gpu["index"]
        assert nv.nvmlDeviceGetBrand(by_index) == nv.NVML_BRAND_NVIDIA
        assert nv.nvmlDeviceGetCudaComputeCapability(by_index) == (9, 0)
        pci = nv.nvmlDeviceGetPciInfo(by_index)
        assert pci.busId == nvml_bus and pci.busIdLegacy == nvml_bus[4:]
        assert (pci.domain, pci.bus, pci.device) == (0, int(gpu["bus_id"][5:7], 16), 0)
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (0x233010DE, 0x16C110DE)


def test_every_brand_round_trips(nv, state):
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    for value, name in enumerate(simnvml.BRANDS):
        simnvml.set_gpu(state, 0, brand=name)
        assert nv.nvmlDeviceGetBrand(handle) == value, name


def test_memory_counts_leftovers_plus_the_processes_still_alive(nv, state):
    gone = dead_pid()
    simnvml.set_gpu(state, 1, memory_used=100 << 20, compute_processes=[
        simnvml.process(os.getpid(), 1 << 30), simnvml.process(gone, 2 << 30),
        simnvml.process(gone, 4 << 30, stale=True)],
        graphics_processes=[simnvml.process(os.getpid(), 8 << 20)])
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    used = (100 << 20) + (1 << 30) + (4 << 30) + (8 << 20)
    v2 = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
    assert (v2.total, v2.reserved, v2.used) == (simhost.MEMORY_TOTAL, simhost.MEMORY_RESERVED, used)
    assert v2.free == simhost.MEMORY_TOTAL - simhost.MEMORY_RESERVED - used
    # Version 1 counts the driver's reserve as used, as the real driver does.
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    v1_used = used + simhost.MEMORY_RESERVED
    assert (memory.total, memory.used, memory.free) == (simhost.MEMORY_TOTAL, v1_used, simhost.MEMORY_TOTAL - v1_used)
    compute = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in compute] == [
        (os.getpid(), 1 << 30, 0xFFFFFFFF), (gone, 4 << 30, 0xFFFFFFFF)]
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses_v2(handle)] == [os.getpid(), gone]
    graphics = nv.nvmlDeviceGetGraphicsRunningProcesses(handle)
    assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(os.getpid(), 8 << 20)]
    assert nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(0)) == []


def test_raw_abi_edges(nv, state):
    """Calls pynvml does not make: v1 process structs, short buffers, wrong struct versions."""
    simnvml.set_gpu(state, 0, compute_processes=[simnvml.process(os.getpid(), 12345)])
    lib = nv.nvmlLib
    handle = nv.nvmlDeviceGetHandleByIndex(0)

    class ProcessV1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    assert ctypes.sizeof(ProcessV1) == 16 and ctypes.sizeof(nv.c_nvmlProcessInfo_v3_t) == 24
    count = ctypes.c_uint(0)
    status = lib.nvmlDeviceGetComputeRunningProcesses(handle, ctypes.byref(count), None)
    assert status == nv.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 1
    infos = (ProcessV1 * 1)()
    assert lib.nvmlDeviceGetComputeRunningProcesses(handle, ctypes.byref(count), infos) == nv.NVML_SUCCESS
    assert (infos[0].pid, infos[0].usedGpuMemory) == (os.getpid(), 12345)

    name = ctypes.create_string_buffer(8)
    assert lib.nvmlDeviceGetName(handle, name, ctypes.c_uint(8)) == nv.NVML_ERROR_INSUFFICIENT_SIZE
    uuid = ctypes.create_string_buffer(96)
    assert lib.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(96)) == nv.NVML_SUCCESS
    memory = nv.c_nvmlMemory_v2_t()
    memory.version = 1
    assert lib.nvmlDeviceGetMemoryInfo_v2(handle, ctypes.byref(memory)) == nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    for symbol in ("nvmlInit", "nvmlInit_v2", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                   "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2"):
        assert hasattr(lib, symbol), symbol
    assert not hasattr(lib, "sj_parse") and not hasattr(lib, "sim_state_load")  # only NVML's API is exported
    bogus = ctypes.cast(ctypes.c_void_p(id(name)), nv.c_nvmlDevice_t)
    assert lib.nvmlDeviceGetMinorNumber(bogus, ctypes.byref(count)) == nv.NVML_ERROR_INVALID_ARGUMENT


def test_ecc_counts_and_unsupported_ecc(nv, state):
    simnvml.set_gpu(state, 0, ecc_volatile_corrected=1, ecc_volatile_uncorrected=2, ecc_aggregate_corrected=30,
                    ecc_aggregate_uncorrected=40)
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    got = {(error, counter): nv.nvmlDeviceGetTotalEccErrors(handle, error, counter)
           for error in (nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
           for counter in (nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC)}
    assert got == {(0, 0): 1, (1, 0): 2, (0, 1): 30, (1, 1): 40}
    simnvml.set_gpu(state, 0, ecc_enabled=False)
    assert error_of(nv.nvmlDeviceGetTotalEccErrors, handle, 1, 0) == nv.NVML_ERROR_NOT_SUPPORTED


def test_retired_pages_exist_before_ampere_and_remapped_rows_after(nv, state):
    simnvml.set_gpu(state, 0, compute_capability="7.0", retired_pages_single_bit=1, retired_pages_double_bit=3,
                    retired_pages_pending=True)
    simnvml.set_gpu(state, 1, remapped_rows_correctable=5, remapped_rows_uncorrectable=2, remapped_rows_pending=True,
                    remapped_rows_failure=True)
    volta, hopper = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    cause = nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    assert len(nv.nvmlDeviceGetRetiredPages(volta, cause)) == 3
    assert len(nv.nvmlDeviceGetRetiredPages(volta, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)) == 1
    pages = nv.nvmlDeviceGetRetiredPages_v2(volta, cause)
    assert len({p["address"] for p in pages}) == 3 and all(p["timestamp"] > 0 for p in pages)
    assert nv.nvmlDeviceGetRetiredPagesPendingStatus(volta) == nv.NVML_FEATURE_ENABLED
    assert error_of(nv.nvmlDeviceGetRemappedRows, volta) == nv.NVML_ERROR_NOT_SUPPORTED
    assert nv.nvmlDeviceGetRemappedRows(hopper) == (5, 2, 1, 1)
    assert error_of(nv.nvmlDeviceGetRetiredPages, hopper, cause) == nv.NVML_ERROR_NOT_SUPPORTED
    assert error_of(nv.nvmlDeviceGetRetiredPagesPendingStatus, hopper) == nv.NVML_ERROR_NOT_SUPPORTED


def test_a_lost_gpu_answers_gpu_is_lost_to_everything(nv, state):
    before = nv.nvmlDeviceGetHandleByIndex(2)
    uuid = nv.nvmlDeviceGetUUID(before)
    simnvml.set_gpu(state, 2, lost=True)
    lost = nv.NVML_ERROR_GPU_IS_LOST
    assert error_of(nv.nvmlDeviceGetHandleByIndex, 2) == lost
    assert error_of(nv.nvmlDeviceGetHandleByUUID, uuid) == lost
    for call in (nv.nvmlDeviceGetUUID, nv.nvmlDeviceGetMemoryInfo, nv.nvmlDeviceGetComputeRunningProcesses,
                 nv.nvmlDeviceGetRemappedRows, nv.nvmlDeviceGetMigMode, nv.nvmlDeviceGetTemperature):
        args = (before, 0) if call is nv.nvmlDeviceGetTemperature else (before,)
        assert error_of(call, *args) == lost, call.__name__
    with pytest.raises(nv.NVMLError_GpuIsLost, match="GPU is lost"):
        nv.nvmlDeviceGetName(before)
    assert nv.nvmlDeviceGetCount() == 4 and nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1))


def test_mig_devices(nv, sim, state):
    parent = nv.nvmlDeviceGetHandleByIndex(MIG_GPU)
    assert nv.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    assert nv.nvmlDeviceGetMaxMigDeviceCount(nv.nvmlDeviceGetHandleByIndex(0)) == 0
    assert nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    expected = sim["gpus"][MIG_GPU]["mig_devices"]
    assert [d["profile"] for d in expected] == MIG_LAYOUT
    for i, device in enumerate(expected):
        mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        assert nv.nvmlDeviceGetUUID(mig) == device["uuid"] and device["uuid"].startswith("MIG-")
        assert nv.nvmlDeviceGetName(mig) == f"{sim['gpus'][MIG_GPU]['model']} MIG {device['profile']}"
        assert nv.nvmlDeviceGetGpuInstanceId(mig) == device["gpu_instance_id"]
        assert nv.nvmlDeviceGetComputeInstanceId(mig) == device["compute_instance_id"]
        assert nv.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert nv.nvmlDeviceGetMemoryInfo(mig).total == device["memory_total"]
        parent_of_mig = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert nv.nvmlDeviceGetUUID(parent_of_mig) == sim["gpus"][MIG_GPU]["uuid"]
        assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(device["uuid"])) == device["uuid"]
        for unsupported in (nv.nvmlDeviceGetMinorNumber, nv.nvmlDeviceGetPciInfo, nv.nvmlDeviceGetMigMode):
            assert error_of(unsupported, mig) == nv.NVML_ERROR_NOT_SUPPORTED
        assert error_of(nv.nvmlDeviceGetTotalEccErrors, mig, 1, 0) == nv.NVML_ERROR_NOT_SUPPORTED
    assert error_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, parent, len(expected)) == nv.NVML_ERROR_NOT_FOUND
    assert error_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, parent, 7) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert error_of(nv.nvmlDeviceGetGpuInstanceId, parent) == nv.NVML_ERROR_NOT_SUPPORTED
    assert error_of(nv.nvmlDeviceGetRemappedRows, parent) == nv.NVML_ERROR_NOT_SUPPORTED  # not while MIG is on
    assert nv.nvmlDeviceIsMigDeviceHandle(parent).value == 0


def test_processes_and_memory_of_a_mig_device_are_its_own(nv, sim, state):
    first, second = sim["gpus"][MIG_GPU]["mig_devices"][:2]
    simnvml.set_gpu(state, MIG_GPU, compute_processes=[
        simnvml.process(os.getpid(), 1 << 30, gpu_instance_id=first["gpu_instance_id"]),
        simnvml.process(os.getpid(), 2 << 30, gpu_instance_id=second["gpu_instance_id"])])
    parent = nv.nvmlDeviceGetHandleByIndex(MIG_GPU)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    assert [(p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(mig)] == [(1 << 30, first["gpu_instance_id"], 0)]
    assert nv.nvmlDeviceGetMemoryInfo(mig).used == 1 << 30
    assert len(nv.nvmlDeviceGetComputeRunningProcesses(parent)) == 2
    assert nv.nvmlDeviceGetMemoryInfo(parent, version=nv.nvmlMemory_v2).used == 3 << 30


def test_mig_handles_vanish_when_mig_is_turned_off(nv, state):
    parent = nv.nvmlDeviceGetHandleByIndex(MIG_GPU)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    uuid = nv.nvmlDeviceGetUUID(mig)
    simnvml.set_gpu(state, MIG_GPU, mig_mode=False, mig_mode_pending=False)
    assert error_of(nv.nvmlDeviceGetUUID, mig) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert error_of(nv.nvmlDeviceGetHandleByUUID, uuid) == nv.NVML_ERROR_NOT_FOUND
    simnvml.set_gpu(state, MIG_GPU, mig_capable=False)
    assert error_of(nv.nvmlDeviceGetMigMode, parent) == nv.NVML_ERROR_NOT_SUPPORTED
    assert error_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, parent, 0) == nv.NVML_ERROR_NOT_SUPPORTED


def test_bad_arguments_and_unknown_devices(nv):
    assert error_of(nv.nvmlDeviceGetHandleByIndex, 4) == nv.NVML_ERROR_INVALID_ARGUMENT
    assert error_of(nv.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000") == nv.NVML_ERROR_NOT_FOUND
    assert error_of(nv.nvmlDeviceGetHandleByPciBusId, "00000000:99:00.0") == nv.NVML_ERROR_NOT_FOUND
    assert error_of(nv.nvmlDeviceGetHandleByPciBusId, "not-a-bus-id") == nv.NVML_ERROR_INVALID_ARGUMENT
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    for call, args in ((nv.nvmlDeviceGetTemperature, (handle, 0)), (nv.nvmlDeviceGetPowerUsage, (handle,)),
                       (nv.nvmlDeviceGetUtilizationRates, (handle,))):
        assert error_of(call, *args) == nv.NVML_ERROR_NOT_SUPPORTED, call.__name__


def test_error_strings_are_nvidias(nv):
    texts = {nv.NVML_SUCCESS: "Success", nv.NVML_ERROR_UNINITIALIZED: "Uninitialized",
             nv.NVML_ERROR_NOT_SUPPORTED: "Not Supported", nv.NVML_ERROR_NOT_FOUND: "Not Found",
             nv.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded", nv.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
             nv.NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size", nv.NVML_ERROR_UNKNOWN: "Unknown Error"}
    for code, text in texts.items():
        assert nv.nvmlErrorString(code) == text


def test_changes_to_the_state_show_up_in_a_running_session(nv, state):
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0) == 0
    simnvml.set_gpu(state, 0, ecc_volatile_uncorrected=7)
    assert nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0) == 7
    simnvml.set_host(state, driver_version="555.42.02", cuda_version="12.5")
    assert (nv.nvmlSystemGetDriverVersion(), nv.nvmlSystemGetCudaDriverVersion()) == ("555.42.02", 12050)


def test_calls_need_an_initialised_library(sim, state):
    load_library(sim)
    assert pynvml.nvmlLib.nvmlDeviceGetCount_v2(ctypes.byref(ctypes.c_uint())) == pynvml.NVML_ERROR_UNINITIALIZED
    assert pynvml.nvmlLib.nvmlShutdown() == pynvml.NVML_ERROR_UNINITIALIZED
    pynvml.nvmlInit()
    pynvml.nvmlInit()  # NVML counts initialisations
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 4
    pynvml.nvmlShutdown()
    assert pynvml.nvmlLib.nvmlDeviceGetCount_v2(ctypes.byref(ctypes.c_uint())) == pynvml.NVML_ERROR_UNINITIALIZED


@pytest.mark.parametrize("content,code,message", [
    (None, pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "No such file or directory"),
    ('{"format": 1, "gpus": [', pynvml.NVML_ERROR_UNINITIALIZED, "not valid JSON: line 1 column 24: unexpected end"),
    ('{"format": 1, "driver_version": "550.54.15", "cuda_version": "12.4", "gpus": [], "colour": 1}',
     pynvml.NVML_ERROR_UNINITIALIZED, "colour: unknown field"),
    ('{"format": 1, "driver_version": "550.54.15", "cuda_version": "12.4", "gpus": [{"uuid": "GPU-1", '
     '"name": "x", "minor": 0, "bus_id": "00000000:18:00.0", "reset_fail": true}]}',
     pynvml.NVML_ERROR_UNINITIALIZED, "gpus[0].reset_fail: unknown field"),
    ('{"format": 1, "driver_version": "550.54.15", "cuda_version": "12.4", "gpus": [{"uuid": "GPU-1", '
     '"name": "x", "minor": -1, "bus_id": "00000000:18:00.0"}]}',
     pynvml.NVML_ERROR_UNINITIALIZED, "gpus[0].minor: must be a whole number >= 0"),
])
def test_a_missing_or_bad_state_file_fails_init_with_the_reason(sim, state, capfd, content, code, message):
    if content is None:
        os.unlink(state)
    else:
        with open(state, "w") as f:
            f.write(content)
    load_library(sim)
    assert error_of(pynvml.nvmlInit) == code
    err = capfd.readouterr().err
    assert "gpuhook simulated NVML" in err and state in err and message in err, err


def test_a_state_file_damaged_mid_session_fails_calls_until_repaired(nv, state, capfd):
    with open(state) as f:
        good = f.read()
    with open(state + ".new", "w") as f:
        f.write(good[:-20])
    os.rename(state + ".new", state)
    assert error_of(nv.nvmlDeviceGetCount) == nv.NVML_ERROR_UNINITIALIZED
    assert "not valid JSON" in capfd.readouterr().err
    with open(state + ".new", "w") as f:
        f.write(good)
    os.rename(state + ".new", state)
    assert nv.nvmlDeviceGetCount() == 4


def test_call_latency_applies_to_every_call(nv, state):
    simnvml.set_host(state, call_latency_ms=200)
    start = time.monotonic()
    nv.nvmlDeviceGetCount()
    nv.nvmlSystemGetDriverVersion()
    assert time.monotonic() - start >= 0.4


def test_init_latency_applies_to_init_only(sim, state):
    simnvml.set_host(state, init_latency_ms=400)
    load_library(sim)
    start = time.monotonic()
    pynvml.nvmlInit()
    try:
        assert time.monotonic() - start >= 0.4
        start = time.monotonic()
        pynvml.nvmlDeviceGetCount()
        assert time.monotonic() - start < 0.4  # no second helping of the 0.4 s latency
        pynvml.nvmlInit()  # nested, as a daemon's sessions are: only the first attaches
        pynvml.nvmlShutdown()
        assert time.monotonic() - start < 0.4
    finally:
        pynvml.nvmlShutdown()


def test_per_gpu_latency_runs_in_parallel_across_threads(nv, state):
    for index in range(4):
        simnvml.set_gpu(state, index, handle_latency_ms=400)

    def lookup(index, out):
        out[index] = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(index))

    found = {}
    start = time.monotonic()
    lookup(0, found)
    sequential = time.monotonic() - start
    threads = [threading.Thread(target=lookup, args=(i, found)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parallel = time.monotonic() - start
    assert len(found) == 4
    assert sequential >= 0.4
    assert parallel < 4 * 0.4 * 0.75, f"4 lookups of 0.4 s took {parallel:.2f} s: the library serialises its latency"


# ---- nvidia-smi --gpu-reset ------------------------------------------------------------

def faulty(state, index, **extra):
    """Give GPU `index` everything a reset clears (and some things it keeps)."""
    simnvml.set_gpu(state, index, ecc_volatile_corrected=3, ecc_volatile_uncorrected=2, ecc_aggregate_uncorrected=9,
                    retired_pages_pending=True, retired_pages_double_bit=1, remapped_rows_pending=True,
                    remapped_rows_uncorrectable=1, memory_used=1 << 30,
                    compute_processes=[simnvml.process(dead_pid(), 1 << 20, stale=True)], **extra)


def test_reset_clears_what_a_real_reset_clears(nv, sim, state):
    faulty(state, 1)
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0) == 2
    nv.nvmlShutdown()  # an NVML client keeps the GPU from being reset (below)
    done = smi(sim, state, "--gpu-reset", "-i", sim["gpus"][1]["uuid"])
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(1)
    assert done.returncode == 0, done.stderr
    assert "GPU 00000000:28:00.0 was successfully reset." in done.stdout
    gpu = simnvml.load(state)["gpus"][1]
    ecc = (gpu["ecc_volatile_corrected"], gpu["ecc_volatile_uncorrected"], gpu["ecc_aggregate_uncorrected"])
    assert ecc == (0, 0, 9)
    assert not gpu["retired_pages_pending"] and gpu["retired_pages_double_bit"] == 1
    assert not gpu["remapped_rows_pending"] and gpu["remapped_rows_uncorrectable"] == 1
    assert gpu["memory_used"] == 0 and gpu["compute_processes"] == [] and gpu["reset_count"] == 1
    assert nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0) == 0
    assert nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2).used == 0
    assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []
    assert simnvml.load(state)["gpus"][0]["reset_count"] == 0


@pytest.mark.parametrize("how", ["1", "00000000:28:00.0", "0000:28:00.0"])
def test_reset_takes_an_index_or_bus_id_too(sim, state, how):
    faulty(state, 1)
    done = smi(sim, state, "-r", "-i", how)
    assert done.returncode == 0, done.stderr
    assert simnvml.load(state)["gpus"][1]["reset_count"] == 1


def test_reset_applies_a_pending_mig_mode(sim, state):
    simnvml.set_gpu(state, MIG_GPU, mig_mode_pending=False)
    assert smi(sim, state, "--gpu-reset", "-i", str(MIG_GPU)).returncode == 0
    assert simnvml.load(state)["gpus"][MIG_GPU]["mig_mode"] is False


@pytest.mark.parametrize("fault,status,message", [
    ({"reset_fails": True}, 255, "Unable to reset GPU 00000000:28:00.0: Unknown Error"),
    ({"lost": True}, 15, "GPU is lost"),
])
def test_a_failing_reset_exits_non_zero_and_changes_nothing(sim, state, fault, status, message):
    faulty(state, 1, **fault)
    before = simnvml.load(state)
    done = smi(sim, state, "--gpu-reset", "-i", sim["gpus"][1]["uuid"])
    assert (done.returncode, message in done.stderr) == (status, True), done
    assert simnvml.load(state) == before


def test_a_reset_that_does_not_fix_reports_success_and_changes_nothing_else(sim, state):
    faulty(state, 1, reset_does_not_fix=True)
    before = simnvml.load(state)
    done = smi(sim, state, "--gpu-reset", "-i", sim["gpus"][1]["uuid"])
    assert done.returncode == 0 and "successfully reset" in done.stdout
    after = simnvml.load(state)
    assert after["gpus"][1].pop("reset_count") == 1
    before["gpus"][1].pop("reset_count")
    assert after == before


def test_a_hanging_reset_never_returns(sim, state):
    faulty(state, 1, reset_hangs=True)
    before = simnvml.load(state)
    with pytest.raises(subprocess.TimeoutExpired):
        smi(sim, state, "--gpu-reset", "-i", sim["gpus"][1]["uuid"], timeout=1.5)
    assert simnvml.load(state) == before


def test_reset_refuses_a_gpu_a_live_process_uses(sim, state):
    simnvml.set_gpu(state, 1, compute_processes=[simnvml.process(os.getpid(), 1 << 20)])
    done = smi(sim, state, "--gpu-reset", "-i", "1")
    assert done.returncode == 255 and "being used by some other process" in done.stderr
    assert f"pid {os.getpid()} is alive" in done.stderr
    assert simnvml.load(state)["gpus"][1]["compute_processes"] != []


def test_overlapping_resets_of_one_gpu_are_refused_and_counted(sim, state):
    simnvml.set_gpu(state, 1, reset_latency_ms=1500)
    argv = [f"{sim['directory']}/driver/usr/bin/nvidia-smi", "--gpu-reset", "-i", "1"]
    env = {"PATH": "/usr/bin:/bin", simnvml.ENV_VAR: state}
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    second = smi(sim, state, "--gpu-reset", "-i", "1")
    assert first.wait(timeout=20) == 0
    assert second.returncode == 255 and "already in progress" in second.stderr
    gpu = simnvml.load(state)["gpus"][1]
    assert (gpu["reset_count"], gpu["reset_overlaps"]) == (1, 1)


def test_parallel_resets_of_different_gpus_lose_no_update(sim, state):
    for index in range(3):
        faulty(state, index, reset_latency_ms=300)
    runs = [subprocess.Popen([f"{sim['directory']}/driver/usr/bin/nvidia-smi", "-r", "-i", str(i)],
                             env={simnvml.ENV_VAR: state}, stdout=subprocess.DEVNULL) for i in range(3)]
    assert [r.wait(timeout=20) for r in runs] == [0, 0, 0]
    gpus = simnvml.load(state)["gpus"]
    assert [g["reset_count"] for g in gpus[:3]] == [1, 1, 1]
    assert all(g["ecc_volatile_uncorrected"] == 0 for g in gpus[:3])


@pytest.mark.parametrize("args,status,message", [
    (["--gpu-reset", "-i", "GPU-nope"], 6, 'No devices were found matching "GPU-nope"'),
    (["--gpu-reset"], 2, "Invalid combination of input arguments"),
    (["--query-gpu=name"], 2, "Invalid combination of input arguments"),
])
def test_reset_usage_errors(sim, state, args, status, message):
    done = smi(sim, state, *args)
    assert done.returncode == status and message in done.stderr


def test_nvidia_smi_without_arguments_still_lists_device_nodes(sim, state):
    done = smi(sim, state)
    assert done.returncode == 0
    assert done.stdout.startswith(f"nvidia-smi (simulated by gpuhook, driver {sim['driver_version']})")


# ---- what the driver refuses: clients, persistence, NVLink peers ---------------------------

# A process that initialises the simulated NVML, says so, and keeps it open until stdin closes.
NVML_CLIENT = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.nvmlInit_v2() == 0
print("attached", flush=True)
sys.stdin.read()
lib.nvmlShutdown()
"""


def test_a_reset_is_refused_while_another_process_has_nvml_open(sim, state):
    faulty(state, 1)
    client = subprocess.Popen(["python3", "-c", NVML_CLIENT, sim["nvml_library"]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin", simnvml.ENV_VAR: state})
    try:
        assert client.stdout.readline().strip() == "attached"
        done = smi(sim, state, "--gpu-reset", "-i", "1")
        assert done.returncode == 255, done
        assert done.stderr.startswith("The following GPUs could not be reset:\n  GPU 00000000:28:00.0: In use by "
                                      "another client\n")
        assert simnvml.load(state)["gpus"][1]["reset_count"] == 0
    finally:
        client.communicate("", timeout=10)
    assert smi(sim, state, "--gpu-reset", "-i", "1").returncode == 0  # the client has shut NVML down


def test_a_reset_is_refused_while_this_process_has_nvml_open(nv, sim, state):
    done = smi(sim, state, "--gpu-reset", "-i", "0")
    assert done.returncode == 255 and "In use by another client" in done.stderr
    nv.nvmlShutdown()
    try:
        assert smi(sim, state, "--gpu-reset", "-i", "0").returncode == 0
    finally:
        nv.nvmlInit()


def test_persistence_mode_is_reported_set_through_nvml_and_blocks_a_reset(nv, sim, state):
    handle = nv.nvmlDeviceGetHandleByIndex(2)
    assert nv.nvmlDeviceGetPersistenceMode(handle) == nv.NVML_FEATURE_DISABLED
    nv.nvmlDeviceSetPersistenceMode(handle, nv.NVML_FEATURE_ENABLED)
    assert nv.nvmlDeviceGetPersistenceMode(handle) == nv.NVML_FEATURE_ENABLED
    assert simnvml.load(state)["gpus"][2]["persistence_mode"] is True
    nv.nvmlShutdown()
    try:
        done = smi(sim, state, "--gpu-reset", "-i", "2")
        assert done.returncode == 255 and "GPU 00000000:38:00.0: In use by another client" in done.stderr
        simnvml.set_gpu(state, 2, persistence_mode=False)
        assert smi(sim, state, "--gpu-reset", "-i", "2").returncode == 0
    finally:
        nv.nvmlInit()
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(nv.nvmlDeviceGetHandleByIndex(MIG_GPU), 0)
    assert error_of(nv.nvmlDeviceSetPersistenceMode, mig, 0) == nv.NVML_ERROR_NOT_SUPPORTED


def test_nvlink_peers_must_be_reset_in_the_same_command(sim, state):
    uuids = [g["uuid"] for g in sim["gpus"]]
    simnvml.set_gpu(state, 0, reset_peers=[uuids[1], uuids[2]], ecc_volatile_uncorrected=1)
    done = smi(sim, state, "--gpu-reset", "-i", "0")
    assert done.returncode == 255
    assert done.stderr == ("Unable to reset GPU 00000000:18:00.0: it is connected through NVLink to GPUs that must be "
                           "reset in the same command: 00000000:28:00.0, 00000000:38:00.0\n")
    assert [g["reset_count"] for g in simnvml.load(state)["gpus"]] == [0, 0, 0, 0]
    done = smi(sim, state, "--gpu-reset", "-i", f"{uuids[0]},1,00000000:38:00.0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("was successfully reset.") == 3
    assert [g["reset_count"] for g in simnvml.load(state)["gpus"]] == [1, 1, 1, 0]
    with pytest.raises(simnvml.SimulationError, match=r"reset_peers: GPU-nope is not another GPU"):
        simnvml.set_gpu(state, 0, reset_peers=["GPU-nope"])


def test_a_reset_destroys_the_mig_instances_of_the_gpu(sim, state):
    assert len(simnvml.load(state)["gpus"][MIG_GPU]["mig_devices"]) == len(MIG_LAYOUT)
    assert smi(sim, state, "--gpu-reset", "-i", str(MIG_GPU)).returncode == 0
    gpu = simnvml.load(state)["gpus"][MIG_GPU]
    assert gpu["mig_mode"] is True and gpu["mig_devices"] == []


# ---- processes hold the GPU while they hold their files -------------------------------------

# A process whose first thread exits (a zombie leader) while a second thread keeps running.
LEADER_EXITS = r"""
import ctypes, os, sys, threading, time
threading.Thread(target=time.sleep, args=(600,)).start()
print(os.getpid(), flush=True)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only, not the group
"""


def test_a_zombie_holds_no_context_and_does_not_block_a_reset(nv, sim, state):
    zombie = subprocess.Popen(["true"])
    try:
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        simnvml.set_gpu(state, 1, compute_processes=[simnvml.process(zombie.pid, 1 << 30)])
        handle = nv.nvmlDeviceGetHandleByIndex(1)
        assert nv.nvmlDeviceGetComputeRunningProcesses(handle) == []
        assert nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2).used == 0
        nv.nvmlShutdown()
        try:
            assert smi(sim, state, "--gpu-reset", "-i", "1").returncode == 0
        finally:
            nv.nvmlInit()
    finally:
        zombie.wait()


def test_a_process_whose_first_thread_exited_still_holds_the_gpu(nv, sim, state):
    process = subprocess.Popen(["python3", "-c", LEADER_EXITS], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(process.stdout.readline())
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        simnvml.set_gpu(state, 1, compute_processes=[simnvml.process(pid, 1 << 30)])
        assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(1))] == [pid]
        nv.nvmlShutdown()
        try:
            done = smi(sim, state, "--gpu-reset", "-i", "1")
            assert done.returncode == 255 and f"pid {pid} is alive" in done.stderr
        finally:
            nv.nvmlInit()
    finally:
        process.kill()
        process.wait()


# ---- entry points by driver branch ---------------------------------------------------------

@pytest.fixture(scope="module")
def old_hosts(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    base = tmp_path_factory.mktemp("old-drivers")
    return {branch: simhost.build(str(base / str(branch)), gpus=1, driver_version=version, cuda_version=cuda)
            for branch, version, cuda in ((450, "450.80.02", "11.0"), (470, "470.82.01", None))}


def exported(library: str) -> set:
    lib = ctypes.CDLL(library)
    names = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
             "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
             "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2")
    return {name for name in names if hasattr(lib, name)}


def test_the_library_exports_only_the_entry_points_of_its_driver_branch(sim, old_hosts):
    # NVML 11.1 (driver 455) added the _v2 process queries, NVML 11.6 (driver 510) the _v3 ones
    # and nvmlDeviceGetMemoryInfo_v2 (nvml.h as NVIDIA/go-nvml tracks it).
    v1 = {"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo"}
    v2 = {"nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2"}
    v3 = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
          "nvmlDeviceGetMemoryInfo_v2"}
    assert exported(old_hosts[450]["nvml_library"]) == v1
    assert exported(old_hosts[470]["nvml_library"]) == v1 | v2
    assert exported(sim["nvml_library"]) == v1 | v2 | v3
