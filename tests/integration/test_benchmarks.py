"""benchmarks/run.py works: its pieces, and short runs of its groups. No timing assertions:
the figures themselves are benchmarks/RESULTS.md's business, not a test's."""

import json
import os
import re
import shutil
import subprocess
import sys
from conftest import REPO, require_root_tools


BENCH = os.path.join(REPO, "benchmarks")


RUN = os.path.join(BENCH, "run.py")


def run_runner(tmp_path, *args, timeout=600):
    out = tmp_path / "out.json"
    argv = [sys.executable, RUN, "--quick", "--latest", str(tmp_path / "latest.json"), "--json", str(out),
            "--workdir", str(tmp_path), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads((tmp_path / "latest.json").read_text()) == doc
    return doc, done.stdout


def rows_by_id(doc):
    return {r["id"]: r for r in doc["rows"]}


def assert_ratio_row(row, baseline):
    assert row["baseline"] == baseline
    assert row["n"] >= 1 and row["min"] <= row["median"] <= row["max"]
    assert isinstance(row["ratio"], float) and row["ratio"] > 0
    assert row["target"]["op"] == "<=" and isinstance(row["pass"], bool)


def test_quick_nogpu_run_writes_wellformed_json_and_markdown(tmp_path):
    doc, stdout = run_runner(tmp_path, "--only", "nogpu", "--write-markdown", str(tmp_path / "R.md"))
    rows = rows_by_id(doc)
    assert doc["errors"] == {} and doc["meta"]["mode"] == "quick"
    assert doc["meta"]["hook"]["args"][3] == os.path.join(REPO, "gpuhook", "launch.py")
    for case in ("noenv", "big", "void", "huge"):
        assert_ratio_row(rows[f"nogpu.wall.{case}"], "nogpu.wall.bare")
        assert rows[f"nogpu.wall.{case}"]["path_taken"] == "fast path"
        assert rows[f"nogpu.rss.{case}"]["unit"] == "MiB" and rows[f"nogpu.rss.{case}"]["median"] > 0
    assert rows["nogpu.wall.huge"]["target"].get("informational") is True
    assert rows["nogpu.wall.bare"]["ratio"] is None
    assert "median" in stdout and "1.15×" in stdout
    markdown = (tmp_path / "R.md").read_text()
    assert "| benchmark | median | min–max | ratio | target | result |" in markdown


def test_quick_runc_run(tmp_path):
    require_root_tools("runc", "busybox")
    doc, _ = run_runner(tmp_path, "--only", "runc")
    rows = rows_by_id(doc)
    assert doc["errors"] == {}
    assert_ratio_row(rows["runc.gpuhook"], "runc.true")
    assert rows["runc.none"]["median"] > 0
    assert rows["runc.python"]["baseline"] == "runc.true" and rows["runc.python"]["ratio"] > 0
    # the Python command alone, in the same rounds; the gpuhook row runs it behind the front
    assert rows["runc.pycommand"]["baseline"] == "runc.true" and rows["runc.pycommand"]["target"] is None
    if shutil.which("gcc"):
        assert "native front" in rows["runc.gpuhook"]["note"]


def test_quick_gpu_path_importtime_and_breakdown(tmp_path):
    require_root_tools("runc", "busybox", "gcc", "ldconfig")
    doc, stdout = run_runner(tmp_path, "--only", "gpu", "--importtime", "--breakdown")
    rows = rows_by_id(doc)
    assert doc["errors"] == {}
    for name in ("static", "glibc", "all", "static-python", "glibc-python"):
        assert rows[f"gpu.{name}"]["ratio"] > 0  # each timed start checked /dev/nvidia* inside
    # The target rows are gpuhook as the packages run it: every start through the front was the
    # agent's; the Python command alone is informational, and none of its starts was.
    for name in ("static", "glibc", "all"):
        served = re.search(r"starts the agent served: (\d+) of (\d+)", rows[f"gpu.{name}"]["note"])
        assert served and int(served[1]) == int(served[2]) > 0, rows[f"gpu.{name}"]["note"]
    for name in ("static-python", "glibc-python"):
        assert rows[f"gpu.{name}"]["target"] is None
        served = re.search(r"starts the agent served: (\d+) of (\d+)", rows[f"gpu.{name}"]["note"])
        assert served and int(served[1]) == 0 < int(served[2]), rows[f"gpu.{name}"]["note"]
    assert rows["gpu.static"]["target"]["limit"] == 1.5 and rows["gpu.glibc"]["target"]["limit"] == 1.8
    assert "gpuhook.hook" not in {e["module"] for e in doc["importtime"]["nogpu"]["beyond_bare"]}
    assert "gpuhook.hook" in {e["module"] for e in doc["importtime"]["gpu"]["top"]}
    for image in ("static", "glibc"):
        phases = [p["phase"] for p in doc["breakdown"][image]["phases"]]
        assert phases[0].startswith("total in the hook process") and "hook.run_hook" in phases
        assert any(p.startswith("[worker] ") for p in phases)  # timers reach the forked worker
        # One record per step the worker takes: every device node, bind mount, symlink, the
        # /proc mask (and, for the glibc image, ldconfig), each named by its container path.
        steps = [p[len("[worker] step: "):] for p in phases if p.startswith("[worker] step: ")]
        assert "device node /dev/nvidia0" in steps and "mount /usr/bin/nvidia-smi" in steps
        assert any(s.startswith("symlink ") for s in steps) and any(s.startswith("mask ") for s in steps)
        assert ("ldconfig" in steps) == (image == "glibc")
        totals = doc["breakdown"][image]["steps"]
        assert totals["mount"] > 0 and set(totals) <= {"device node", "mount", "symlink", "mask", "ldconfig", "install"}
        worker = doc["breakdown"][image]["worker"]
        assert worker["worker start-up (fork to gpuhook.apply.nsworker loaded)"] > 0
    assert "per step of the namespace worker" in stdout
    assert doc["breakdown"]["teardown"]["runc_run_ms_fast_exit"]["n"] >= 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith("gpuhook-bench-")]  # scratch removed


