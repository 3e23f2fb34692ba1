"""native/prescan.c, the no-GPU path without Python: it may exit 0 only where gpuhook's own
fast path (gpuhook.entry, gpuhook/prescan.py) exits 0 as well, and otherwise runs the Python
hook with exactly the bytes the runtime gave it. Run over prescan.py's corpus
(tests/unit/test_prescan.py), hostile files and seeded random mutations."""

import json
import os
import random
import shutil
import stat
import subprocess

import pytest

from conftest import REPO, require
from gpuhook import entry, prescan
from test_prescan import ARGV_CASES, BUNDLE_CASES, MAY_REQUEST_CASES, STATE

HANDED_OFF = 42  # the stand-in "Python hook" below exits with this


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    require(shutil.which("gcc") is not None, "needs gcc")
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_build", os.path.join(REPO, "native", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    out = tmp_path_factory.mktemp("native")
    binary = build.build(str(out))
    # The Python hook's stand-in: records its stdin and arguments, exits HANDED_OFF.
    recorder = out / "python3"
    recorder.write_text(f'#!/bin/sh\ncat > "$0.stdin"\nprintf "%s\\n" "$@" > "$0.argv"\nenv > "$0.env"\nls /proc/$$/fd > "$0.fds"\nexit {HANDED_OFF}\n')
    recorder.chmod(0o755)
    return binary, str(recorder)


def run(native, state: bytes, stage_args=("prestart",), launcher="/usr/lib/python3/dist-packages/gpuhook/launch.py"):
    """(exit code, the stdin the Python hook got or None, its argv or None)."""
    binary, recorder = native
    for suffix in (".stdin", ".argv"):
        if os.path.exists(recorder + suffix):
            os.unlink(recorder + suffix)
    argv = [binary, recorder, "-I", "-S", launcher, *stage_args]
    done = subprocess.run(argv, input=state, capture_output=True, timeout=30)
    if done.returncode != HANDED_OFF:
        assert not os.path.exists(recorder + ".stdin")
        return done.returncode, None, None
    with open(recorder + ".stdin", "rb") as f, open(recorder + ".argv") as g:
        return done.returncode, f.read(), g.read().splitlines()


def python_exits_early(state: bytes) -> bool:
    """Whether gpuhook.entry.run_stage returns 0 before the full parser (its fast path)."""
    if len(state) > prescan.MAX_STATE_BYTES:
        return False
    bundle = prescan.bundle_of(state)
    if bundle is None:
        return False
    try:
        spec = prescan.read_regular_file(bundle + "/config.json", prescan.MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError):
        return False
    return len(spec) <= prescan.MAX_CONFIG_BYTES and not prescan.may_request_gpu(state, spec)


def has_marker(*documents) -> bool:
    return any(marker in d for d in documents for marker in prescan.MARKERS)


def check(native, state: bytes, config: bytes | None = None):
    """The invariant on one input: exit 0 implies Python's fast path; exit 0 exactly when
    Python's fast path holds and no marker is spelled out; else the hook got these bytes."""
    code, got, argv = run(native, state)
    if code == 0:
        assert python_exits_early(state), state[:200]
    else:
        assert code == HANDED_OFF and got == state
        assert argv == ["-I", "-S", "/usr/lib/python3/dist-packages/gpuhook/launch.py", "prestart"]
    bundle = prescan.bundle_of(state)
    plain = config is not None and bundle is not None and bundle.isascii()
    if plain and python_exits_early(state) and not has_marker(state, config):
        assert code == 0, state[:200]
    return code


def state_for(bundle: str, **extra) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 3, "bundle": bundle,
                       **extra}, separators=(",", ":")).encode()


@pytest.mark.parametrize("document,expected", MAY_REQUEST_CASES)
def test_prescan_corpus_as_config(native, tmp_path, document, expected):
    (tmp_path / "config.json").write_bytes(document)
    code = check(native, state_for(str(tmp_path)), document)
    if expected:  # a possible request: always the Python hook's to decide
        assert code == HANDED_OFF


