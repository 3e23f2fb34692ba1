"""NVIDIA_REQUIRE_* evaluation: real CUDA images' requirement strings against hosts, table-driven.

The tests of it that need no root; those that do are in tests/integration/test_requirements.py.
"""

import pytest
from gpuhook.plan import requirements as plan_requirements
from gpuhook.request import requirements as request_requirements
from gpuhook.errors import HostError, RequestError, RequirementError
from gpuhook.discover.types import Gpu
from gpuhook.plan.requirements import HostFacts


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


CUDA_12_2_0 = "cuda>=12.2 brand=tesla,driver>=450,driver<451 " + CUDA_12_2_2[len("cuda>=12.2 "):]


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


CUDA_10_0 = "cuda>=10.0 brand=tesla,driver>=384,driver<385 brand=tesla,driver>=410,driver<411"


ARM64_12_2 = "cuda>=12.2"


def host(driver, cuda, brand="tesla", arch="8.0", gpus=1):
    return HostFacts(cuda, driver, [gpu(i, arch, brand) for i in range(gpus)])


def gpu(index: int, arch, brand, uuid=None) -> Gpu:
    """A GPU as the plan checks it: NVML's arch and brand filled in."""
    return Gpu(index, uuid or f"GPU-{index}", index, f"0000:{index + 16:02x}:00.0", "NVIDIA H100", brand=brand, arch=arch)


# (image, host, passes?) -- where it fails, the message must name cuda>=X and the host's CUDA.
MATRIX = [
    # A current driver runs every older image natively.
    (CUDA_12_2_2, host("550.54.15", "12.4", "nvidia", "9.0"), True),
    (CUDA_12_4_1, host("550.54.15", "12.4", "nvidia", "9.0"), True),
    (CUDA_11_8_0, host("550.54.15", "12.4", "nvidia", "9.0"), True),
    (CUDA_10_0, host("550.54.15", "12.4", "nvidia", "9.0"), True),
    (ARM64_12_2, host("535.104.05", "12.2", "nvidia", "9.0"), True),
    # An older driver branch runs a newer image only where the image lists it (forward
    # compatibility through cuda-compat), for every brand it lists.
    (CUDA_12_2_2, host("525.60.13", "12.0", "tesla"), True),
    (CUDA_12_2_2, host("525.147.05", "12.0", "geforce", "8.6"), True),
    (CUDA_12_2_2, host("470.82.01", "11.4", "unknown"), True),
    (CUDA_12_2_2, host("470.82.01", "11.4", "titanrtx", "7.5"), True),
    (CUDA_12_4_1, host("535.104.05", "12.2", "quadro"), True),
    (CUDA_12_2_0, host("450.80.02", "11.0", "tesla", "7.0"), True),
    (CUDA_12_2_0, host("450.80.02", "11.0", "geforce", "7.5"), False),  # only Tesla had 450 compat
    (CUDA_12_2_2, host("450.80.02", "11.0", "tesla", "7.0"), False),   # 12.2.2 dropped the 450 branch
    (CUDA_12_2_2, host("530.30.02", "12.1", "tesla"), False),          # 530 is not a listed branch
    (CUDA_12_2_2, host("470.82.01", "11.4", "nvs"), False),            # nvs is not a listed brand
    (CUDA_12_2_2, host("526.01", "12.0", "tesla"), False),             # driver<526 is exclusive
    (CUDA_12_4_1, host("545.23.08", "12.3", "nvidia", "9.0"), False),
    (CUDA_11_8_0, host("465.19.01", "11.3", "tesla"), False),
    (CUDA_10_0, host("410.129", "10.0", "tesla", "7.0"), True),
    (CUDA_10_0, host("396.82", "9.2", "tesla", "7.0"), False),
    (ARM64_12_2, host("525.60.13", "12.0", "nvidia", "9.0"), False),
]


@pytest.mark.parametrize("image,facts,passes", MATRIX,
                         ids=[f"{m[0].split()[0]}-driver{m[1].driver_version}-{m[1].gpus[0].brand}" for m in MATRIX])
