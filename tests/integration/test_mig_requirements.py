"""MIG devices, NVIDIA_REQUIRE_* and the NVML inventory cache, in real runc containers.

A simulated host with GPU 1 in MIG mode (four MIG devices) and a simulated NVML: requests
for MIG devices get the parent GPU's node and exactly their capability nodes; images whose
requirements the host does not meet fail to start with the constraint named; NVML is asked
once per host state and never again while the host is unchanged.
"""

import json

import pytest

from conftest import GpuContainers, require_root_tools
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

pytestmark = pytest.mark.root

CUDA_12_2 = ("NVIDIA_REQUIRE_CUDA=cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=unknown,driver>=470,"
             "driver<471 brand=nvidia,driver>=470,driver<471 brand=nvidiartx,driver>=470,driver<471")


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("mighost") / "host"), gpus=2, mig={1: []},
                         brand="tesla", cuda_version="12.4")


@pytest.fixture
def mig(bed, mig_host, probe, tmp_path):
    return GpuContainers(bed, mig_host, probe, tmp_path)


def caps(host, mig_index):
    device = host["gpus"][1]["mig_devices"][mig_index]
    return device["caps"]["gpu_instance"], device["caps"]["compute_instance"]


def cap_path(minor):
    return f"/dev/nvidia-caps/nvidia-cap{minor}"


def make_cap(name, minor, host):
    return f"busybox mknod /dev/{name} c {host['majors']['nvidia-caps']} {minor}"


def test_mig_instance_gets_its_parent_node_and_exactly_its_capability_nodes(mig, mig_host):
    gi, ci = caps(mig_host, 1)
    other_gi, _ = caps(mig_host, 0)
    # A writable node for our own capability tells the cgroup's verdict on writes apart from
    # the node's mode (0444 for NVIDIA's own nodes).
    writable = f"busybox mknod -m 666 /dev/own-cap-rw c {mig_host['majors']['nvidia-caps']} {gi}"
    before = "; ".join([make_cap("other-cap", other_gi, mig_host), "busybox mknod /dev/test-gpu0 c 195 0",
                        writable, "busybox ls /dev/nvidia-caps"])
    result = mig.run("mig-1-1", env=["NVIDIA_VISIBLE_DEVICES=1:1"], before=before,
                     paths=[cap_path(gi), cap_path(ci), "/dev/other-cap", "/dev/test-gpu0", "/dev/own-cap-rw"])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert p["/dev/nvidia1"]["read"] == "ENXIO" and not p["/dev/nvidia0"]["exists"]
    for path in (cap_path(gi), cap_path(ci)):
        assert p[path]["type"] == "chr" and p[path]["read"] == "ENXIO", p[path]
        assert p[path]["major"] == mig_host["majors"]["nvidia-caps"] and p[path]["mode"] == "0444"
    own = p["/dev/own-cap-rw"]
    assert (own["read"], own["write"]) == ("ENXIO", "EPERM")  # capabilities are granted for reading only
    assert p["/dev/other-cap"]["read"] == "EPERM"  # another MIG device's capability
    assert p["/dev/test-gpu0"]["read"] == "EPERM"
    listed = sorted(line.strip() for line in result.stdout.splitlines() if line.startswith("nvidia-cap"))
    assert listed == sorted([f"nvidia-cap{gi}", f"nvidia-cap{ci}"])
    (line,) = mig.log_lines()
    assert line["gpus"] == [mig_host["gpus"][1]["uuid"]]


def test_mig_device_by_uuid(mig, mig_host):
    device = mig_host["gpus"][1]["mig_devices"][3]
    gi, ci = caps(mig_host, 3)
    result = mig.run("mig-uuid", env=[f"NVIDIA_VISIBLE_DEVICES={device['uuid']}"], paths=[cap_path(gi), cap_path(ci)])
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert p["/dev/nvidia1"]["read"] == "ENXIO" and p[cap_path(ci)]["read"] == "ENXIO"


def test_a_mig_mode_gpu_requested_whole_is_refused(mig, mig_host):
    result = mig.run("mig-whole", env=["NVIDIA_VISIBLE_DEVICES=1"])
    assert result.returncode != 0
    (line,) = [x for x in result.stderr.splitlines() if "gpuhook:" in x]
    assert "is in MIG mode: request its MIG devices" in line and "1:0" in line
    # No UUID of the host's GPUs or MIG devices: the line reaches whoever made the container
    # (attacker pass 6).
    assert "GPU-" not in line and "MIG-" not in line


def test_a_mig_device_of_a_gpu_not_in_mig_mode_is_named_without_uuids(mig):
    result = mig.run("mig-not-mig", env=["NVIDIA_VISIBLE_DEVICES=0:0"])
    assert result.returncode != 0
    (line,) = [x for x in result.stderr.splitlines() if "gpuhook:" in x]
    assert "is not in MIG mode" in line and "GPU-" not in line and "MIG-" not in line