def test_trace_start_follows_the_hook_and_its_forked_worker(tmp_path):
    require_root_tools("runc", "busybox", "gcc", "ldconfig")
    out = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "trace_start.py"), "--health", "off", "--json",
                           str(out), "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    assert doc["setup"]["decision"] == "gpus injected"  # the traced hook did the start, unchanged
    assert figures["processes"] == 2  # the hook and the namespace worker
    assert {"gpuhook/launch.py", "gpuhook/hook.py", "gpuhook/plan/make.py", "gpuhook/apply/nsworker.py"} <= set(figures["files"])
    assert any(step.endswith("gpuhook/apply/nsworker.py serve") for step in figures["step_list"])  # seen in the worker
    assert figures["functions"] > 0 and figures["steps_between_files"] > 0 and figures["unmapped_modules"] == []
    assert {b["what"] for b in figures["back_edges"]} <= {"real", "data", "passed-in"}
    assert not [n for n in os.listdir(tmp_path) if n.startswith("gpuhook-trace-")]  # scratch removed


def test_quick_installed_start_and_stop_with_the_packaged_services(tmp_path):
    """The installed group: both hooks.d files (run by the native front, built for the run),
    the packaged config, the services the packages start (the health daemon and the agent,
    from their units' ExecStart): start and stop timed apart."""
    require_root_tools("runc", "busybox", "gcc")
    # A short scratch dir: the daemon's unix socket lives in it (108 bytes at most).
    doc, _ = run_runner(tmp_path, "--only", "installed", "--workdir", "/tmp")
    rows = rows_by_id(doc)
    assert doc["errors"] == {}
    assert_ratio_row(rows["installed.start.installed"], "installed.start.none")
    assert_ratio_row(rows["installed.stop.installed"], "installed.stop.none")
    assert rows["installed.start.installed"]["target"]["limit"] == 1.6
    assert rows["installed.stop.installed"]["target"]["limit"] == 1.2
    assert "gpuhook-health.service" in rows["installed.start.none"]["note"]
    assert "gpuhook-agent.service" in rows["installed.start.none"]["note"]
    # Every timed GPU start went through the front to the agent the package starts.
    served = re.search(r"GPU starts the agent served: (\d+) of (\d+)", rows["installed.start.none"]["note"])
    assert served and int(served[1]) == int(served[2]) > 0, rows["installed.start.none"]["note"]
    # The daemon the package starts served the timed starts; the stops cleaned up after them.
    note = rows["installed.life.installed"]["note"]
    assert '"daemon": "prepared by the health daemon"' in note and "nvml: not loaded" in note
    assert "poststop decisions: cleaned up" in note
    for name in ("no-daemon", "nogpu", "true"):
        assert rows[f"installed.stop.{name}"]["ratio"] > 0 and rows[f"installed.stop.{name}"]["target"] is None