def test_real_cuda_image_requirements(image, facts, passes):
    env = {"NVIDIA_REQUIRE_CUDA": image, "CUDA_VERSION": "12.2.2"}
    if passes:
        plan_requirements.evaluate(env, facts)
        return
    with pytest.raises(RequirementError) as err:
        plan_requirements.evaluate(env, facts)
    first = image.split()[0]
    assert err.value.constraint == first
    assert err.value.message.startswith(
        f"NVIDIA_REQUIRE_CUDA is not satisfied: {first} is false, the host has cuda {facts.cuda_version}")
    assert f"driver {facts.driver_version}" in err.value.message
    others = len(image.split()) - 1
    if others:
        assert f"none of the other {others} alternative" in err.value.message
    assert err.value.hint == plan_requirements.CUDA_HINT
    assert isinstance(err.value, RequestError) and err.value.variable == "NVIDIA_REQUIRE_CUDA"


@pytest.mark.parametrize("have,operator,want,holds", [
    ("12.4", ">=", "12.4", True), ("12.4", ">=", "12.10", False), ("12.10", ">", "12.9", True),
    ("12.2", "=", "12.2.0", True), ("12.2.0", "!=", "12.2", False), ("470.82.01", "<", "471", True),
    ("471.11", "<", "471", False), ("470.05", ">", "470", True), ("10.01", "=", "10.1", True),
    ("550.54.15", "<=", "550.54.15", True), ("550.54.15", "<", "550.54.15", False), ("9.0", "!=", "8.0", True),
    ("8.6", "<=", "8.0", False),
])
def test_versions_compare_numerically_by_component(have, operator, want, holds):
    facts = HostFacts(have, None)
    env = {"NVIDIA_REQUIRE_CUDA": f"cuda{operator}{want}"}
    if holds:
        plan_requirements.evaluate(env, facts)
    else:
        with pytest.raises(RequirementError, match=f"cuda{operator}{want} is false, the host has cuda {have}"):
            plan_requirements.evaluate(env, facts)


def test_compare_versions():
    assert plan_requirements.compare_versions("12.10", "12.9") == 1
    assert plan_requirements.compare_versions("12.2", "12.2.0.0") == 0
    assert plan_requirements.compare_versions("470.82.01", "525") == -1
    with pytest.raises(ValueError):
        plan_requirements.compare_versions("12.2a", "12")


@pytest.mark.parametrize("text,passes", [
    ("brand=Tesla", True), ("brand=TESLA", True), ("brand!=tesla", False), ("brand=geforce", False),
    ("BRAND=tesla,CUDA>=12", True), ("arch>=8.0", True), ("arch>8.0", False), ("arch=8", True),
    ("driver>=550,driver<551", True), ("driver>=550 driver<551", True), ("driver>=551,brand=tesla", False),
    ("cuda>=99 cuda>=12.4", True), ("", True), ("   ", True), (",", True),
])
def test_alternatives_and_conditions(text, passes):
    facts = host("550.54.15", "12.4", "tesla", "8.0")
    env = {"NVIDIA_REQUIRE_CUSTOM": text}
    if passes:
        plan_requirements.evaluate(env, facts)
    else:
        with pytest.raises(RequirementError):
            plan_requirements.evaluate(env, facts)


def test_variables_are_anded_and_the_failing_one_is_named():
    facts = host("550.54.15", "12.4", "tesla", "8.0")
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=12.2", "NVIDIA_REQUIRE_ARCH": "arch>=9.0",
           "NVIDIA_REQUIRE_BRAND": "brand=tesla"}
    with pytest.raises(RequirementError) as err:
        plan_requirements.evaluate(env, facts)
    assert err.value.variable == "NVIDIA_REQUIRE_ARCH"
    assert err.value.message.startswith("NVIDIA_REQUIRE_ARCH is not satisfied: arch>=9.0 is false, the host has "
                                        "arch 8.0 on GPU 0")
    assert err.value.hint is None


def test_a_condition_inside_an_alternative_is_named_with_its_alternative():
    with pytest.raises(RequirementError) as err:
        plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "brand=tesla,driver>=560"}, host("550.54.15", "12.4"))
    assert err.value.constraint == "driver>=560"
    assert "driver>=560 is false, the host has driver 550.54.15 (in brand=tesla,driver>=560)" in err.value.message


def test_arch_and_brand_must_hold_for_every_gpu_the_container_gets():
    facts = HostFacts("12.4", "550.54.15", [gpu(0, "9.0", "nvidia", "GPU-a"), gpu(1, "8.0", "nvidia", "GPU-b")])
    with pytest.raises(RequirementError, match=r"arch>=9.0 is false, the host has arch 8.0 on GPU 1 GPU-b"):
        plan_requirements.evaluate({"NVIDIA_REQUIRE_ARCH": "arch>=9.0"}, facts)
    plan_requirements.evaluate({"NVIDIA_REQUIRE_ARCH": "arch>=8.0"}, facts)


