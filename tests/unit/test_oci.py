"""The OCI state and config.json: every real runtime's shape accepted, unusable input named."""

import glob
import json
import os

import jsonschema
import pytest

from gpuhook import prescan
from gpuhook.request import oci
from gpuhook.errors import InputError

from conftest import REPO


def state(**fields):
    doc = {"ociVersion": "1.0.2-dev", "id": "c1", "status": "creating", "pid": 42, "bundle": "/run/b"}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize("raw", [
    # runc
    b'{"ociVersion":"1.0.2-dev","id":"t1","status":"creating","pid":5733,"bundle":"/tmp/rt/b"}',
    # crun: ociVersion 1.0, status created, an extra "root"
    b'{"ociVersion":"1.0","id":"t1","status":"created","pid":5733,"bundle":"/tmp/rt/b","root":"rootfs"}',
    # podman: many annotations
    json.dumps({"ociVersion": "1.0.2-dev", "id": "3f1c", "status": "creating", "pid": 5733,
                "bundle": "/var/lib/containers/storage/overlay-containers/3f1c/userdata",
                "annotations": {"io.container.manager": "libpod", "io.podman.annotations.autoremove": "TRUE"}}).encode(),
    # containerd (runc v2 shim): annotations from the CRI
    json.dumps({"ociVersion": "1.1.0", "id": "abc", "status": "creating", "pid": 5733,
                "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc",
                "annotations": {"io.kubernetes.cri.container-type": "container"}}).encode(),
])
def test_real_runtime_states_are_accepted(raw):
    s = oci.parse_state(raw)
    assert s.pid == 5733 and s.bundle.startswith("/")