@pytest.mark.parametrize("state,bundle", BUNDLE_CASES)
def test_prescan_bundle_corpus_as_state(native, state, bundle):
    # None of these bundles exists: the Python hook always gets them, unchanged.
    code, got, _ = run(native, state)
    assert code == HANDED_OFF and got == state


def test_a_plain_container_exits_at_once_and_the_python_hook_never_runs(native, tmp_path):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    assert run(native, state_for(str(tmp_path))) == (0, None, None)


def test_state_annotations_are_scanned_too(native, tmp_path):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    state = state_for(str(tmp_path), annotations={"cdi.k8s.io/a": "nvidia.com/gpu=1"})
    assert run(native, state)[:2] == (HANDED_OFF, state)


@pytest.mark.parametrize("argv,expected", ARGV_CASES)
def test_only_the_invocations_pythons_fast_path_serves_are_short_cut(native, tmp_path, argv, expected):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    state = state_for(str(tmp_path))
    fast = expected is not None and argv[0] in entry.HOOK_STAGES
    code, got, seen = run(native, state, stage_args=argv)
    if fast:
        assert code == 0
    else:  # handed over untouched: the Python hook reads the runtime's stdin itself
        assert code == HANDED_OFF and got == state and seen[3:] == argv


def test_other_launchers_and_flags_are_handed_over_unread(native):
    code, got, argv = run(native, STATE, launcher="/opt/other/launch.py")
    assert code == HANDED_OFF and got == STATE and argv[2] == "/opt/other/launch.py"


def test_a_fifo_or_a_directory_as_config_json_never_blocks_and_goes_to_python(native, tmp_path):
    os.mkfifo(tmp_path / "config.json")
    state = state_for(str(tmp_path))
    assert run(native, state)[:2] == (HANDED_OFF, state)
    os.unlink(tmp_path / "config.json")
    os.mkdir(tmp_path / "config.json")
    assert run(native, state)[:2] == (HANDED_OFF, state)


def test_a_symlinked_config_json_is_read_as_python_reads_it(native, tmp_path):
    (tmp_path / "real.json").write_bytes(MAY_REQUEST_CASES[0][0])
    os.symlink("real.json", tmp_path / "config.json")
    assert run(native, state_for(str(tmp_path)))[0] == 0  # as prescan.read_regular_file: followed
    os.unlink(tmp_path / "config.json")
    os.symlink("/dev/zero", tmp_path / "config.json")  # a device: never read
    assert run(native, state_for(str(tmp_path)))[0] == HANDED_OFF


def test_an_unreadable_config_json_goes_to_python(native, tmp_path):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    (tmp_path / "config.json").chmod(0)
    code = run(native, state_for(str(tmp_path)))[0]
    assert code == (0 if os.geteuid() == 0 else HANDED_OFF)  # root reads it anyway, as Python would


def test_an_oversized_state_is_handed_over_cut_where_python_cuts_it(native, tmp_path):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    padding = "x" * (prescan.MAX_STATE_BYTES + 10)
    state = state_for(str(tmp_path), annotations={"k": padding})
    code, got, _ = run(native, state)
    assert code == HANDED_OFF and got == state[: prescan.MAX_STATE_BYTES + 1]