def test_unknown_mig_device_lists_the_real_ones(mig, mig_host):
    result = mig.run("mig-missing", env=["NVIDIA_VISIBLE_DEVICES=1:9"])
    assert result.returncode != 0
    # By index only: other MIG devices' UUIDs are host data (docs/security.md, attacker pass 5, A08).
    assert "requested MIG device '1:9'" in result.stderr and "MIG devices here: 1:0, 1:1, 1:2, 1:3" in result.stderr
    assert "MIG-" not in result.stderr


def test_all_on_a_mig_host_means_whole_gpus_and_every_mig_device(mig, mig_host):
    all_caps = [cap_path(m) for i in range(4) for m in caps(mig_host, i)]
    result = mig.run("mig-all", env=["NVIDIA_VISIBLE_DEVICES=all"], paths=all_caps)
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert p["/dev/nvidia0"]["read"] == "ENXIO" and p["/dev/nvidia1"]["read"] == "ENXIO"
    assert all(p[path]["read"] == "ENXIO" for path in all_caps)


def test_mig_config_capability_is_for_privileged_containers_only(mig, mig_host):
    env = ["NVIDIA_VISIBLE_DEVICES=1:0", "NVIDIA_MIG_CONFIG_DEVICES=all"]
    result = mig.run("mig-config-unpriv", env=env)
    assert result.returncode != 0
    assert "NVIDIA_MIG_CONFIG_DEVICES is only honoured for privileged containers" in result.stderr
    result = mig.run("mig-config-priv", env=env, privileged=True, paths=[cap_path(1)])
    assert result.returncode == 0, result.stderr
    assert result.probes()[cap_path(1)]["read"] == "ENXIO"


def test_unmet_cuda_requirement_fails_the_start_naming_the_constraint(mig):
    result = mig.run("req-fail", env=["NVIDIA_VISIBLE_DEVICES=0", CUDA_12_2.replace("cuda>=12.2", "cuda>=12.6")])
    assert result.returncode != 0
    (line,) = [x for x in result.stderr.splitlines() if "gpuhook:" in x]
    assert "NVIDIA_REQUIRE_CUDA is not satisfied: cuda>=12.6 is false, the host has cuda 12.4" in line


def test_met_requirement_and_disabled_requirements_start(mig):
    result = mig.run("req-ok", env=["NVIDIA_VISIBLE_DEVICES=0", CUDA_12_2])
    assert result.returncode == 0, result.stderr
    result = mig.run("req-disabled", env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0",
                                          "NVIDIA_DISABLE_REQUIRE=true"])
    assert result.returncode == 0, result.stderr


def test_brand_and_arch_constraints_use_the_gpus_the_container_gets(mig):
    result = mig.run("req-arch", env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_ARCH=arch>=9.0",
                                      "NVIDIA_REQUIRE_BRAND=brand=tesla"])
    assert result.returncode == 0, result.stderr
    result = mig.run("req-brand", env=["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_BRAND=brand=geforce"])
    assert result.returncode != 0 and "brand=geforce" in result.stderr


def test_nvml_is_asked_once_per_host_state(tmp_path, bed, probe):
    """With NVML slowed down, the second start on the same host uses the cache: no NVML call
    can happen, since one would cost at least the simulated latency; a new driver version
    makes the hook ask NVML again."""
    require_root_tools("gcc", "ldconfig")
    latency_ms = 400
    slow = simhost.build(str(tmp_path / "slow"), gpus=2, nvml_latency_ms=latency_ms, cuda_version="12.4")
    (tmp_path / "work").mkdir()
    containers = GpuContainers(bed, slow, probe, tmp_path / "work")
    containers.configure(health={"mode": "off"})  # health checks ask NVML at every start by design
    env = ["NVIDIA_VISIBLE_DEVICES=0", CUDA_12_2]
    for name in ("first", "second"):
        result = containers.run(f"cache-{name}", env=env)
        assert result.returncode == 0, result.stderr
    first, second = containers.log_lines()
    assert "NVML facts queried from NVML" in first["notes"] and first["nvml"] == "loaded (1 init)"
    assert first["seconds"] >= latency_ms / 1000
    # The log says what was really loaded: health is off, and the facts came from the cache.
    assert "NVML facts from the inventory cache" in second["notes"] and second["nvml"] == "not loaded"
    assert second["seconds"] < latency_ms / 1000
    # A driver upgrade: /proc's version and NVML's change together.
    version_file = f"{slow['directory']}/proc/driver/nvidia/version"
    with open(version_file) as f:
        text = f.read()
    with open(version_file, "w") as f:
        f.write(text.replace(slow["driver_version"], "560.35.03"))
    simnvml.set_host(simnvml.state_path(slow["directory"]), driver_version="560.35.03", cuda_version="12.6")
    result = containers.run("cache-third", env=env)
    assert result.returncode == 0, result.stderr
    third = containers.log_lines()[-1]
    assert "NVML facts queried from NVML" in third["notes"]
    with open(tmp_path / "work" / "run" / "inventory.json") as f:  # the config's state-dir
        cached = json.load(f)
    assert cached["key"]["driver_version"] == "560.35.03" and cached["nvml"]["cuda_version"] == "12.6"
