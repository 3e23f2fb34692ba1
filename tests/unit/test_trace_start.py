"""benchmarks/trace_start.py's counting, on literal records of a made-up tree: what is a
file entered, a function, a step between files and a back-edge (the tool's docstring)."""

import importlib.util
import os

from conftest import REPO

spec = importlib.util.spec_from_file_location("gpuhook_bench_trace_start",
                                              os.path.join(REPO, "benchmarks", "trace_start.py"))
T = importlib.util.module_from_spec(spec)
spec.loader.exec_module(T)

STAGES = {"ranks": {"lang": -3, "base": -1, "entry": 0, "request": 2, "plan": 4},
          "modules": {"gpuhook.hook": "entry", "gpuhook.record": "lang", "gpuhook.cache": "base",
                      "gpuhook.prescan": "entry", "gpuhook.request": "request", "gpuhook.plan": "plan"}}
FILES = {
    "hook.py": "from gpuhook import plan, request\n",
    "plan.py": "from gpuhook import record\n\ndef make():\n    from gpuhook import request\n",
    "request.py": "from gpuhook.record import record\n",
    "cache.py": "from gpuhook.prescan import read_regular_file\n",
    "prescan.py": "",
    "record.py": "",
}
KINDS = """\
K\tgpuhook/hook.py\t1\t<module>\tmodule
K\tgpuhook/hook.py\t5\tprestart\tfunction
K\tgpuhook/plan.py\t1\t<module>\tmodule
K\tgpuhook/plan.py\t3\tmake\tfunction
K\tgpuhook/plan.py\t4\tmake.<locals>.<listcomp>\tcomprehension
K\tgpuhook/request.py\t9\tselect\tfunction
K\tgpuhook/request.py\t20\tRequest.empty\tproperty
K\tgpuhook/request.py\t30\tRequest.names_mig\tproperty
K\tgpuhook/request.py\t40\tis_mig\tfunction
K\tgpuhook/record.py\t1\t<module>\tmodule
K\tgpuhook/record.py\t3\trecord\tfunction
K\tgpuhook/cache.py\t3\tread\tfunction
K\tgpuhook/prescan.py\t3\tread_regular_file\tfunction
K\tgpuhook/prescan.py\t9\tcallback\tfunction
"""


def event(pid, kind, callee, caller):
    return f"E\t{pid}\t1\t{kind}\t{callee}\t{caller}\n"


HOOK = "gpuhook/hook.py\t5\tprestart"
MAKE = "gpuhook/plan.py\t3\tmake"
LISTCOMP = "gpuhook/plan.py\t4\tmake.<locals>.<listcomp>"
EVENTS = [
    event(10, "c", HOOK, "\t\t"),  # called from outside gpuhook (the launcher is left out here)
    event(10, "c", "gpuhook/plan.py\t1\t<module>", HOOK),  # an import: no step
    event(10, "c", "gpuhook/record.py\t3\trecord", "gpuhook/plan.py\t1\t<module>"),
    event(10, "c", MAKE, HOOK),
    event(10, "c", LISTCOMP, MAKE),
    event(10, "c", "gpuhook/request.py\t9\tselect", LISTCOMP),  # made in make's comprehension
    event(10, "r", "gpuhook/request.py\t9\tselect", LISTCOMP),
    event(10, "c", "gpuhook/request.py\t9\tselect", MAKE),  # the same step again, for a reader
    event(10, "c", "gpuhook/request.py\t20\tRequest.empty", MAKE),
    event(10, "c", "gpuhook/request.py\t30\tRequest.names_mig", MAKE),
    event(10, "c", "gpuhook/request.py\t40\tis_mig", "gpuhook/request.py\t30\tRequest.names_mig"),
    event(11, "c", "gpuhook/cache.py\t3\tread", HOOK),  # another process (the worker)
    event(11, "c", "gpuhook/prescan.py\t3\tread_regular_file", "gpuhook/cache.py\t3\tread"),
    event(11, "c", "gpuhook/prescan.py\t9\tcallback", "gpuhook/record.py\t3\trecord"),
]


