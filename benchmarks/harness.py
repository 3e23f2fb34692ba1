"""Measurement pieces for benchmarks/run.py, importable without root or runc.

- `hooksd_hook`: the hook entry exactly as hooks.d/gpuhook.json registers it, with the
  substitutions a checkout needs (the launcher path, the interpreter path, and the packaged
  native front: a front built by native/build.py, or none: the Python command alone);
- `spawn`: one child started with os.posix_spawn and reaped with os.wait4, timed with
  perf_counter_ns around both; every candidate in a comparison is started this way;
- `interleave`: rounds of all candidates in a fresh random order per round, so machine
  noise (other engineers' tests, CPU frequency, page cache) hits every candidate alike;
- `peak_rss_kib`: peak RSS of one child through a fresh measuring process (/usr/bin/time,
  else busybox time), because a child's maxrss includes whatever its parent had mapped
  when it forked or vforked: measured from this Python process it would include ours;
- `summary`, `ratio_row`: medians, ranges and ratios as plain dicts for the JSON;
- `importtime_top`: `-X importtime` output turned into the top imports.

Nothing here asserts on time; tests/integration/test_benchmarks.py checks these pieces work.
"""

import json
import os
import random
import shutil
import statistics
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOKSD = os.path.join(REPO, "hooks.d", "gpuhook.json")
LAUNCHER = os.path.join(REPO, "gpuhook", "launch.py")
# The venv's interpreter as is: resolving the symlink would lose the venv (it is how Python
# finds pyvenv.cfg). Falls back to the interpreter running this file.
VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python3")


def default_python() -> str:
    return VENV_PYTHON if os.path.exists(VENV_PYTHON) else "/usr/bin/python3"


def hooksd_hook(python: str | None = None, launcher: str = LAUNCHER, hooksd: str = HOOKSD,
                extra_args=(), front: str | None = None) -> dict:
    """The hook entry of the shipped hooks.d file with this checkout substituted in.

    Substitutions, nothing else changes (flags, stage, env, timeout stay). Where the shipped
    file runs the packaged native front (`path` is .../gpuhook-front, its args the front then
    the Python command), the front becomes `front` (native/build.py's binary), or, with no
    `front`, is dropped: the Python command alone. Then the Python command's interpreter (the
    shipped /usr/bin/python3) becomes `python`, in `path` when no front runs it and in its
    argv[0] where the shipped file spells it as that same path (a bare "python3" stays as it
    is); and the one argument that is the installed launcher (.../gpuhook/launch.py) becomes
    this checkout's. Returns {"path", "args", "env", "timeout", "substituted": {...}}.
    """
    python = python or default_python()
    with open(hooksd) as f:
        shipped = json.load(f)["hook"]
    args = list(shipped["args"])
    substituted = {}
    if os.path.basename(shipped["path"]) == "gpuhook-front":
        if args[:1] != [shipped["path"]] or len(args) < 2:
            raise ValueError(f"{hooksd}: the front must be argv[0], followed by the Python command")
        substituted["front"] = [shipped["path"], front]
        args = args[1:]  # the Python command the front runs
        shipped = dict(shipped, path=args[0])
    where = [i for i, arg in enumerate(args) if arg.endswith("/gpuhook/launch.py")]
    if len(where) != 1:
        raise ValueError(f"{hooksd}: expected exactly one .../gpuhook/launch.py argument, found {len(where)}")
    substituted.update({"path": [shipped["path"], python], "launcher": [args[where[0]], launcher]})
    args[where[0]] = launcher
    if args and args[0] == shipped["path"]:
        substituted["argv0"] = [args[0], python]
        args[0] = python
    args += list(extra_args)
    if front:
        args = [front, *args]
    return {
        "path": front or python,
        "args": args,
        "env": list(shipped.get("env", [])),
        "timeout": shipped.get("timeout"),
        "substituted": substituted,
    }


def bare_interpreter_argv(hook: dict) -> list:
    """`python3 -I -S -c pass` spelled like the hook: same argv[0] and interpreter flags."""
    args = hook["args"]
    launcher_at = next(i for i, arg in enumerate(args) if arg.endswith("/gpuhook/launch.py"))
    return args[:launcher_at] + ["-c", "pass"]