def test_no_gpu_and_unknown_facts_satisfy_their_constraints():
    plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "arch>=10.0,brand=quadro,cuda>=12"}, HostFacts("12.4", "550.54.15"))
    with pytest.raises(RequirementError, match="cuda>=13 is false"):
        plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "arch>=10.0,cuda>=13"}, HostFacts("12.4", "550.54.15"))
    plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "cuda>=99,driver>=999"}, HostFacts(None, None))
    plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "brand=quadro"}, host("550.54.15", "12.4", brand=None))


@pytest.mark.parametrize("value,skips", [
    ("true", True), ("1", True), ("True", True), ("TRUE", True), ("t", True),
    ("false", False), ("0", False), ("yes", False), ("", False),
])
def test_nvidia_disable_require(value, skips):
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=99", "NVIDIA_DISABLE_REQUIRE": value}
    if skips:
        plan_requirements.evaluate(env, host("550.54.15", "12.4"))
        assert request_requirements.collect(env) == ()
    else:
        with pytest.raises(RequirementError):
            plan_requirements.evaluate(env, host("550.54.15", "12.4"))


def test_jetpack_variables_are_not_requirements():
    env = {"NVIDIA_REQUIRE_JETPACK": "csv-mounts=all", "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS": "x"}
    assert request_requirements.collect(env) == ()
    plan_requirements.evaluate(env, host("550.54.15", "12.4"))


@pytest.mark.parametrize("cuda_version,host_cuda,passes,required", [
    ("11.0.3", "11.4", True, "cuda>=11.0"), ("11.0.3", "10.2", False, "cuda>=11.0"),
    ("9.0.176", "9.0", True, "cuda>=9.0"), ("10", "10.0", True, "cuda>=10.0"), ("v12.2.0", "12.1", False, "cuda>=12.2"),
    ("12.2.0-rc1", "12.2", True, "cuda>=12.2"),
])
def test_legacy_images_require_their_cuda_version(cuda_version, host_cuda, passes, required):
    env = {"CUDA_VERSION": cuda_version}
    (requirement,) = request_requirements.collect(env)
    assert requirement.text == required and requirement.variable.startswith("CUDA_VERSION")
    if passes:
        plan_requirements.evaluate(env, host("550.54.15", host_cuda))
    else:
        with pytest.raises(RequirementError) as err:
            plan_requirements.evaluate(env, host("550.54.15", host_cuda))
        assert err.value.constraint == required and f"the host has cuda {host_cuda}" in err.value.message


def test_an_image_with_require_cuda_is_not_legacy():
    assert [r.variable for r in request_requirements.collect({"CUDA_VERSION": "12.2.0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.2"})] \
        == ["NVIDIA_REQUIRE_CUDA"]
    empty_require = {"CUDA_VERSION": "12.2.0", "NVIDIA_REQUIRE_CUDA": ""}
    assert [r.text for r in request_requirements.collect(empty_require)] == ["cuda>=12.2"]


@pytest.mark.parametrize("version", ["12.x", "012.2", "1.2.3.4", "12.2-rc1", ""])
def test_a_bad_legacy_cuda_version_is_an_error(version):
    env = {"CUDA_VERSION": version}
    if not version:
        assert request_requirements.collect(env) == ()
        return
    with pytest.raises(RequirementError, match="CUDA_VERSION=.* is not a valid version"):
        request_requirements.collect(env)


@pytest.mark.parametrize("text,problem", [
    ("cuda==12.2", "unknown operator '=='"), ("cuda=>12.2", "unknown operator '=>'"),
    ("cuda>=", "no value after the operator"), (">=12.2", "no key before the operator"),
    ("cuda", "no operator"), ("gpu>=1", "unknown key 'gpu'"), ("cuda>=12.2a", "'12.2a' is not a version"),
    ("driver>=.5", "'.5' is not a version"), ("brand>tesla", "brand compares only with = and !="),
])
def test_malformed_constraints_are_errors_naming_them(text, problem):
    with pytest.raises(RequirementError) as err:
        plan_requirements.evaluate({"NVIDIA_REQUIRE_CUDA": text}, host("550.54.15", "12.4"))
    assert err.value.message.startswith(f"NVIDIA_REQUIRE_CUDA: malformed constraint {text!r}: {problem}")
    assert err.value.hint == request_requirements.SYNTAX_HINT


