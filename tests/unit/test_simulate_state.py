"""`gpuhook simulate`: the simulated NVML's build, MIG capability files, options and the state
helpers.

The tests of it that need no root; those that do are in tests/integration/test_simulate.py.
"""

import multiprocessing
import os
import re
import pytest
from gpuhook.simulate import SimulationError
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml
from conftest import REPO


CSRC = os.path.join(REPO, "gpuhook", "simulate", "csrc")


@pytest.mark.parametrize("driver,cuda", [("550.54.15", "12.4"), ("535.104.05", "12.2"), ("470.82.01", "11.4"),
                                         ("525.60.13", "12.0"), ("580.65.06", "13.0")])
def test_the_cuda_version_follows_the_driver_branch(driver, cuda):
    assert simhost.cuda_version_for(driver) == cuda


def c_field_lists() -> dict:
    with open(f"{CSRC}/simstate.c") as f:
        text = f.read()
    lists = {}
    for name in ("top_keys", "gpu_keys", "process_keys", "mig_keys"):
        body = re.search(rf"{name}\[\] = \{{(.*?)NULL", text, re.S).group(1)
        lists[name] = re.findall(r'"([a-z_]+)"', body)
    return lists


def test_python_and_c_accept_the_same_fields():
    lists = c_field_lists()
    assert lists["top_keys"] == list(simnvml.HOST_FIELDS)
    assert lists["gpu_keys"] == list(simnvml.GPU_FIELDS)
    assert lists["process_keys"] == list(simnvml.PROCESS_FIELDS)
    assert lists["mig_keys"] == list(simnvml.MIG_FIELDS)


def test_the_brands_of_c_and_python_agree():
    with open(f"{CSRC}/simstate.c") as f:
        body = re.search(r"sim_brand_names\[\] = \{(.*?)\};", f.read(), re.S).group(1)
    assert tuple(re.findall(r'"([a-z]+)"', body)) == simnvml.BRANDS


def test_the_documentation_lists_every_field():
    with open(os.path.join(REPO, "docs", "simulated-host.md")) as f:
        doc = f.read()
    for fields in (simnvml.HOST_FIELDS, simnvml.GPU_FIELDS, simnvml.PROCESS_FIELDS, simnvml.MIG_FIELDS):
        for name in fields:
            assert f"| `{name}` |" in doc, f"docs/simulated-host.md does not document {name}"


def small_state(path) -> str:
    gpus = [simnvml.gpu_state(f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, f"00000000:{0x18 + i:02X}:00.0", brand="nvidia")
            for i in range(2)]
    simnvml.save(str(path), simnvml.new_state("550.54.15", "12.4", gpus))
    return str(path)


def test_a_new_gpu_record_is_healthy(tmp_path):
    gpu = simnvml.load(small_state(tmp_path / "s.json"))["gpus"][0]
    assert gpu["compute_processes"] == [] and gpu["lost"] is False and gpu["ecc_volatile_uncorrected"] == 0
    assert not gpu["retired_pages_pending"] and not gpu["remapped_rows_pending"] and gpu["reset_count"] == 0


def test_set_gpu_by_index_or_uuid_and_add_process(tmp_path):
    path = small_state(tmp_path / "s.json")
    simnvml.set_gpu(path, 1, lost=True)
    simnvml.set_gpu(path, "GPU-0", ecc_volatile_uncorrected=4)
    simnvml.add_process(path, "GPU-1", pid=42, used_memory=7, kind="graphics", stale=True)
    state = simnvml.load(path)
    assert state["gpus"][1]["lost"] and state["gpus"][0]["ecc_volatile_uncorrected"] == 4
    assert state["gpus"][1]["graphics_processes"] == [{"pid": 42, "used_memory": 7, "stale": True}]
    assert sorted(os.listdir(tmp_path)) == ["s.json", "s.json.lock"]  # no temporary files left


@pytest.mark.parametrize("change,message", [
    (lambda s: s["gpus"][0].update(colour="red"), "gpus[0].colour: unknown field"),
    (lambda s: s["gpus"][0].update(brand="radeon"), "gpus[0].brand: must be one of"),
    (lambda s: s["gpus"][0].update(minor=1), "gpus[1].minor: same as gpus[0]"),
    (lambda s: s["gpus"][1].update(uuid="GPU-0"), "gpus[1].uuid: same as gpus[0]"),
    (lambda s: s["gpus"][1].update(bus_id="0000:18:00.0"), "gpus[1].bus_id: same as gpus[0]"),
    (lambda s: s["gpus"][0].update(mig_capable=False, mig_mode=True), "gpus[0].mig_mode: needs \"mig_capable\": true"),
    (lambda s: s["gpus"][0].update(compute_processes=[{"used_memory": 1}]), "compute_processes[0].pid: is required"),
    (lambda s: s["gpus"][0].update(mig_devices=[{"gpu_instance_id": 15, "uuid": "MIG-x", "profile": "1g.10gb"}]),
     "mig_devices[0].gpu_instance_id: must be a whole number from 0 to 14"),
    (lambda s: s.update(cuda_version="12"), "cuda_version: must look like 12.4"),
    (lambda s: s.update(call_latency_ms=True), "call_latency_ms: must be a whole number"),
    (lambda s: s.pop("gpus"), "gpus: is required"),
])
def test_invalid_changes_are_refused_and_leave_the_file_alone(tmp_path, change, message):
    path = small_state(tmp_path / "s.json")
    with open(path) as f:
        before = f.read()
    with pytest.raises(SimulationError, match=re.escape(message)):
        simnvml.update(path, change)
    with open(path) as f:
        assert f.read() == before


def test_unknown_helper_fields_and_gpus_are_errors(tmp_path):
    path = small_state(tmp_path / "s.json")
    with pytest.raises(SimulationError, match="unknown gpu field 'ecc_uncorrected'"):
        simnvml.set_gpu(path, 0, ecc_uncorrected=1)
    with pytest.raises(SimulationError, match="no simulated GPU with index 2"):
        simnvml.set_gpu(path, 2, lost=True)
    with pytest.raises(SimulationError, match="no simulated GPU 'GPU-9'"):
        simnvml.set_gpu(path, "GPU-9", lost=True)
    with pytest.raises(SimulationError, match="unknown host field 'gpus'"):
        simnvml.set_host(path, gpus=[])
    with pytest.raises(SimulationError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        simnvml.load(str(tmp_path / "bad.json"))


def _bump(path: str, times: int) -> None:
    for _ in range(times):
        simnvml.update(path, lambda s: s["gpus"][0].update(reset_count=s["gpus"][0]["reset_count"] + 1))


def test_concurrent_updates_lose_nothing(tmp_path):
    path = small_state(tmp_path / "s.json")
    workers = [multiprocessing.get_context("fork").Process(target=_bump, args=(path, 40)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert simnvml.load(path)["gpus"][0]["reset_count"] == 160
