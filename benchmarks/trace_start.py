#!/usr/bin/env python3
"""How far one GPU start travels through the source tree: files, functions, steps, back-edges.

    sudo .venv/bin/python benchmarks/trace_start.py [--tree DIR] [--health default|off]
                                                    [--image static|glibc] [--stages FILE]
                                                    [--list] [--json FILE]

It starts one container the way benchmarks/run.py's gpu group does: an 8-GPU simulated host
(gpuhook.simulate), a busybox bundle asking for NVIDIA_VISIBLE_DEVICES=0 and
NVIDIA_DRIVER_CAPABILITIES=compute,utility, `runc run`, and the hook registered exactly as
hooks.d/gpuhook.json registers it (benchmarks/harness.hooksd_hook) with `--config` of the
simulated host. One untimed start first warms the config and inventory caches (`--cold`
skips it), so the traced start is the usual one. With `--health default` the simulated
host's config is used as written (health mode fallback: the health step runs on simulated
NVML); `--health off` adds `[health] mode = "off"`, as the gpu benchmark does.

For the traced start, this file is registered as the hook in place of launch.py
(`trace_start.py --hook RECORD LAUNCHER STAGE ...`). It installs a profiler
(sys.setprofile, and threading.setprofile for the health step's threads), then runs the
tree's own launch.py as the program, unchanged: product code is wrapped from outside, as
benchmarks/hook_profile.py does. The profiler is inherited by every process the hook forks
(the namespace worker, and ldconfig's sandbox for the glibc image); each process writes its
records to RECORD, opened before any fork, when it exits (os._exit and posix._exit are
wrapped to flush first). `--tree DIR` traces another checkout's gpuhook (e.g. the tree
before a restructure); the simulated host is built by this checkout.

What is counted (only Python code whose file lies under <tree>/gpuhook/, all traced
processes together; a "function" is a code object, named by (file, first line, qualified
name)):

- events: the profiler's `call` and `return` events of gpuhook code. The caller of a call is
  the nearest gpuhook frame up the stack, so a call made through the standard library
  (json's object_pairs_hook, sorted's key) counts as made by the gpuhook function that
  called the library.
- kinds: `module` and `class` (a module's or a class's body, run on import: import-time
  bodies), `comprehension` (<listcomp>, <genexpr>, ...), `lambda`, `property` (a property's
  getter, found by its qualified name in its class), `launcher` (launch.py's body, which is
  the program), `function` (everything else: functions and methods).
- **files entered**: files in which anything but an import-time body ran: the files a
  reader opens to follow the start. Files whose only code that ran is an import-time body
  (imported for a constant or a type) are listed apart, `files_imported_only`.
- **functions**: distinct `function` and `property` code objects called (comprehensions and
  lambdas belong to the function they are written in; `functions_all` counts them too).
- **steps between files**: distinct (caller, callee) pairs of calls whose two sides are in
  different files, in the order each was first made, where a comprehension or lambda counts
  as the function it is written in and calls into or out of import-time bodies are left out
  (imports are the architecture test's business, not the reading's). A reader follows each
  such call once and comes back along it, so its return is not counted again.
  `cross_file_events` is the raw figure: every call and return event, repeats included,
  whose two sides lie in different files.
- **back-edges**: steps whose caller's module belongs to a later stage than the callee's,
  given a stage map (module -> stage, stage -> rank; the longest dotted prefix of a
  module's name decides). Pipeline stages have ranks 0 and up (entry and the spine 0 ...
  apply 4 in STAGES); the shared layers have negative ranks (lang -3, kernel -2,
  base -1) and may be called from anywhere above them; a shared layer calling a higher rank
  (the state-file reader calling the fast-path module) is an `up` edge and counts as a
  back-edge too. Each back-edge is one of: `data` (the callee is a property that calls
  nothing: a record's derived field), `passed-in` (the caller's file imports nothing of
  the callee's module: a callback or a method of an object handed in), or `real` (the
  caller's file imports the callee's module, lazily or not: a dependency that points
  backwards). `real` is the headline figure. Modules the map does not name are `unmapped`
  and never make a back-edge (they are listed).

`STAGES` below is the map of this tree (the stage packages, docs/architecture.md);
`--stages flat` takes `STAGES_FLAT`, the map of the flat tree before the restructure (a103638
and later, up to 992c9ba: its modules since then are added), for tracing such a tree with
`--tree`; `--stages FILE` takes a JSON document of the same shape ({"ranks": {stage: rank},
"modules": {dotted module or package: stage}}). `--records FILE` analyses a
record file kept earlier (`--keep-records`) without starting a container. Needs root, runc,
busybox-static, gcc and ldconfig (the simulated host); nothing here asserts.
"""