def test_a_bundle_path_that_is_long_or_not_ascii_goes_to_python(native, tmp_path):
    deep = state_for(str(tmp_path) + "/d" * 3000)  # past PATH_MAX: the C program never builds it
    assert run(native, deep)[:2] == (HANDED_OFF, deep)
    odd = tmp_path / "bündel"
    odd.mkdir()
    (odd / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    state = json.dumps({"id": "c", "bundle": str(odd)}, ensure_ascii=False).encode()
    assert run(native, state)[:2] == (HANDED_OFF, state)


def mutations(seed: int, count: int):
    """Seeded byte mutations of ordinary states: quotes, backslashes, brackets, escapes,
    markers and NULs inserted, deleted or swapped at random places."""
    rng = random.Random(seed)
    pieces = [b'"', b"\\", b"\\\\", b'\\"', b"{", b"}", b"[", b"]", b",", b":", b"\x00", b"\\u005f", b"\\u0041",
              b"\\uZZ", b"\\u", b"NVIDIA_VISIBLE_DEVICES", b"cdi.k8s.io", b'"bundle":', b"\xff", b" "]
    return rng, pieces, count


def test_random_mutations_never_exit_0_where_python_would_not(native, tmp_path):
    (tmp_path / "config.json").write_bytes(MAY_REQUEST_CASES[0][0])
    base = state_for(str(tmp_path), annotations={"a": "b", "n": "x\\\"y"})
    rng, pieces, count = mutations(27, 300)
    exits = {0: 0, HANDED_OFF: 0}
    for _ in range(count):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data) + 1)
            if rng.random() < 0.3 and at < len(data):
                del data[at:at + rng.randint(1, 8)]
            else:
                data[at:at] = rng.choice(pieces)
        exits[check(native, bytes(data), MAY_REQUEST_CASES[0][0])] += 1
    assert exits[0] and exits[HANDED_OFF]  # both outcomes were exercised


def test_the_markers_come_from_prescan_py(native):
    header = open(os.path.join(os.path.dirname(native[0]), "markers.h")).read()
    for marker in prescan.MARKERS:
        assert f'"{marker.decode()}"' in header
    with open(os.path.join(REPO, "native", "prescan.c")) as f:
        source = f.read()
    for marker in prescan.MARKERS:  # spelled nowhere in the C source itself
        assert marker.decode() not in source
    assert stat.S_IMODE(os.stat(native[0]).st_mode) & 0o111


@pytest.mark.parametrize("case,env,extra,exits", [
    # tests/integration/test_hot_path.py's containers: the native program ends the plain ones
    # itself and hands the ones that name NVIDIA_VISIBLE_DEVICES (void, empty) to Python.
    ("no env at all", (), None, 0),
    ("big config without GPU variables", ("HOME=/root", "LANG=C.UTF-8"), {
        "mounts": [{"destination": f"/data/{i}", "source": f"/srv/{i}", "type": "bind", "options": ["rbind", "ro"]}
                   for i in range(2000)],
        "annotations": {f"io.example/{i}": "x" * 100 for i in range(500)}}, 0),
    ("void", ("NVIDIA_VISIBLE_DEVICES=void",), None, HANDED_OFF),
    ("empty", ("NVIDIA_VISIBLE_DEVICES=",), None, HANDED_OFF),
    ("a request", ("NVIDIA_VISIBLE_DEVICES=0",), None, HANDED_OFF),
])
def test_hot_path_containers(native, tmp_path, case, env, extra, exits):
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"args": ["sh"], "env": ["PATH=/bin", *env]},
            "mounts": [], "annotations": {}, **(extra or {})}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    state = state_for(str(tmp_path), annotations=spec["annotations"])
    assert check(native, state, (tmp_path / "config.json").read_bytes()) == exits, case


@pytest.mark.parametrize(
    "argv",
    [
        ["python3", "/usr/lib/python3/dist-packages/gpuhook/launch.py", "prestart"],
        ["PYTHON", "/usr/lib/python3/dist-packages/gpuhook/launch.py", "prestart", "--config", "gpuhook.toml"],
        ["PYTHON", "/usr/lib/python3/dist-packages/gpuhook/launch.py", "prestart", "--config=./gpuhook.toml"],
    ],
)
def test_a_relative_interpreter_or_config_path_is_refused_with_exit_2(native, argv):
    binary, recorder = native
    argv = [recorder if a == "PYTHON" else a for a in argv]
    if os.path.exists(recorder + ".argv"):
        os.unlink(recorder + ".argv")
    done = subprocess.run([binary, *argv], input=b"{}", capture_output=True, timeout=10)
    assert done.returncode == 2
    assert done.stderr.count(b"\n") == 1 and b"absolute path" in done.stderr
    assert not os.path.exists(recorder + ".argv")