@pytest.mark.parametrize("raw,message", [
    (b"", "state is empty"),
    (b"   \n", "state is empty"),
    (b'{"id": "x"', "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "must be a JSON object, not list"),
    (b'"text"', "must be a JSON object, not str"),
    (state(id=...), "missing 'id'"),
    (state(id=""), "'id' is empty"),
    (state(id=7), "'id' must be a string, not int"),
    (state(bundle=...), "missing 'bundle'"),
    (state(bundle="relative"), "'bundle' must be an absolute path"),
    (state(bundle="/a\u0000b"), "NUL byte"),
    (state(pid="42"), "'pid' must be a whole number"),
    (state(pid=True), "'pid' must be a whole number"),
    (state(pid=-1), "out of range"),
    (state(pid=2 ** 40), "out of range"),
    (state(pid=1.5), "'pid' must be a whole number"),
    (state(annotations=[]), "'annotations' must be an object"),
    (state(annotations={"a": 1}), "value of 'a' must be a string"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
])
def test_unusable_states_are_named(raw, message):
    with pytest.raises(InputError) as err:
        oci.parse_state(raw)
    assert message in err.value.message
    assert "\n" not in err.value.one_line()


def test_huge_state_is_refused_before_parsing():
    with pytest.raises(InputError, match="larger than"):
        oci.parse_state(b" " * (prescan.MAX_STATE_BYTES + 1))


def test_pid_zero_or_missing_reads_as_zero():
    assert oci.parse_state(state(pid=0)).pid == 0
    assert oci.parse_state(state(pid=...)).pid == 0
    assert oci.parse_state(state(pid=None)).pid == 0


def test_bundle_is_normalized_and_relative_bundles_need_a_base():
    assert oci.parse_state(state(bundle="/run//b/./c/../d/")).bundle == "/run/b/d"
    assert oci.parse_state(state(bundle="../b"), base_dir="/x/states").bundle == "/x/b"


def config(**fields) -> bytes:
    doc = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": ["A=1"]}}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def test_spec_rootfs_relative_and_absolute():
    assert oci.parse_spec(config(), "/b").rootfs == "/b/rootfs"
    assert oci.parse_spec(config(root={"path": "/var/lib/x/merged"}), "/b").rootfs == "/var/lib/x/merged"


def test_spec_env_last_entry_wins_and_odd_entries_are_skipped():
    s = oci.parse_spec(config(process={"env": ["A=1", "A=2", "NOEQUALS", "=x", "B=c=d"]}), "/b")
    assert s.env == {"A": "2", "B": "c=d"}


# docker and podman --privileged (podman 4, as root, writes exactly this; --cap-add SYS_ADMIN
# gets [{"allow": false, "access": "rwm"}] instead).
PRIVILEGED_RULES = {"resources": {"devices": [{"allow": True, "access": "rwm"}]}}


def test_privileged_means_cap_sys_admin_in_the_bounding_set_and_every_device_allowed():
    caps = {"bounding": ["CAP_SYS_ADMIN"], "effective": []}
    assert oci.parse_spec(config(process={"capabilities": caps}, linux=PRIVILEGED_RULES), "/b").privileged
    # A deny-all in front (a runtime's default) changes nothing.
    reset = {"resources": {"devices": [{"allow": False, "access": "rwm"}, {"allow": True, "access": "rwm"}]}}
    assert oci.parse_spec(config(process={"capabilities": caps}, linux=reset), "/b").privileged
    effective_only = {"bounding": [], "effective": ["CAP_SYS_ADMIN"]}
    assert not oci.parse_spec(config(process={"capabilities": effective_only}, linux=PRIVILEGED_RULES),
                              "/b").privileged


@pytest.mark.parametrize("linux", [
    {},  # no device rules: the runtime's default deny
    {"resources": {"devices": [{"allow": False, "access": "rwm"}]}},  # docker --cap-add SYS_ADMIN
    {"resources": {"devices": [{"allow": False, "access": "rwm"},
                               {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"}]}},
])
def test_cap_sys_admin_alone_is_not_privileged(linux):
    caps = {"bounding": ["CAP_SYS_ADMIN"], "effective": ["CAP_SYS_ADMIN"]}
    assert not oci.parse_spec(config(process={"capabilities": caps}, linux=linux), "/b").privileged


@pytest.mark.parametrize("fields,message", [
    ({"root": ...}, "missing 'root'"),
    ({"root": {"path": ""}}, "root.path is empty"),
    ({"root": {"path": "../../.."}}, "resolves to the host's /"),
    ({"root": {"path": 5}}, "'path' must be a string"),
    ({"process": []}, "'process' must be an object"),
    ({"process": {"env": "A=1"}}, "process.env must be a list"),
    ({"process": {"env": [1]}}, "entries must be strings"),
    ({"process": {"capabilities": {"bounding": "CAP_SYS_ADMIN"}}}, "bounding must be a list"),
    ({"mounts": {}}, "'mounts' must be a list"),
    ({"mounts": [{"source": "/x"}]}, "missing 'destination'"),
    ({"mounts": [{"destination": "/x", "options": "ro"}]}, "options must be a list"),
    ({"linux": {"namespaces": [{"path": "/x"}]}}, "missing 'type'"),
    ({"annotations": {"a": None}}, "value of 'a' must be a string"),
])
def test_unusable_config_json_is_named(fields, message):
    with pytest.raises(InputError) as err:
        oci.parse_spec(config(**fields), "/b")
    assert message in err.value.message


def test_missing_bundle_and_config(tmp_path):
    with pytest.raises(InputError, match="has no config.json"):
        oci.read_config_bytes(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        oci.read_config_bytes(str(tmp_path / "file"))


def test_shipped_sample_states_match_the_oci_schema():
    with open(os.path.join(REPO, "schemas", "oci-state.json")) as f:
        schema = json.load(f)
    samples = sorted(glob.glob(os.path.join(REPO, "examples", "states", "*.json")))
    assert samples
    for path in samples:
        with open(path) as f:
            doc = json.load(f)
        doc["bundle"] = "/abs" if not doc["bundle"].startswith("/") else doc["bundle"]
        jsonschema.Draft4Validator(schema).validate(doc)


def test_the_shipped_schema_is_the_one_in_schemas():
    """schemas/oci-state.json is the source; the package ships a copy (gpuhook/data) because
    an installed gpuhook has no repository around it. They must never drift apart."""
    from gpuhook import schema

    with open(os.path.join(REPO, "schemas", "oci-state.json"), "rb") as source, open(schema.SCHEMA_PATH, "rb") as copy:
        assert source.read() == copy.read()