import sys

if sys.argv[1:2] == ["--hook"]:
    # ------------------------------------------------------------------------------------
    # Hook side: runs under `python3 -I -S`, so only what the interpreter has built in (or
    # the standard library without site) is used, and nothing is printed (stdout and stderr
    # belong to the runtime).
    import _thread
    import os
    import posix
    import threading

    RECORD = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    LAUNCHER = os.path.abspath(sys.argv[3])
    TREE = LAUNCHER.rpartition("/")[0].rpartition("/")[0]
    PACKAGE = TREE + "/gpuhook/"
    CUT = len(TREE) + 1
    CO_OPTIMIZED = 0x1
    COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")
    _buffer: list = []
    _kinds: dict = {}
    _exit = posix._exit

    def _kind(frame, code) -> str:
        name = code.co_name
        if name == "<module>":
            return "launcher" if frame.f_globals.get("__name__") == "__main__" else "module"
        if name in COMPREHENSIONS:
            return "comprehension"
        if name == "<lambda>":
            return "lambda"
        if not code.co_flags & CO_OPTIMIZED:
            return "class"
        obj = sys.modules.get(frame.f_globals.get("__name__"))
        parts = code.co_qualname.split(".")
        for part in parts[:-1]:
            if obj is None or part == "<locals>":
                return "function"
            obj = getattr(obj, part, None)
        if obj is not None and isinstance(getattr(obj, "__dict__", {}).get(parts[-1]), property):
            return "property"
        return "function"

    def _profile(frame, event, arg):
        if event != "call" and event != "return":
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(PACKAGE):
            return
        key = (path, code.co_firstlineno, code.co_qualname)
        if key not in _kinds:
            _kinds[key] = kind = _kind(frame, code)
            _buffer.append(f"K\t{path[CUT:]}\t{code.co_firstlineno}\t{code.co_qualname}\t{kind}\n")
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
            caller = caller.f_back
        if caller is None:
            where = "\t\t"
        else:
            c = caller.f_code
            where = f"{c.co_filename[CUT:]}\t{c.co_firstlineno}\t{c.co_qualname}"
        _buffer.append(f"E\t{posix.getpid()}\t{_thread.get_ident()}\t{event[0]}\t{path[CUT:]}\t"
                       f"{code.co_firstlineno}\t{code.co_qualname}\t{where}\n")
        if len(_buffer) > 20000:
            _flush()

    def _flush() -> None:
        data = "".join(_buffer).encode("utf-8", "surrogateescape")
        _buffer.clear()
        try:
            while data:
                data = data[posix.write(RECORD, data):]
        except OSError:
            pass  # e.g. in ldconfig's sandbox, which may have closed it: that process is lost

    def _flushing_exit(code):
        _flush()
        _exit(code)

    def _forget_parents_records() -> None:
        _buffer.clear()  # they are the parent's, who writes them itself

    os.register_at_fork(after_in_child=_forget_parents_records)
    posix._exit = os._exit = _flushing_exit
    sys.argv = [LAUNCHER, *sys.argv[4:]]
    with open(LAUNCHER, "rb") as f:
        program = compile(f.read(), LAUNCHER, "exec")
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    try:
        exec(program, {"__name__": "__main__", "__file__": LAUNCHER, "__builtins__": __builtins__})
    finally:  # launch.py ends with posix._exit; this is for a launcher that returns
        sys.setprofile(None)
        _flush()
    raise SystemExit(0)


