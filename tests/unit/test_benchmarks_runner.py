"""benchmarks/run.py works: its pieces, and short runs of its groups. No timing assertions.

The tests of it that need no root; those that do are in tests/integration/test_benchmarks.py.
"""

import importlib.util
import json
import os
import sys
import types
import pytest
from conftest import REPO, require


BENCH = os.path.join(REPO, "benchmarks")


def load(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(f"gpuhook_bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = load("harness")


def shipped_python_command() -> dict:
    """hooks.d/gpuhook.json's hook entry, less the packaged native front that runs it."""
    with open(os.path.join(REPO, "hooks.d", "gpuhook.json")) as f:
        shipped = json.load(f)["hook"]
    assert shipped["path"] == "/usr/libexec/gpuhook/gpuhook-front" and shipped["args"][0] == shipped["path"]
    return dict(shipped, path=shipped["args"][1], args=shipped["args"][1:])


def test_the_packaged_front_becomes_a_built_front_or_is_dropped():
    with open(os.path.join(REPO, "hooks.d", "gpuhook.json")) as f:
        front_path = json.load(f)["hook"]["path"]
    without = H.hooksd_hook(sys.executable)
    assert without["path"] == sys.executable and without["substituted"]["front"] == [front_path, None]
    built = H.hooksd_hook(sys.executable, front="/tmp/built/gpuhook-front", extra_args=["--config", "/c"])
    assert built["path"] == "/tmp/built/gpuhook-front"
    assert built["args"] == ["/tmp/built/gpuhook-front", *without["args"], "--config", "/c"]
    assert built["substituted"]["front"] == [front_path, "/tmp/built/gpuhook-front"]


def test_hooksd_substitution_changes_only_the_interpreter_and_the_launcher():
    shipped = shipped_python_command()
    hook = H.hooksd_hook(sys.executable)
    assert hook["path"] == sys.executable and os.access(hook["path"], os.X_OK)
    assert hook["env"] == shipped["env"] and hook["timeout"] == shipped["timeout"]
    assert len(hook["args"]) == len(shipped["args"])
    changed = [(a, b) for a, b in zip(shipped["args"], hook["args"]) if a != b]
    expected = [(hook["substituted"]["launcher"][0], os.path.join(REPO, "gpuhook", "launch.py"))]
    if shipped["args"][0] == shipped["path"]:  # argv[0] spelled as the interpreter's path
        expected.insert(0, (shipped["path"], sys.executable))
    assert changed == expected
    assert hook["args"][1:3] == ["-I", "-S"] and hook["args"][4:] == shipped["args"][4:]
    assert hook["substituted"]["path"] == [shipped["path"], sys.executable]


def test_argv0_is_kept_when_the_shipped_file_spells_it_python3(tmp_path):
    old_style = tmp_path / "hook.json"
    old_style.write_text(json.dumps({"version": "1.0.0", "hook": {
        "path": "/usr/bin/python3", "args": ["python3", "-I", "-S", "/x/gpuhook/launch.py", "prestart"],
        "env": ["PATH=/bin"], "timeout": 30}}))
    hook = H.hooksd_hook("/opt/venv/bin/python3", hooksd=str(old_style))
    assert hook["args"] == ["python3", "-I", "-S", os.path.join(REPO, "gpuhook", "launch.py"), "prestart"]
    assert "argv0" not in hook["substituted"]


def test_hooksd_substitution_needs_the_launcher_argument(tmp_path):
    bad = tmp_path / "hook.json"
    bad.write_text(json.dumps({"version": "1.0.0", "hook": {"path": "/usr/bin/python3",
                                                            "args": ["python3", "-c", "pass"]}}))
    with pytest.raises(ValueError, match="launch.py"):
        H.hooksd_hook(sys.executable, hooksd=str(bad))


def test_substituted_argv_runs_the_no_gpu_path_and_the_bare_interpreter(tmp_path):
    run = load("run")
    hook = H.hooksd_hook(sys.executable)
    env = H.env_dict(hook["env"])
    assert env == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    bare = H.bare_interpreter_argv(hook)
    assert bare == [hook["args"][0], "-I", "-S", "-c", "pass"]
    for name, (_label, spec, _info) in run.nogpu_cases().items():
        state = run.write_bundle(str(tmp_path / name), spec, f"t-{name}")
        for argv in (hook["args"], bare):
            done = H.spawn(hook["path"], argv, env, stdin=state, stderr=str(tmp_path / "err"))
            assert done.exit_code == 0, (name, argv, (tmp_path / "err").read_text())
    # The same argv with a GPU request does go further (and fails: no driver on this config).
    gpu = run.base_spec()
    gpu["process"]["env"].append("NVIDIA_VISIBLE_DEVICES=0")
    state = run.write_bundle(str(tmp_path / "gpu"), gpu, "t-gpu")
    (tmp_path / "c.toml").write_text(f'proc-root = "{tmp_path}"\nlog-file = ""\nstate-dir = "{tmp_path}/run"\n')
    done = H.spawn(hook["path"], hook["args"] + ["--config", str(tmp_path / "c.toml")], env, stdin=state,
                   stderr=str(tmp_path / "err"))
    assert done.exit_code != 0 and "gpuhook:" in (tmp_path / "err").read_text()


def test_summary_ratio_and_verdicts():
    s = H.summary([3.0, 1.0, 2.0, 10.0])
    assert (s["n"], s["min"], s["median"], s["max"]) == (4, 1.0, 2.5, 10.0)
    assert H.summary([]) == {"n": 0}
    base = H.summary([2.0, 2.0])
    target = {"on": "ratio", "op": "<=", "limit": 1.15, "text": "≤ 1.15×"}
    good = H.row("a", "g", "a", "ms", H.summary([2.2, 2.2]), "b", base, target)
    bad = H.row("c", "g", "c", "ms", H.summary([2.4, 2.4]), "b", base, target)
    assert good["ratio"] == pytest.approx(1.1) and good["pass"] is True and bad["pass"] is False
    absolute = H.row("d", "g", "d", "MiB", H.summary([8.0]), target={"on": "value", "op": "<=", "limit": 9.0})
    assert absolute["pass"] is True and absolute["ratio"] is None
    assert H.paired_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])["median"] == 2.0
    missing = H.unavailable_row("x", "g", "x", "not available yet", target)
    assert missing["median"] is None and missing["pass"] is None and missing["unavailable"]