def env_dict(entries) -> dict:
    """An OCI env list ("K=V") as a dict for posix_spawn."""
    out = {}
    for entry in entries:
        key, _, value = entry.partition("=")
        out[key] = value
    return out


class Spawned:
    __slots__ = ("ns", "status", "rusage")

    def __init__(self, ns, status, rusage):
        self.ns = ns
        self.status = status
        self.rusage = rusage

    @property
    def ms(self) -> float:
        return self.ns / 1e6

    @property
    def cpu_ms(self) -> float:
        return (self.rusage.ru_utime + self.rusage.ru_stime) * 1e3

    @property
    def exit_code(self) -> int:
        return os.waitstatus_to_exitcode(self.status)


def spawn(path: str, argv: list, env: dict, stdin: str = os.devnull, stdout: str = os.devnull,
          stderr: str = os.devnull) -> Spawned:
    """Start `path` with posix_spawn (vfork+exec in glibc), wait with wait4; wall time in ns.

    The file actions (stdin from a file, stdout/stderr to files) run in the child before
    exec, so they are inside the timed span for every candidate alike.
    """
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, stdin, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
        (os.POSIX_SPAWN_OPEN, 2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
    ]
    start = time.perf_counter_ns()
    pid = os.posix_spawn(path, argv, env, file_actions=actions)
    _, status, rusage = os.wait4(pid, 0)
    return Spawned(time.perf_counter_ns() - start, status, rusage)


def interleave(candidates: dict, rounds: int, warmup: int = 1, seed: int = 8, between=None,
               every: dict | None = None) -> dict:
    """Run every candidate once per round, in a fresh random order each round.

    `candidates` maps a name to a callable returning a Spawned (or a number of ms); a
    callable may raise to abort. `between(name)` runs untimed before each timed call (e.g.
    a fresh rootfs). `every` maps a name to N: that candidate runs only every Nth round (a
    slow informational one). Returns {name: {"ms": [...], "cpu_ms": [...]}} in round order,
    so samples of the same index were taken side by side (for candidates of every round).
    """
    rng = random.Random(seed)
    names = list(candidates)
    samples = {name: {"ms": [], "cpu_ms": [], "minflt": []} for name in names}
    for _ in range(warmup):
        for name in names:
            if between is not None:
                between(name)
            candidates[name]()
    for index in range(rounds):
        order = [name for name in names if index % (every or {}).get(name, 1) == 0]
        rng.shuffle(order)
        for name in order:
            if between is not None:
                between(name)
            result = candidates[name]()
            if isinstance(result, Spawned):
                samples[name]["ms"].append(result.ms)
                samples[name]["cpu_ms"].append(result.cpu_ms)
                samples[name]["minflt"].append(result.rusage.ru_minflt)
            else:
                samples[name]["ms"].append(float(result))
    return samples


