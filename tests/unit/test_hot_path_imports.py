"""The no-GPU path: what a container without a GPU request costs, checked without timing.

The tests of it that need no root; those that do are in tests/integration/test_hot_path.py.
"""

import json
import os
import sys
import pytest
from conftest import REPO, run_hook_process


def module_names(importtime_output: str) -> set:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_output.splitlines()
            if line.startswith("import time:") and "|" in line}


def imported_modules(args, stdin: bytes) -> set:
    done = run_hook_process(args, stdin, python_flags=("-X", "importtime"))
    assert done.returncode == 0, done.stderr
    return module_names(done.stderr.decode())


def bare_interpreter_modules() -> set:
    import subprocess

    done = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", "-c", "pass"],
                          capture_output=True, text=True, check=True)
    return module_names(done.stderr)


def bundle(tmp_path, env=(), extra=None, pid=1) -> bytes:
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "env": ["PATH=/bin", *env]}, "mounts": [], "annotations": {}}
    if extra:
        spec.update(extra)
    (tmp_path / "config.json").write_text(json.dumps(spec))
    (tmp_path / "rootfs").mkdir(exist_ok=True)
    return json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": pid,
                       "bundle": str(tmp_path)}).encode()


BIG_CONFIG = {"mounts": [{"destination": f"/data/{i}", "source": f"/srv/{i}", "type": "bind",
                          "options": ["rbind", "ro"]} for i in range(2000)],
              "annotations": {f"io.example/{i}": "x" * 100 for i in range(500)}}


@pytest.mark.parametrize("case,env,extra", [
    ("no env at all", (), None),
    ("big config without GPU variables", ("HOME=/root", "LANG=C.UTF-8"), BIG_CONFIG),
    ("void", ("NVIDIA_VISIBLE_DEVICES=void",), None),
    ("empty", ("NVIDIA_VISIBLE_DEVICES=",), None),
])
def test_no_gpu_path_imports_nothing_beyond_the_bare_interpreter(tmp_path, case, env, extra):
    state = bundle(tmp_path, env, extra)
    loaded = imported_modules(["prestart"], state)
    ours = {m for m in loaded if m.startswith("gpuhook")}
    assert ours <= {"gpuhook", "gpuhook.entry", "gpuhook.prescan"}, case
    # Built-in modules (gc, posix) live in the interpreter binary: importing one costs nothing.
    extra_stdlib = loaded - ours - bare_interpreter_modules() - set(sys.builtin_module_names)
    assert extra_stdlib == set(), f"{case}: imported {sorted(extra_stdlib)}"


def test_a_gpu_request_does_take_the_full_path(tmp_path):
    """The converse, so the test above cannot pass by never parsing anything."""
    state = bundle(tmp_path, ("NVIDIA_VISIBLE_DEVICES=0",))
    (tmp_path / "empty.toml").write_text(f'proc-root = "{tmp_path}"\nlog-file = ""\nstate-dir = "{tmp_path}/run"\n')
    done = run_hook_process(["prestart", "--config", str(tmp_path / "empty.toml")], state,
                            python_flags=("-X", "importtime"))
    assert done.returncode != 0  # there is no driver under that proc-root
    assert b"no NVIDIA driver" in done.stderr
    assert {"gpuhook.hook", "gpuhook.fastjson"} <= module_names(done.stderr.decode())


def test_package_init_stays_import_free():
    with open(os.path.join(REPO, "gpuhook", "__init__.py")) as f:
        source = f.read()
    assert "import " not in source
