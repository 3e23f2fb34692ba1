"""`gpuhook simulate`: the simulated NVML's build, MIG capability files, options and the state helpers."""

import json
import os
import re
import stat
import subprocess
import sys
import pytest
from gpuhook import config as cfg
from gpuhook.discover import ldcache
from gpuhook.simulate import SimulationError
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml
from conftest import REPO, require_root_tools


CSRC = os.path.join(REPO, "gpuhook", "simulate", "csrc")


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("mig") / "host"), gpus=3, mig={0: ["1g.10gb", "2g.20gb"], 2: []},
                         driver_version="535.104.05", brand="tesla", nvml_latency_ms=3, nvml_init_latency_ms=4)


def test_the_nvml_library_is_in_the_ld_cache_under_its_soname(sim_host):
    libdir = os.path.dirname(sim_host["nvml_library"])
    real = f"{libdir}/libnvidia-ml.so.{sim_host['driver_version']}"
    assert os.path.realpath(sim_host["nvml_library"]) == real
    cache = ldcache.read(f"{sim_host['directory']}/driver/etc/ld.so.cache")
    entries = [e for e in cache if e.soname == "libnvidia-ml.so.1"]
    assert [e.path for e in entries] == [sim_host["nvml_library"][len(sim_host["directory"]) + len("/driver"):]]
    require_root_tools("readelf")
    dynamic = subprocess.run(["readelf", "-d", real], capture_output=True, text=True, check=True).stdout
    assert "Library soname: [libnvidia-ml.so.1]" in dynamic


def test_config_and_state_point_at_the_simulated_nvml(sim_host):
    config = cfg.load(sim_host["config"])
    assert config.nvml_library == sim_host["nvml_library"]
    assert sim_host["nvml_state"] == f"{sim_host['directory']}/nvml.json"
    state = simnvml.load(sim_host["nvml_state"])
    assert (state["driver_version"], state["cuda_version"]) == (sim_host["driver_version"], sim_host["cuda_version"])
    assert [(g["uuid"], g["minor"], g["bus_id"].lower()) for g in state["gpus"]] == \
           [(g["uuid"], g["minor"], "0000" + g["bus_id"]) for g in sim_host["gpus"]]
    gpu = state["gpus"][0]
    assert (gpu["brand"], gpu["mig_capable"], gpu["mig_mode"], gpu["memory_total"]) == \
           ("nvidia", True, False, simhost.MEMORY_TOTAL)


def test_a_host_without_mig_has_the_capability_files_every_driver_makes_and_no_instance(sim_host):
    """As an H200 with MIG off: the MIG minor table, mig/config, mig/monitor, fabric-imex-mgmt
    and an empty gpu<minor>/mig per GPU (NVIDIA's open kernel modules: nv-caps.c, os.c), but
    no GPU instance's files and no nvidia-caps nodes."""
    proc = f"{sim_host['directory']}/proc/driver"
    assert os.path.exists(f"{proc}/nvidia-caps/mig-minors")
    found = sorted(os.path.relpath(os.path.join(d, f), f"{proc}/nvidia/capabilities")
                   for d, dirs, files in os.walk(f"{proc}/nvidia/capabilities") for f in files + dirs)
    assert found == ["fabric-imex-mgmt", "gpu0", "gpu0/mig", "gpu1", "gpu1/mig", "gpu2", "gpu2/mig", "gpu3", "gpu3/mig",
                     "mig", "mig/config", "mig/monitor"]
    with open(f"{proc}/nvidia/capabilities/mig/config") as f:
        assert f.read() == "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n"
    assert not os.path.exists(f"{sim_host['directory']}/dev/nvidia-caps")


def test_options_reach_the_nvml_state(mig_host):
    state = simnvml.load(mig_host["nvml_state"])
    assert (state["cuda_version"], state["call_latency_ms"], state["init_latency_ms"]) == ("12.2", 3, 4)
    assert {g["brand"] for g in state["gpus"]} == {"tesla"}
    assert [g["mig_mode"] for g in state["gpus"]] == [True, False, True]
    assert [d["profile"] for d in state["gpus"][0]["mig_devices"]] == ["1g.10gb", "2g.20gb"]
    assert [d["profile"] for d in state["gpus"][2]["mig_devices"]] == list(simhost.DEFAULT_MIG_LAYOUT)
    ids = [(d["gpu_instance_id"], d["compute_instance_id"], d["memory_total"]) for d in state["gpus"][0]["mig_devices"]]
    assert ids == [(1, 0, 10 << 30), (2, 0, 20 << 30)]


def test_mig_minors_lists_every_slot_as_the_driver_does(mig_host):
    with open(f"{mig_host['directory']}/proc/driver/nvidia-caps/mig-minors") as f:
        lines = f.read().splitlines()
    assert lines[:5] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4", "gpu0/gi0/ci1/access 5"]
    table = dict(line.rsplit(" ", 1) for line in lines)
    assert table["gpu0/gi1/access"] == "12" and table["gpu0/gi1/ci0/access"] == "13"
    assert table["gpu1/gi0/access"] == "138" and table["gpu2/gi14/ci7/access"] == str(3 + 3 * 135 - 1)
    assert len(lines) == 2 + 3 * 15 * 9
    assert len(set(table.values())) == len(lines)  # every minor once
    assert all(re.fullmatch(r"(config|monitor|gpu\d+/gi\d+(/ci\d+)?/access) \d+", line) for line in lines)