def summary(values: list) -> dict:
    """median, min, max, p10, p90 and n of a list of numbers (empty list: n=0 only)."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    if len(ordered) >= 2:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ordered[0]
    return {"n": len(ordered), "median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p10": p10, "p90": p90}


def paired_ratios(candidate: list, baseline: list) -> dict:
    """Per-round ratios candidate/baseline (samples taken side by side): median, p10, p90."""
    ratios = [c / b for c, b in zip(candidate, baseline) if b > 0]
    s = summary(ratios)
    return {k: s[k] for k in ("median", "p10", "p90")} if ratios else {}


def judge(value, op: str, limit) -> bool | None:
    if value is None or limit is None:
        return None
    return value <= limit if op == "<=" else value >= limit


def row(id: str, group: str, label: str, unit: str, stats: dict, baseline: str | None = None,
        baseline_stats: dict | None = None, target: dict | None = None, paired: dict | None = None,
        note: str = "", extra: dict | None = None) -> dict:
    """One result row. `target` is {"on": "ratio"|"value", "op": "<=", "limit": x, "text": ...}."""
    ratio = None
    if baseline_stats and baseline_stats.get("n") and stats.get("n") and baseline_stats["median"] > 0:
        ratio = stats["median"] / baseline_stats["median"]
    out = {"id": id, "group": group, "label": label, "unit": unit, **stats, "baseline": baseline,
           "ratio": ratio, "paired_ratio": paired or {}, "target": target, "pass": None, "note": note}
    if target:
        measured = ratio if target["on"] == "ratio" else stats.get("median")
        out["pass"] = judge(measured, target["op"], target["limit"])
    if extra:
        out.update(extra)
    return out


def unavailable_row(id: str, group: str, label: str, why: str, target: dict | None = None) -> dict:
    """A row without a number: never a fake value."""
    return {"id": id, "group": group, "label": label, "unit": "", "n": 0, "median": None, "min": None,
            "max": None, "baseline": None, "ratio": None, "paired_ratio": {}, "target": target,
            "pass": None, "note": why, "unavailable": True}


# --- peak RSS -------------------------------------------------------------------------

def rss_tool() -> list | None:
    """argv prefix of a measuring process that prints a child's peak RSS in KiB to a file."""
    if os.path.exists("/usr/bin/time"):
        return ["/usr/bin/time", "-f", "%M", "-o"]
    busybox = shutil.which("busybox")
    if busybox:
        return [busybox, "time", "-v", "-o"]  # parsed below; busybox has no -f
    return None


def _parse_rss(text: str) -> int:
    for line in text.splitlines():
        line = line.strip()
        if line.isdigit():
            return int(line)
        if line.startswith("Maximum resident set size"):
            return int(line.rsplit(":", 1)[1].strip())
    raise ValueError(f"no peak RSS in {text!r}")


def peak_rss_kib(path: str, argv: list, env: dict, stdin: str = os.devnull, tool: list | None = None) -> int:
    """Peak RSS (KiB) of one run of `path argv`, measured by a fresh measuring process.

    The measuring process (GNU time: fork+exec+wait4) is small and written in C, so the
    child's maxrss (which starts at what the forking process had mapped) is the child's
    own; `rss_floor_kib` reports that floor. GNU time execs `path` with argv[0] = path, not
    the registered "python3": the same for every candidate of a comparison, and the
    interpreter then finds its venv (a few more stat calls), which can only add to the RSS.
    """
    tool = tool or rss_tool()
    if tool is None:
        raise RuntimeError("no /usr/bin/time and no busybox to measure peak RSS")
    fd, out = tempfile.mkstemp(prefix="gpuhook-rss-")
    os.close(fd)
    try:
        done = spawn(tool[0], tool + [out, path] + list(argv[1:]), env, stdin=stdin)
        if done.exit_code != 0:
            raise RuntimeError(f"{path} exited with {done.exit_code} under {tool[0]}")
        with open(out) as f:
            return _parse_rss(f.read())
    finally:
        os.unlink(out)


# --- -X importtime ----------------------------------------------------------------------

def parse_importtime(text: str) -> list:
    """[(module, self_us, cumulative_us, depth)] from `-X importtime` stderr, in order."""
    found = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        fields = line[len("import time:"):].split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue  # the header line
        name = fields[2].rstrip()
        depth = (len(name) - len(name.lstrip())) // 2
        found.append((name.strip(), int(fields[0]), int(fields[1]), depth))
    return found


def importtime_top(text: str, top: int = 15) -> dict:
    entries = parse_importtime(text)
    return {
        "modules": len(entries),
        "total_self_us": sum(e[1] for e in entries),
        "top_level_cumulative_us": sum(e[2] for e in entries if e[3] == 0),
        "top": [{"module": m, "self_us": s, "cumulative_us": c, "depth": d}
                for m, s, c, d in sorted(entries, key=lambda e: -e[2])[:top]],
        "names": [e[0] for e in entries],
    }


def rss_floor_kib(tool: list | None = None) -> int:
    """What the measuring process itself reports for /bin/true: nothing measured is below it."""
    return peak_rss_kib("/bin/true", ["true"], {"PATH": "/usr/bin:/bin"}, tool=tool)