# ----------------------------------------------------------------------------------------
# Runner side.

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (REPO, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The stage map of the flat tree (a103638). Ranks: pipeline stages from 0 (the runtime's
# entry and the spine, hook.py) to 5 (apply, the health step included); below 0 the shared
# layers: lang (records, errors, JSON: used by every module), kernel (system calls, /proc,
# paths), base (configuration, state files, the log, device rules). Longest dotted prefix wins.
STAGES_FLAT = {
    "ranks": {"lang": -3, "kernel": -2, "base": -1, "entry": 0, "read": 1, "request": 2, "discover": 3,
              "plan": 4, "apply": 5},
    "modules": {
        "gpuhook": "entry", "gpuhook.__main__": "entry", "gpuhook.launch": "entry", "gpuhook.entry": "entry",
        "gpuhook.prescan": "entry", "gpuhook.hook": "entry", "gpuhook.agent": "entry",
        "gpuhook.errors": "lang", "gpuhook.record": "lang", "gpuhook.fastjson": "lang",
        "gpuhook.linux": "kernel", "gpuhook.mountinfo": "kernel", "gpuhook.procstat": "kernel",
        "gpuhook.child": "kernel", "gpuhook.safepath": "kernel",
        "gpuhook.journal": "base", "gpuhook.config": "base", "gpuhook.cache": "base", "gpuhook.sitepath": "base",
        "gpuhook.devrules": "base", "gpuhook.schema": "base", "gpuhook._vendor": "base",
        "gpuhook.oci": "read",
        "gpuhook.request": "request", "gpuhook.requirements": "request", "gpuhook.dockerd": "request",
        "gpuhook.survey": "discover", "gpuhook.discover": "discover", "gpuhook.inventory": "discover",
        "gpuhook.ldcache": "discover", "gpuhook.nvml": "discover", "gpuhook.cdi": "discover",
        "gpuhook.elf": "discover",
        "gpuhook.plan": "plan",
        "gpuhook.apply": "apply", "gpuhook.actions": "apply", "gpuhook.workerproc": "apply",
        "gpuhook.nsworker": "apply", "gpuhook.ldsandbox": "apply", "gpuhook.grants": "apply",
        "gpuhook.cgroup": "apply", "gpuhook.health": "apply", "gpuhook.served": "apply",
        "gpuhook.leftovers": "apply",
    },
}

# The stage map of the stage packages (docs/architecture.md). Ranks: the runtime's entry and
# the spine (hook.py) 0, then request 1 (the runtime's input included), discover 2, plan 3,
# apply 4 (the health step included); below 0 the shared layers: lang (records, errors,
# JSON), kernel (kernel/), base (configuration, the log, device rules, NVIDIA's conventions:
# driver.py). The CLI, the installer, the plugin and the simulator are no stage of a start.
STAGES = {
    "ranks": {"lang": -3, "kernel": -2, "base": -1, "entry": 0, "request": 1, "discover": 2, "plan": 3, "apply": 4},
    "modules": {
        "gpuhook": "entry", "gpuhook.__main__": "entry", "gpuhook.launch": "entry", "gpuhook.entry": "entry",
        "gpuhook.prescan": "entry", "gpuhook.hook": "entry", "gpuhook.agent": "entry",
        "gpuhook.stoporder": "entry",
        "gpuhook.errors": "lang", "gpuhook.record": "lang", "gpuhook.fastjson": "lang",
        "gpuhook.kernel": "kernel",
        "gpuhook.journal": "base", "gpuhook.config": "base", "gpuhook.sitepath": "base", "gpuhook.schema": "base",
        "gpuhook.devrules": "base", "gpuhook.driver": "base", "gpuhook._vendor": "base",
        "gpuhook.request": "request", "gpuhook.discover": "discover", "gpuhook.plan": "plan",
        "gpuhook.apply": "apply", "gpuhook.health": "apply",
    },
}


def module_of(path: str) -> str:
    """gpuhook/cgroup/v1.py -> gpuhook.cgroup.v1; a package's __init__.py -> the package."""
    name = path[:-3] if path.endswith(".py") else path
    name = name.replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def stage_of(module: str, stages: dict):
    """(stage, rank) of `module` by the longest dotted prefix in the map; (None, None) if unmapped."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        stage = stages["modules"].get(".".join(parts[:end]))
        if stage is not None:
            return stage, stages["ranks"][stage]
    return None, None


def read_record(path: str) -> tuple:
    """({function: kind}, [events]) from a hook-side record file. A function is
    (file, line, qualname); an event is (pid, tid, "c"|"r", callee, caller or None)."""
    kinds, events = {}, []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "K":
                kinds[(fields[1], int(fields[2]), fields[3])] = fields[4]
            elif fields[0] == "E":
                callee = (fields[4], int(fields[5]), fields[6])
                caller = (fields[7], int(fields[8]), fields[9]) if fields[7] else None
                events.append((int(fields[1]), int(fields[2]), fields[3], callee, caller))
    return kinds, events


READ_KINDS = ("function", "property", "lambda", "comprehension", "launcher")
BODY_KINDS = ("module", "class")


def owner(function: tuple, kinds: dict) -> tuple:
    """The function a comprehension or lambda is written in (itself for anything else), as
    (file, qualname): a reader reads them together."""
    path, _line, qualname = function
    if kinds.get(function) in ("comprehension", "lambda"):
        parts = qualname.split(".")
        while len(parts) >= 2 and parts[-2] == "<locals>" and parts[-1].startswith("<"):
            parts = parts[:-2]
        qualname = ".".join(parts)
    return path, qualname


def gpuhook_imports(tree: str, path: str) -> set:
    """The gpuhook modules the file at `path` (relative to `tree`) imports anywhere in it
    (lazy imports in functions included), as dotted names; `from gpuhook.x import y` counts
    as importing gpuhook.x and gpuhook.x.y."""
    import ast

    try:
        with open(os.path.join(tree, path), "rb") as f:
            node = ast.parse(f.read(), path)
    except (OSError, SyntaxError):
        return set()
    package = module_of(path) if path.endswith("__init__.py") else module_of(path).rpartition(".")[0]
    found = set()
    for item in ast.walk(node):
        if isinstance(item, ast.Import):
            found.update(alias.name for alias in item.names)
        elif isinstance(item, ast.ImportFrom):
            base = item.module or ""
            if item.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - item.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in item.names)
    return {name for name in found if name == "gpuhook" or name.startswith("gpuhook.")}


def analyse(kinds: dict, events: list, stages: dict, tree: str = REPO) -> dict:
    """The figures of the module docstring from one start's records."""
    called = {}  # function -> first caller (None: called from outside gpuhook)
    pids = []
    cross_events = 0
    edges = {}  # (caller owner, callee owner) -> calls, import-time bodies left out
    for pid, _tid, event, callee, caller in events:
        if pid not in pids:
            pids.append(pid)
        if caller is not None and caller[0] != callee[0]:
            cross_events += 1
        if event != "c":
            continue
        called.setdefault(callee, caller)
        if caller is None or kinds.get(callee) in BODY_KINDS or kinds.get(caller) in BODY_KINDS:
            continue
        edge = (owner(caller, kinds), owner(callee, kinds))
        edges[edge] = edges.get(edge, 0) + 1

    def kind(function):
        return kinds.get(function, "function")

    read_files = sorted({f[0] for f in called if kind(f) in READ_KINDS})
    all_files = sorted({f[0] for f in called})
    functions = sorted(f for f in called if kind(f) in ("function", "property"))
    # A property that calls nothing (its own comprehensions aside) reads a record's derived
    # field; one that calls other functions is logic like any other.
    calling = {caller for caller, callee in edges if caller != callee}
    properties = {(f[0], f[2]) for f in called if kind(f) == "property"} - calling
    steps = [e for e in edges if e[0][0] != e[1][0]]  # in the order first made (dicts keep it)

    imports = {}
    back, unmapped = [], set()
    for caller, callee in steps:
        caller_module, callee_module = module_of(caller[0]), module_of(callee[0])
        cs, cr = stage_of(caller_module, stages)
        es, er = stage_of(callee_module, stages)
        for module, stage in ((caller_module, cs), (callee_module, es)):
            if stage is None:
                unmapped.add(module)
        if cr is None or er is None:
            continue
        if cr >= 0 and 0 <= er < cr:
            direction = "back"
        elif cr < 0 and er > cr:
            direction = "up"
        else:
            continue
        if caller[0] not in imports:
            imports[caller[0]] = gpuhook_imports(tree, caller[0])
        if callee in properties:
            what = "data"
        elif callee_module not in imports[caller[0]]:
            what = "passed-in"
        else:
            what = "real"
        back.append({"caller": f"{caller_module}.{caller[1]}", "callee": f"{callee_module}.{callee[1]}",
                     "modules": f"{caller_module} -> {callee_module}", "stages": f"{cs} -> {es}",
                     "direction": direction, "what": what, "calls": edges[(caller, callee)]})
    order = {"real": 0, "data": 1, "passed-in": 2}
    back.sort(key=lambda b: (order[b["what"]], b["caller"], b["callee"]))
    real = [b for b in back if b["what"] == "real"]

    def describe(function):
        return f"{function[0]}:{function[1]} {function[2]}"

    return {
        "processes": len(pids),
        "files_entered": len(read_files),
        "files": read_files,
        "files_imported_only": sorted(set(all_files) - set(read_files)),
        "functions": len(functions),
        "functions_all": len([f for f in called if kind(f) not in BODY_KINDS]),
        "steps_between_files": len(steps),
        "cross_file_events": cross_events,
        "back_edges_real": len(real),
        "back_edges_data": sum(b["what"] == "data" for b in back),
        "back_edges_passed_in": sum(b["what"] == "passed-in" for b in back),
        "back_edge_module_pairs": sorted({b["modules"] for b in real}),
        "back_edges": back,
        "unmapped_modules": sorted(unmapped),
        "function_list": [f"{describe(f)} [{kind(f)}]" for f in functions],
        "step_list": [f"{a[0]} {a[1]} -> {b[0]} {b[1]}" for a, b in steps],
    }


class _Context:
    """What benchmarks/run.py's SimGpu needs of its runner context."""

    def __init__(self, workdir: str, launcher: str):
        import harness as H

        self.workdir = workdir
        self.launcher = launcher
        self.hook = H.hooksd_hook(launcher=launcher)
        self.sim_gpu = None
        self.state_root = f"{workdir}/state"  # run.py puts it on a tmpfs; a trace counts calls, not ms


def trace(tree: str, health: str, image: str, cold: bool, workdir: str) -> tuple:
    """Run the traced start; returns (kinds, events, setup description)."""
    import run as R

    launcher = os.path.join(os.path.abspath(tree), "gpuhook", "launch.py")
    if not os.path.exists(launcher):
        raise SystemExit(f"trace_start: {launcher} does not exist (--tree names a gpuhook checkout)")
    ctx = _Context(workdir, launcher)
    sim = R.SimGpu(ctx, name="trace", health_text="" if health == "default" else None)
    glibc = image == "glibc"
    check = "test -c /dev/nvidia0" + (" && test -s /etc/ld.so.cache" if glibc else "")
    if not cold:
        sim.add("warm", R.runc_hook(sim.hook), "0", glibc, check)
        sim.run("warm")
    record = f"{workdir}/trace.tsv"
    args = sim.hook["args"]
    launcher_at = args.index(launcher)
    entry = {"path": sim.hook["path"],
             "args": [*args[:launcher_at], os.path.abspath(__file__), "--hook", record, *args[launcher_at:]],
             "env": sim.hook["env"], "timeout": 60}
    sim.add("traced", entry, "0", glibc, check)
    sim.run("traced")
    decision = sim.last_log().get("decision")
    kinds, events = read_record(record)
    setup = {"tree": os.path.abspath(tree), "health": sim.health or "as the simulated host's config (fallback)",
             "image": image, "warm_caches": not cold, "decision": decision,
             "request": "NVIDIA_VISIBLE_DEVICES=0, NVIDIA_DRIVER_CAPABILITIES=compute,utility, 8-GPU simulated host"}
    return kinds, events, setup


def render(doc: dict, listing: bool) -> str:
    f, setup = doc["figures"], doc["setup"]
    lines = [f"traced start: {setup['request']}; image {setup['image']}; health {setup['health']}; "
             f"decision: {setup['decision']}",
             f"tree {setup['tree']}; {f['processes']} traced processes",
             f"  files entered            {f['files_entered']}  (+{len(f['files_imported_only'])} imported only)",
             f"  functions called         {f['functions']}  ({f['functions_all']} with lambdas and comprehensions)",
             f"  steps between files      {f['steps_between_files']}  (raw cross-file call and return events: "
             f"{f['cross_file_events']})",
             f"  back-edges               {f['back_edges_real']} real, in {len(f['back_edge_module_pairs'])} module "
             f"pairs (+{f['back_edges_data']} property reads, +{f['back_edges_passed_in']} through objects "
             f"handed in)"]
    if f["unmapped_modules"]:
        lines.append(f"  unmapped modules: {', '.join(f['unmapped_modules'])}")
    lines.append("back-edges:")
    for b in f["back_edges"]:
        lines.append(f"  [{b['what']}, {b['direction']}] {b['stages']}: {b['caller']} -> {b['callee']} "
                     f"({b['calls']} call{'s' if b['calls'] != 1 else ''})")
    lines.append("files entered: " + " ".join(f["files"]))
    if f["files_imported_only"]:
        lines.append("imported only: " + " ".join(f["files_imported_only"]))
    if listing:
        lines.append("functions:")
        lines += [f"  {x}" for x in f["function_list"]]
        lines.append("steps between files, in the order first made:")
        lines += [f"  {x}" for x in f["step_list"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", default=REPO, help="the gpuhook checkout to trace (default: this one)")
    p.add_argument("--health", choices=("default", "off"), default="default")
    p.add_argument("--image", choices=("static", "glibc"), default="static")
    p.add_argument("--cold", action="store_true", help="no warm-up start: trace a start with cold caches")
    p.add_argument("--stages", help="stage map: 'flat' (STAGES_FLAT, for a tree before the restructure) or a "
                                    "JSON file; default STAGES, this tree's")
    p.add_argument("--list", action="store_true", help="also list every function and every step")
    p.add_argument("--json", help="write the figures and lists as JSON to this file")
    p.add_argument("--records", help="analyse an existing record file instead of starting a container")
    p.add_argument("--keep-records", help="copy the raw record file of the traced start here")
    p.add_argument("--workdir", default=None, help="parent of the temporary directory")
    args = p.parse_args(argv)
    stages = STAGES
    if args.stages == "flat":
        stages = STAGES_FLAT
    elif args.stages:
        with open(args.stages) as f:
            stages = json.load(f)
    if args.records:
        kinds, events = read_record(args.records)
        setup = {"tree": args.tree, "health": "?", "image": "?", "warm_caches": None, "decision": None,
                 "request": f"records from {args.records}"}
    else:
        if os.geteuid() != 0:
            print("trace_start: needs root (runc containers, a simulated host)", file=sys.stderr)
            return 2
        workdir = tempfile.mkdtemp(prefix="gpuhook-trace-", dir=args.workdir)
        try:
            kinds, events, setup = trace(args.tree, args.health, args.image, args.cold, workdir)
            if args.keep_records:
                shutil.copyfile(f"{workdir}/trace.tsv", args.keep_records)
        except Exception as err:  # noqa: BLE001 - the runner says what failed, in one line
            print(f"trace_start: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    doc = {"setup": setup, "figures": analyse(kinds, events, stages, os.path.abspath(args.tree))}
    print(render(doc, args.list))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
