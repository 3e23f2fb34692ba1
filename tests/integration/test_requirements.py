"""NVIDIA_REQUIRE_* evaluation: real CUDA images' requirement strings against hosts, table-driven.

Expected outcomes follow libnvidia-container's rules (src/cli/dsl.c, configure.c) and the
container toolkit's variable handling (internal/config/image/cuda_image.go).
"""

import shutil
import pytest
from gpuhook.plan import requirements as plan_requirements
from gpuhook.discover import nvml
from gpuhook.errors import RequirementError
from gpuhook.discover.types import Gpu
from gpuhook.plan.requirements import HostFacts
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml
from conftest import require_root_tools


# NVIDIA_REQUIRE_CUDA of nvidia/cuda images (gitlab.com/nvidia/container-images/cuda, dist/).
CUDA_12_2_2 = (
    "cuda>=12.2 brand=tesla,driver>=470,driver<471 brand=unknown,driver>=470,driver<471 "
    "brand=nvidia,driver>=470,driver<471 brand=nvidiartx,driver>=470,driver<471 brand=geforce,driver>=470,driver<471 "
    "brand=geforcertx,driver>=470,driver<471 brand=quadro,driver>=470,driver<471 "
    "brand=quadrortx,driver>=470,driver<471 brand=titan,driver>=470,driver<471 "
    "brand=titanrtx,driver>=470,driver<471 brand=tesla,driver>=525,driver<526 "
    "brand=unknown,driver>=525,driver<526 brand=nvidia,driver>=525,driver<526 brand=nvidiartx,driver>=525,driver<526 "
    "brand=geforce,driver>=525,driver<526 brand=geforcertx,driver>=525,driver<526 brand=quadro,driver>=525,driver<526 "
    "brand=quadrortx,driver>=525,driver<526 brand=titan,driver>=525,driver<526 brand=titanrtx,driver>=525,driver<526"
)


CUDA_11_8_0 = (
    "cuda>=11.8 brand=tesla,driver>=470,driver<471 brand=unknown,driver>=470,driver<471 "
    "brand=nvidia,driver>=470,driver<471 brand=nvidiartx,driver>=470,driver<471 brand=geforce,driver>=470,driver<471 "
    "brand=geforcertx,driver>=470,driver<471 brand=quadro,driver>=470,driver<471 "
    "brand=quadrortx,driver>=470,driver<471 brand=titan,driver>=470,driver<471 brand=titanrtx,driver>=470,driver<471"
)


CUDA_12_4_1 = CUDA_12_2_2.replace("cuda>=12.2", "cuda>=12.4") + (
    " brand=tesla,driver>=535,driver<536 brand=unknown,driver>=535,driver<536 brand=nvidia,driver>=535,driver<536 "
    "brand=nvidiartx,driver>=535,driver<536 brand=geforce,driver>=535,driver<536 "
    "brand=geforcertx,driver>=535,driver<536 brand=quadro,driver>=535,driver<536 "
    "brand=quadrortx,driver>=535,driver<536 brand=titan,driver>=535,driver<536 brand=titanrtx,driver>=535,driver<536"
)


def host(driver, cuda, brand="tesla", arch="8.0", gpus=1):
    return HostFacts(cuda, driver, [gpu(i, arch, brand) for i in range(gpus)])


def gpu(index: int, arch, brand, uuid=None) -> Gpu:
    """A GPU as the plan checks it: NVML's arch and brand filled in."""
    return Gpu(index, uuid or f"GPU-{index}", index, f"0000:{index + 16:02x}:00.0", "NVIDIA H100", brand=brand, arch=arch)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("requirements") / "host"), gpus=2)


def facts_from_nvml(library: str) -> HostFacts:
    """What the hook will do: NVML inventory -> requirement facts for the selected GPUs."""
    with nvml.Session(library) as session:
        inventory = session.inventory()
    return HostFacts(inventory.cuda_version, inventory.driver_version, list(inventory.gpus))


@pytest.mark.parametrize("driver,cuda,brand,image,passes", [
    ("550.54.15", "12.4", "nvidia", CUDA_12_4_1, True),
    ("535.104.05", "12.2", "nvidia", CUDA_12_4_1, True),
    ("545.23.08", "12.3", "nvidia", CUDA_12_4_1, False),
    ("525.60.13", "12.0", "tesla", CUDA_12_2_2, True),
    ("525.60.13", "12.0", "nvs", CUDA_12_2_2, False),
    ("470.82.01", "11.4", "geforce", CUDA_11_8_0, True),
    ("465.19.01", "11.3", "geforce", CUDA_11_8_0, False),
])
def test_requirements_against_simulated_hosts(sim, tmp_path, monkeypatch, driver, cuda, brand, image, passes):
    state = str(tmp_path / "nvml.json")
    shutil.copy(sim["nvml_state"], state)
    monkeypatch.setenv(simnvml.ENV_VAR, state)
    simnvml.set_host(state, driver_version=driver, cuda_version=cuda)
    for index in range(2):
        simnvml.set_gpu(state, index, brand=brand)
    facts = facts_from_nvml(sim["nvml_library"])
    assert (facts.driver_version, facts.cuda_version, facts.gpus[1].brand) == (driver, cuda, brand)
    env = {"NVIDIA_REQUIRE_CUDA": image}
    if passes:
        plan_requirements.evaluate(env, facts)
    else:
        with pytest.raises(RequirementError) as err:
            plan_requirements.evaluate(env, facts)
        assert f"{image.split()[0]} is false, the host has cuda {cuda}" in err.value.message
        assert f"GPU 0 {sim['gpus'][0]['uuid']}: brand {brand}, arch 9.0" in err.value.message