def test_the_python_hook_gets_a_clean_environment(native, tmp_path):
    binary, recorder = native
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUHOOK_CONFIG": "/etc/gpuhook/config.toml",
        "GPUHOOK_DOCKER_DATA_ROOT": "/var/lib/docker",
        "LD_PRELOAD": "/tmp/evil.so",
        "PYTHONPATH": "/tmp/evil",
        "PYTHONSTARTUP": "/tmp/evil.py",
    }
    done = subprocess.run([binary, recorder, "/x/other.py"], input=b"{}", env=env, capture_output=True, timeout=10)
    assert done.returncode == HANDED_OFF
    got = dict(line.split("=", 1) for line in open(recorder + ".env").read().splitlines() if "=" in line)
    for name in ("PATH", "GPUHOOK_CONFIG", "GPUHOOK_DOCKER_DATA_ROOT"):
        assert got[name] == env[name]
    for name in ("LD_PRELOAD", "PYTHONPATH", "PYTHONSTARTUP"):
        assert name not in got
    assert got[prescan.FRONT_VARIABLE] == str(prescan.FRONT_PROTOCOL)


def test_the_runtime_cannot_set_the_front_protocol(native):
    binary, recorder = native
    env = {"PATH": "/usr/bin:/bin", prescan.FRONT_VARIABLE: "999"}
    done = subprocess.run([binary, recorder, "/x/other.py"], input=b"{}", env=env, timeout=10)
    assert done.returncode == HANDED_OFF
    lines = open(recorder + ".env").read().splitlines()
    assert [line for line in lines if line.startswith(prescan.FRONT_VARIABLE + "=")] == [
        f"{prescan.FRONT_VARIABLE}={prescan.FRONT_PROTOCOL}"
    ]


def test_python_refuses_a_front_of_another_protocol_and_says_reinstall(monkeypatch, capsys):
    import posix

    monkeypatch.setitem(posix.environ, prescan.FRONT_VARIABLE.encode(), str(prescan.FRONT_PROTOCOL + 1).encode())
    with pytest.raises(SystemExit) as stop:
        entry.main(["prestart"])
    assert stop.value.code == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reinstall" in err


def test_python_accepts_its_own_front_protocol(monkeypatch):
    import posix

    monkeypatch.setitem(posix.environ, prescan.FRONT_VARIABLE.encode(), str(prescan.FRONT_PROTOCOL).encode())
    assert entry.check_front(prescan) is None


@pytest.mark.parametrize(
    "envp",
    [
        [b"GPUHOOK_CONFIG=/a.toml", b"GPUHOOK_CONFIG=/b.toml"],
        [b"GPUHOOK_CONFIG=relative.toml"],
    ],
)
def test_gpuhook_config_twice_or_relative_is_refused_with_exit_2(native, envp):
    binary, recorder = native
    # libc's execve takes the environment as a list, duplicates included (a dict cannot).
    envs = [b"PATH=/usr/bin:/bin", *envp]
    script = (
        "import ctypes,sys; libc = ctypes.CDLL(None, use_errno=True); A = ctypes.c_char_p * 8; "
        "argv = A(*[a.encode() for a in sys.argv[1:]], None); "
        f"envp = A(*{envs!r}, None); "
        "libc.execve(sys.argv[1].encode(), argv, envp); sys.exit(99)"
    )
    done = subprocess.run(
        ["python3", "-c", script, binary, recorder, "/usr/lib/python3/dist-packages/gpuhook/launch.py", "prestart"],
        input=b"{}", capture_output=True, timeout=10,
    )
    assert done.returncode == 2
    assert done.stderr.count(b"\n") == 1 and b"GPUHOOK_CONFIG" in done.stderr


def test_no_inherited_descriptor_reaches_the_python_hook(native):
    binary, recorder = native
    read_end, write_end = os.pipe()
    os.dup2(read_end, 37)
    try:
        done = subprocess.run([binary, recorder, "/x/other.py"], input=b"{}", pass_fds=(37,), timeout=10)
    finally:
        for fd in (37, read_end, write_end):
            os.close(fd)
    assert done.returncode == HANDED_OFF
    assert "37" not in open(recorder + ".fds").read().split()