def analysed(tmp_path, stages=STAGES):
    (tmp_path / "gpuhook").mkdir(exist_ok=True)
    for name, text in FILES.items():
        (tmp_path / "gpuhook" / name).write_text(text)
    record = tmp_path / "trace.tsv"
    record.write_text(KINDS + "".join(EVENTS))
    kinds, events = T.read_record(str(record))
    return T.analyse(kinds, events, stages, str(tmp_path))


def test_files_entered_leave_out_those_only_imported(tmp_path):
    figures = analysed(tmp_path)
    assert figures["processes"] == 2
    assert figures["files"] == ["gpuhook/cache.py", "gpuhook/hook.py", "gpuhook/plan.py", "gpuhook/prescan.py",
                                "gpuhook/record.py", "gpuhook/request.py"]
    assert figures["files_entered"] == 6 and figures["files_imported_only"] == []


def test_functions_count_properties_but_not_comprehensions_or_bodies(tmp_path):
    figures = analysed(tmp_path)
    # prestart, make, select, empty, names_mig, is_mig, record, read, read_regular_file, callback
    assert figures["functions"] == 10
    assert figures["functions_all"] == 11  # and the comprehension


def test_a_step_is_a_distinct_cross_file_call_with_comprehensions_read_as_their_function(tmp_path):
    figures = analysed(tmp_path)
    assert figures["step_list"] == [
        "gpuhook/hook.py prestart -> gpuhook/plan.py make",
        "gpuhook/plan.py make -> gpuhook/request.py select",
        "gpuhook/plan.py make -> gpuhook/request.py Request.empty",
        "gpuhook/plan.py make -> gpuhook/request.py Request.names_mig",
        "gpuhook/hook.py prestart -> gpuhook/cache.py read",
        "gpuhook/cache.py read -> gpuhook/prescan.py read_regular_file",
        "gpuhook/record.py record -> gpuhook/prescan.py callback",
    ]
    assert figures["steps_between_files"] == 7
    assert figures["cross_file_events"] == 11  # every cross-file call and return, imports and repeats included


def test_back_edges_are_real_data_or_passed_in(tmp_path):
    figures = analysed(tmp_path)
    edges = {(b["caller"], b["callee"]): (b["what"], b["direction"]) for b in figures["back_edges"]}
    assert edges == {
        ("gpuhook.plan.make", "gpuhook.request.select"): ("real", "back"),  # plan.py imports request lazily
        ("gpuhook.plan.make", "gpuhook.request.Request.empty"): ("data", "back"),  # a property that calls nothing
        ("gpuhook.plan.make", "gpuhook.request.Request.names_mig"): ("real", "back"),  # a property with logic
        ("gpuhook.cache.read", "gpuhook.prescan.read_regular_file"): ("real", "up"),  # base calling the entry
        ("gpuhook.record.record", "gpuhook.prescan.callback"): ("passed-in", "up"),  # record imports nothing
    }
    assert figures["back_edges_real"] == 3 and figures["back_edges_data"] == 1
    assert figures["back_edge_module_pairs"] == ["gpuhook.cache -> gpuhook.prescan", "gpuhook.plan -> gpuhook.request"]


def test_a_module_the_map_does_not_name_makes_no_back_edge(tmp_path):
    stages = {"ranks": STAGES["ranks"], "modules": {k: v for k, v in STAGES["modules"].items()
                                                    if k != "gpuhook.request"}}
    figures = analysed(tmp_path, stages)
    assert figures["unmapped_modules"] == ["gpuhook.request"]
    assert all("request" not in b["callee"] for b in figures["back_edges"])


def test_the_stage_map_names_every_module_a_start_can_enter():
    # By its own name or its package's: the bare "gpuhook" entry maps only the package itself
    # and would otherwise hide a module the map forgot.
    package = os.path.join(REPO, "gpuhook")
    missing = []
    for directory, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                module = T.module_of(os.path.relpath(os.path.join(directory, name), REPO))
                named = [m for m in T.STAGES["modules"] if m != "gpuhook" and (module == m or module.startswith(m + "."))]
                if module != "gpuhook" and not named and not module.startswith(
                        ("gpuhook.cli", "gpuhook.install", "gpuhook.plugin", "gpuhook.simulate")):
                    missing.append(module)
    assert missing == []