def test_capability_nodes_exist_for_the_mig_devices_that_exist(mig_host):
    caps_major = mig_host["majors"]["nvidia-caps"]
    directory = mig_host["directory"]
    expected = {1: 0o400, 2: 0o444}
    for gpu in mig_host["gpus"]:
        for device in gpu["mig_devices"]:
            expected[device["caps"]["gpu_instance"]] = 0o444
            expected[device["caps"]["compute_instance"]] = 0o444
            gi, ci = device["gpu_instance_id"], device["compute_instance_id"]
            minor = device["caps"]["compute_instance"]
            with open(f"{directory}/proc/driver/nvidia/capabilities/gpu{gpu['minor']}/mig/gi{gi}/ci{ci}/access") as f:
                assert f.read() == f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    assert mig_host["gpus"][0]["mig_devices"][0]["caps"] == {"gpu_instance": 12, "compute_instance": 13}
    found = {}
    for name in os.listdir(f"{directory}/dev/nvidia-caps"):
        st = os.stat(f"{directory}/dev/nvidia-caps/{name}")
        assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == caps_major
        assert name == f"nvidia-cap{os.minor(st.st_rdev)}"
        found[os.minor(st.st_rdev)] = stat.S_IMODE(st.st_mode)
    assert found == expected
    with open(f"{directory}/proc/devices") as f:
        assert f"{caps_major} nvidia-caps" in f.read()


@pytest.mark.parametrize("kwargs,message", [
    ({"driver_version": "999.1"}, "does not know which CUDA version driver branch 999 supports"),
    ({"cuda_version": "12"}, "--cuda-version must look like 12.4, not '12'"),
    ({"brand": "radeon"}, "--brand must be one of"),
    ({"mig": {5: []}}, "--mig names GPU 5, but there are 2 GPU(s)"),
    ({"mig": {0: ["4g.40gb", "4g.40gb"]}}, "needs more than the GPU's 7 slices"),
    ({"mig": {0: ["big"]}}, "MIG profile 'big' is not like 1g.10gb"),
    ({"nvml_latency_ms": -1}, "--nvml-latency-ms must be between"),
])
def test_bad_options_are_refused_before_anything_is_built(tmp_path, kwargs, message):
    require_root_tools()
    with pytest.raises(SimulationError) as err:
        simhost.build(str(tmp_path / "host"), **kwargs)
    assert message in err.value.one_line()
    assert not os.path.exists(tmp_path / "host")


def test_the_command_line(tmp_path):
    require_root_tools("gcc", "ldconfig")
    directory = str(tmp_path / "host")
    done = subprocess.run([sys.executable, "-m", "gpuhook", "simulate", directory, "--gpus", "2",
                           "--mig", "1=1g.10gb,1g.10gb", "--cuda-version", "12.6", "--brand", "geforce",
                           "--nvml-latency-ms", "5"],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    with open(f"{directory}/host.json") as f:
        built = json.load(f)
    assert "driver 550.54.15 (CUDA 12.6)" in done.stdout
    assert f"MIG 1:1  {built['gpus'][1]['mig_devices'][1]['uuid']}  1g.10gb  GI 2 CI 0" in done.stdout
    assert f"NVML state (edit to inject faults): {directory}/nvml.json" in done.stdout
    # The hint runs as printed, from another directory, with only a minimal PATH.
    hint = next(line for line in done.stdout.splitlines() if line.startswith("use it with: "))
    listed = subprocess.run(["sh", "-c", hint.removeprefix("use it with: ")], capture_output=True, text=True,
                            timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert listed.returncode == 0 and built["gpus"][0]["uuid"] in listed.stdout, listed.stderr
    state = simnvml.load(f"{directory}/nvml.json")
    assert (state["cuda_version"], state["call_latency_ms"], state["gpus"][0]["brand"]) == ("12.6", 5, "geforce")
    bad = subprocess.run([sys.executable, "-m", "gpuhook", "simulate", str(tmp_path / "other"), "--mig", "x"],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert bad.returncode == 2 and bad.stderr.startswith("gpuhook: --mig 'x': expected a GPU index")


@pytest.mark.parametrize("sources", [("nvml_sim.c", "simstate.c", "simjson.c"), ("tool.c", "simstate.c", "simjson.c")])
def test_the_c_sources_compile_without_warnings(tmp_path, sources):
    require_root_tools("gcc")
    shared = ["-shared", "-fPIC", "-pthread"] if sources[0] == "nvml_sim.c" else []
    done = subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O2", *shared,
                           "-o", str(tmp_path / "out"), '-DSIM_STATE_PATH="/x/nvml.json"',
                           '-DSIM_DRIVER_VERSION="1.0"', *[f"{CSRC}/{s}" for s in sources]],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kind", ["empty dir of another user", "symlink to a dir", "world-writable dir"])
def test_simulate_refuses_a_target_someone_else_could_swap(tmp_path, kind):
    """Root loads the simulated NVML library from the target later: a directory another user
    made (the old README example was /tmp/sim) or a symlink would hand that user root."""
    require_root_tools()
    target = tmp_path / "sim"
    if kind == "empty dir of another user":
        target.mkdir()
        os.chown(target, 65534, 65534)
    elif kind == "symlink to a dir":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.mkdir()
        os.chmod(target, 0o777)
    with pytest.raises(simhost.SimulationError, match="owned by root"):
        simhost.build(str(target), gpus=1)
    assert not (tmp_path / "elsewhere" / "driver").exists()
