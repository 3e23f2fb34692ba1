"""The byte-level pre-scan: it may only say "no request" when there certainly is none."""

import json

import pytest

from gpuhook import prescan


def spec(env=(), **extra) -> bytes:
    doc = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": list(env)}}
    doc.update(extra)
    return json.dumps(doc).encode()


STATE = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 3, "bundle": "/b"}).encode()


# The corpus of hostile and ordinary inputs; tests/unit/test_native_prescan.py runs it through
# native/prescan.c too.
MAY_REQUEST_CASES = [
    (spec(["PATH=/bin"]), False),
    (spec([]), False),
    (spec(["NVIDIA_VISIBLE_DEVICES=void"]), False),
    (spec(["NVIDIA_VISIBLE_DEVICES="]), False),
    (spec(["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES="]), False),
    (spec(["NVIDIA_VISIBLE_DEVICES=0"]), True),
    (spec(["NVIDIA_VISIBLE_DEVICES=none"]), True),
    (spec(["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES=all"]), True),
    (spec(["CUDA_VERSION=12.2.0"]), True),
    (spec(["PATH=/bin"], mounts=[{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null"}]), True),
    (spec([], annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}), True),
    # The marker outside an env entry: only the full parser can tell.
    (spec(["A=1"], annotations={"note": "set NVIDIA_VISIBLE_DEVICES to use GPUs"}), True),
    # A marker spelled with JSON escapes must not slip past.
    (b'{"process":{"env":["NVIDIA_VISIBLE\\u005fDEVICES=all"]}}', True),
    (b'{"process":{"env":["\\u004eVIDIA_VISIBLE_DEVICES=all"]}}', True),
    # Escapes of characters no marker uses are harmless (Go escapes & < > like this).
    (b'{"process":{"env":["URL=http://x/?a=1\\u0026b=2"]}}', False),
    (b'{"process":{"env":["bad escape \\uZZZZ"]}}', True),
]


@pytest.mark.parametrize("document,expected", MAY_REQUEST_CASES)
def test_may_request_gpu(document, expected):
    assert prescan.may_request_gpu(STATE, document) is expected


def test_state_annotations_are_scanned_too():
    state = json.dumps({"id": "c", "bundle": "/b", "annotations": {"cdi.k8s.io/a": "nvidia.com/gpu=1"}}).encode()
    assert prescan.may_request_gpu(state, spec(["PATH=/bin"])) is True


BUNDLE_CASES = [
    (b'{"ociVersion":"1.0.2","id":"x","status":"creating","pid":1,"bundle":"/run/b"}', "/run/b"),
    (b' {\n "bundle" : "/a b/c" , "id": "x"}', "/a b/c"),
    # A value that merely contains "bundle": ... is not the member.
    (b'{"annotations":{"k":"\\"bundle\\":\\"/evil\\""},"bundle":"/real"}', "/real"),
    (b'{"annotations":{"bundle":"/nested"},"bundle":"/top"}', "/top"),
    (b'{"bundle":["/x"]}', None),
    (b'{"bundle":"relative/path"}', None),
    (b'{"bundle":"/with\\/escape"}', None),  # left to the full parser
    (b'[{"bundle":"/x"}]', None),
    (b'{"bundle":"/x"', None),
    (b'{"bundle":"/unterminated', None),
    (b'', None),
    (b'not json', None),
    (b'{"bundle":"/x\\\\"}', None),
]


@pytest.mark.parametrize("state,bundle", BUNDLE_CASES)
def test_bundle_of(state, bundle):
    assert prescan.bundle_of(state) == bundle


def test_escaped_quotes_and_backslashes_are_skipped_correctly():
    raw = b'{"a":"x\\\\","bundle":"/b","c":"\\"}{[","id":"i"}'
    assert prescan.top_level_strings(raw) == {b"a": b"x\\\\", b"bundle": b"/b", b"c": b'\\"}{[', b"id": b"i"}


ARGV_CASES = [
    (["prestart"], ("prestart", None)),
    (["prestart", "--config", "/etc/x.toml"], ("prestart", "/etc/x.toml")),
    (["createRuntime", "--config=/x"], ("createRuntime", "/x")),
    (["prestart", "--dry-run"], None),
    (["prestart", "--config"], None),
    ([], None),
]


@pytest.mark.parametrize("argv,expected", ARGV_CASES)
def test_split_hook_args(argv, expected):
    assert prescan.split_hook_args(argv) == expected
