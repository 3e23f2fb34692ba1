"""Property-based tests (hypothesis) of the parsers the hook trusts with untrusted input."""

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuhook import config as cfg
from gpuhook import prescan
from gpuhook.request import oci
from gpuhook import driver
from gpuhook.plan import select
from gpuhook.request import resolve
from gpuhook.discover.types import Gpu
from gpuhook.errors import InputError, RequestError

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GPUS = tuple(Gpu(i, f"GPU-{i}0000000-0000-0000-0000-000000000000", i, f"0000:{i}0:00.0", "Sim") for i in range(4))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
# Words a request can be made of, plus noise: what NVIDIA_VISIBLE_DEVICES values look like.
device_words = st.sampled_from(["0", "1", "3", "7", "all", "none", "void", "", " ", GPUS[2].uuid,
                                "GPU-nope", "/var/run/nvidia-container-devices", "０", "MIG-x"])
device_values = st.lists(device_words | st.text(max_size=6), max_size=6).map(",".join)
env_names = st.sampled_from(["NVIDIA_VISIBLE_DEVICES", "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA",
                             "NVIDIA_DRIVER_CAPABILITIES", "PATH", "HOME"])
env_entries = st.lists(st.tuples(env_names, device_values | st.sampled_from(["12.2", "utility", "all"])),
                       max_size=6).map(lambda pairs: [f"{k}={v}" for k, v in pairs])


@SETTINGS
@given(st.binary(max_size=300))
def test_state_parser_accepts_or_raises_input_error_on_any_bytes(raw):
    try:
        oci.parse_state(raw)
    except InputError as err:
        assert "\n" not in err.one_line()


@SETTINGS
@given(st.dictionaries(st.sampled_from(["ociVersion", "id", "status", "pid", "bundle", "annotations", "root"]),
                       json_values, max_size=7))
def test_state_parser_on_any_json_object(doc):
    try:
        state = oci.parse_state(json.dumps(doc).encode())
    except InputError:
        return
    assert state.bundle.startswith("/") and isinstance(state.pid, int) and state.pid >= 0 and state.id


@SETTINGS
@given(st.binary(max_size=300))
def test_prescan_never_raises(raw):
    prescan.bundle_of(raw)
    prescan.may_request_gpu(raw)


@SETTINGS
@given(json_values)
def test_prescan_bundle_agrees_with_json_when_it_answers(value):
    doc = {"id": "x", "bundle": value, "annotations": {"bundle": "/decoy"}}
    raw = json.dumps(doc).encode()
    found = prescan.bundle_of(raw)
    if found is not None:
        assert found == value


@SETTINGS
@given(env_entries, st.booleans(), st.booleans())
def test_prescan_says_no_only_when_the_full_parser_finds_no_request(env, privileged, ensure_ascii):
    spec_doc = {"root": {"path": "rootfs"}, "process": {"env": env, "capabilities": {
        "bounding": ["CAP_SYS_ADMIN"] if privileged else []}}}
    raw = json.dumps(spec_doc, ensure_ascii=ensure_ascii).encode()
    state = json.dumps({"id": "x", "bundle": "/b"}).encode()
    if prescan.may_request_gpu(state, raw):
        return
    spec = oci.parse_spec(raw, "/b")
    try:
        r = resolve.resolve(spec, {}, cfg.from_mapping({}))
    except RequestError:
        raise AssertionError(f"pre-scan skipped an env the full parser rejects: {env}")
    assert r.empty, env


@SETTINGS
@given(device_values, st.booleans())
def test_request_resolution_returns_a_request_or_a_request_error(value, accept_unprivileged):
    spec = oci.parse_spec(json.dumps({"root": {"path": "r"}, "process": {
        "env": [f"NVIDIA_VISIBLE_DEVICES={value}"]}}).encode(), "/b")
    config = cfg.from_mapping({"accept-env-when-unprivileged": accept_unprivileged})
    try:
        r = resolve.resolve(spec, {}, config)
        gpus = select.select(r, GPUS).gpus
    except RequestError as err:
        assert "\n" not in err.one_line()
        return
    assert len(set(gpus)) == len(gpus) and all(g in GPUS for g in gpus)
    if r.wants == resolve.ALL:
        assert gpus == GPUS
    if not accept_unprivileged:
        assert r.empty


@SETTINGS
@given(st.lists(st.sampled_from(list(driver.CAPABILITIES) + ["all", "", " ", "x", "COMPUTE"]), max_size=5))
def test_capabilities_parse_or_name_the_unknown_one(parts):
    value = ",".join(parts)
    try:
        caps = resolve.parse_capabilities(value)
    except RequestError as err:
        assert "unknown driver capability" in err.message
        return
    assert caps <= set(driver.CAPABILITIES) and caps


# Values at and beyond the parsers' size limits: long digit runs (int() refuses over 4300
# digits), thousands of ids, ids longer than any real one.
huge_words = st.one_of(
    st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: ",".join(str(i) for i in range(n))),
    st.integers(min_value=200, max_value=400).map(lambda n: "GPU-" + "a" * n),
    st.integers(min_value=1, max_value=6000).map(lambda n: "0:" + "1" * n),
)


@SETTINGS
@given(st.lists(huge_words | device_words, min_size=1, max_size=4).map(",".join),
       st.sampled_from(["env", "cdi", "mount", "require"]))
# Found by this test: a long failing constraint was echoed whole, past the 1 KiB line bound.
@example(",".join(["99", ",".join(str(i) for i in range(236))]), "require")
def test_oversized_requests_are_request_errors_never_crashes(value, channel):
    """Any request, however large, resolves or is refused with a RequestError (exit 3)."""
    env, annotations, mounts = ["NVIDIA_VISIBLE_DEVICES=0"], None, []
    if channel == "env":
        env = [f"NVIDIA_VISIBLE_DEVICES={value}"]
    elif channel == "cdi":
        annotations = {"cdi.k8s.io/x": ",".join(f"nvidia.com/gpu={v}" for v in value.split(","))}
    elif channel == "mount":
        mounts = [{"destination": f"/var/run/nvidia-container-devices/{v}", "source": "/dev/null", "type": "bind"}
                  for v in value.split(",")[:2000] if v and "/" not in v]
    else:
        env.append(f"NVIDIA_REQUIRE_CUDA=cuda>={value.replace(',', '.')}")
    doc = {"root": {"path": "rootfs"}, "process": {"env": env}, "mounts": mounts}
    if annotations:
        doc["annotations"] = annotations
    spec = oci.parse_spec(json.dumps(doc).encode(), "/b")
    try:
        request = resolve.resolve(spec, {}, cfg.from_mapping({}))
        select.select(request, GPUS)
        from gpuhook.plan import requirements as plan_requirements
        from gpuhook.request import requirements as request_requirements

        for requirement in request_requirements.collect(spec.env):
            plan_requirements.check(requirement, plan_requirements.HostFacts("12.4", "550.54.15", []))
    except RequestError as err:
        assert "\n" not in err.one_line() and len(err.one_line()) < 1024