def test_interleave_runs_every_candidate_each_round_in_varying_order():
    seen = []
    candidates = {name: (lambda n=name: seen.append(n) or 1.0) for name in "abc"}
    samples = H.interleave(candidates, rounds=20, warmup=1, seed=1)
    assert {k: len(v["ms"]) for k, v in samples.items()} == {"a": 20, "b": 20, "c": 20}
    rounds = [tuple(seen[i:i + 3]) for i in range(3, len(seen), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds) and len(set(rounds)) > 1


def test_importtime_parsing():
    text = ("import time: self [us] | cumulative | imported package\n"
            "import time:       100 |        100 |   _io\n"
            "import time:       200 |        300 | io\n"
            "import time:        50 |         50 | gpuhook\n"
            "something else on stderr\n")
    assert H.parse_importtime(text) == [("_io", 100, 100, 1), ("io", 200, 300, 0), ("gpuhook", 50, 50, 0)]
    top = H.importtime_top(text, top=2)
    assert top["modules"] == 3 and top["total_self_us"] == 350 and top["top_level_cumulative_us"] == 350
    assert [e["module"] for e in top["top"]] == ["io", "_io"]


def test_peak_rss_is_measured_in_a_fresh_small_process():
    require(H.rss_tool() is not None, "needs /usr/bin/time or busybox")
    floor = H.rss_floor_kib()
    hook = H.hooksd_hook(sys.executable)
    python = H.peak_rss_kib(hook["path"], H.bare_interpreter_argv(hook), H.env_dict(hook["env"]))
    assert 0 < floor < python  # the measuring process is below what it measures


def ctx_stub():
    return types.SimpleNamespace(s={"health_repeat": 2})


def test_health_rows_say_not_available_yet_without_the_file(tmp_path):
    run = load("run")
    rows = run.group_health(ctx_stub(), path=str(tmp_path / "health_bench.py"))
    assert [r["id"] for r in rows] == ["health.1", "health.8", "health.16"]
    for r in rows:
        assert r["median"] is None and r["ratio"] is None and r["pass"] is None
        assert "not available yet" in r["note"] and "not available yet" in run.fmt_row(r)[1]
    assert rows[-1]["target"]["limit"] == 1.2 and rows[0]["target"] is None


def test_health_rows_use_the_bench_module_when_it_exists(tmp_path):
    run = load("run")
    bench = tmp_path / "health_bench.py"
    bench.write_text(
        "calls = []\n"
        "def measure(gpus, latency_ms, repeat):\n"
        "    calls.append((gpus, latency_ms, repeat))\n"
        "    return {'median_s': 1.1, 'min_s': 1.05, 'max_s': 1.3, 'serial_estimate_s': gpus * latency_ms / 1000}\n")
    rows = run.group_health(ctx_stub(), path=str(bench))
    assert [(r["median"], r["pass"]) for r in rows] == [(1.1, None), (1.1, None), (1.1, True)]
    assert rows[-1]["ratio"] == pytest.approx(1.1 / 16)
    bench.write_text("def measure(gpus, latency_ms, repeat):\n    raise RuntimeError('no simulated host')\n")
    rows = run.group_health(ctx_stub(), path=str(bench))
    assert all(r["median"] is None and "no simulated host" in r["note"] for r in rows)
    bench.write_text("this is not python (\n")
    rows = run.group_health(ctx_stub(), path=str(bench))
    assert all(r["median"] is None and "SyntaxError" in r["note"] for r in rows)