def test_a_malformed_constraint_is_only_an_error_where_evaluation_reaches_it():
    # NVIDIA evaluates left to right and stops at the first alternative that holds.
    env = {"NVIDIA_REQUIRE_CUDA": "cuda>=12.0 cuda==13"}
    plan_requirements.evaluate(env, host("550.54.15", "12.4"))
    with pytest.raises(RequirementError, match="malformed constraint 'cuda==13'"):
        plan_requirements.evaluate(env, host("470.82.01", "11.4"))


def test_a_non_numeric_host_version_is_reported_not_compared():
    with pytest.raises(HostError, match="host's driver version '550.54.15-open' is not numeric"):
        plan_requirements.evaluate({"NVIDIA_REQUIRE_X": "driver>=550"}, HostFacts("12.4", "550.54.15-open"))


def test_parse_keeps_the_structure():
    parsed = request_requirements.parse("NVIDIA_REQUIRE_CUDA", "cuda>=12.2 brand=tesla,driver>=470,driver<471")
    assert [[c.text for c in alternative] for alternative in parsed.alternatives] == [
        ["cuda>=12.2"], ["brand=tesla", "driver>=470", "driver<471"]]
    assert parsed.alternatives[1][2] == request_requirements.Constraint("driver<471", "driver", "<", "471", None)


@pytest.mark.parametrize("constraint,hint", [
    ("driver>=600", plan_requirements.CUDA_HINT),
    ("cuda>13.0", plan_requirements.CUDA_HINT),
    ("driver<500", plan_requirements.CUDA_UPPER_HINT),
    ("cuda<=12.2", plan_requirements.CUDA_UPPER_HINT),
    ("driver=535.1", plan_requirements.CUDA_EXACT_HINT.format(key="driver")),
])
def test_the_hint_follows_the_operator(constraint, hint):
    """An upper bound fails on a host that is too new: "update the host's driver" would be wrong."""
    with pytest.raises(RequirementError) as err:
        plan_requirements.evaluate({"NVIDIA_REQUIRE_X": constraint}, host("550.54.15", "12.4", "tesla", "8.0"))
    assert err.value.hint == hint


@pytest.mark.parametrize("env,named", [
    ({"NVIDIA_REQUIRE_CUDA": "cuda>=99.0 " * 5000 + "cuda>=1.0"}, "NVIDIA_REQUIRE_CUDA is too large"),
    ({"NVIDIA_REQUIRE_CUDA": "cuda>=1.0," * 7000}, "NVIDIA_REQUIRE_CUDA is too large (70000 characters, 1"),
    ({f"NVIDIA_REQUIRE_X{i}": "cuda>=1.0" for i in range(65)}, "the image sets 65 NVIDIA_REQUIRE_* variables"),
    ({f"NVIDIA_REQUIRE_X{i}": "cuda>=1.0 " * 4000 for i in range(7)}, "7 NVIDIA_REQUIRE_* variables of 280000 characters"),
])
def test_requirements_beyond_their_bounds_are_refused_before_parsing(env, named):
    """NVIDIA's tools read requirements of any size; the image controls them, so gpuhook
    refuses what no CUDA image needs before it parses anything (docs/security.md)."""
    with pytest.raises(RequirementError) as refused:
        request_requirements.collect(env)
    assert named in refused.value.message and "a CUDA image's requirement is a few hundred bytes" in refused.value.hint


def test_the_largest_accepted_requirement_is_checked_against_many_gpus_quickly():
    """4096 alternatives against 16 GPUs: cuda and driver terms read no GPU and are
    evaluated once, so the time is that of one pass."""
    text = "cuda>=99.0 " * (request_requirements.MAX_ALTERNATIVES - 1) + "cuda>=1.0"
    (requirement,) = request_requirements.collect({"NVIDIA_REQUIRE_CUDA": text})
    host = HostFacts("12.4", "550.54.15", [gpu(i, "9.0", "tesla") for i in range(16)])
    calls = []
    original = plan_requirements._failures
    plan_requirements._failures = lambda *args: calls.append(1) or original(*args)
    try:
        plan_requirements.check(requirement, host)
    finally:
        plan_requirements._failures = original
    assert len(calls) == 1
