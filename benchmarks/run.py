#!/usr/bin/env python3
"""gpuhook's performance figures (README, Performance): every target side by side in one run.

    sudo .venv/bin/python benchmarks/run.py [--quick] [--only GROUPS] [--json FILE]
                                            [--importtime] [--breakdown] [--write-markdown [FILE]]

Groups (all by default; --only takes a comma-separated list):

  nogpu    the hook as hooks.d registers it, for containers that want no GPU, vs
           `python3 -I -S -c pass` with the same interpreter: wall time and peak RSS
  runc     `runc run` of a busybox container with the hook vs with /bin/true as the hook
  gpu      `runc run` on an 8-GPU simulated host with NVIDIA_VISIBLE_DEVICES=0 vs no hook
  health   benchmarks/health_bench.py: 1, 8 and 16 GPUs, each check slowed by 1 s
  daemon   a GPU start with health on, NVML init 1.5 s: without and with the health daemon, and health off
           (the Python command alone: informational)
  installed  start and stop as the packages install gpuhook (front, agent, health daemon) vs no hook
  importtime   (also --importtime) `-X importtime` of the no-GPU path and the warm GPU path
  breakdown    (also --breakdown) where the warm GPU path's time goes, by phase

Candidates of a group run interleaved, in a fresh random order per round, so noise from
other processes hits all of them alike; ratios are of medians. Results: a table on stdout,
JSON in benchmarks/results/latest.json (and --json FILE), and with --write-markdown the
committed benchmarks/RESULTS.md. See benchmarks/README.md.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The repository for gpuhook, tests/ for the runc harness (tests/helpers/testbed.py).
for path in (os.path.join(REPO, "tests"), REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import harness as H  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")
LATEST = os.path.join(RESULTS_DIR, "latest.json")
MARKDOWN = os.path.join(HERE, "RESULTS.md")
HEALTH_BENCH = os.path.join(HERE, "health_bench.py")
HOOK_PROFILE = os.path.join(HERE, "hook_profile.py")
GROUPS = ("nogpu", "runc", "gpu", "health", "daemon", "installed")
EXTRA_GROUPS = ("importtime", "breakdown")

# Repetitions: rounds of every candidate of a group (plus untimed warm-up rounds).
SETTINGS = {
    "full": {"nogpu_rounds": 400, "rss_rounds": 15, "runc_rounds": 100, "gpu_rounds": 60,
             "health_repeat": 5, "importtime_runs": 5, "breakdown_runs": 25, "warmup": 3},
    "quick": {"nogpu_rounds": 30, "rss_rounds": 3, "runc_rounds": 6, "gpu_rounds": 4,
              "health_repeat": 1, "importtime_runs": 2, "breakdown_runs": 3, "warmup": 1},
}
TARGETS = {
    "nogpu_wall": {"on": "ratio", "op": "<=", "limit": 1.15, "text": "≤ 1.15×"},
    "nogpu_rss": {"on": "value", "op": "<=", "limit": 9.0, "text": "≤ 9 MiB"},
    "runc": {"on": "ratio", "op": "<=", "limit": 1.2, "text": "≤ 1.2×"},
    "gpu": {"on": "ratio", "op": "<=", "limit": 1.5, "text": "≤ 1.5×"},
    "gpu_glibc": {"on": "ratio", "op": "<=", "limit": 1.8, "text": "≤ 1.8×"},
    "health": {"on": "value", "op": "<=", "limit": 1.2, "text": "≤ 1.2 s"},
    "installed_start": {"on": "ratio", "op": "<=", "limit": 1.6, "text": "≤ 1.6×"},
    "installed_stop": {"on": "ratio", "op": "<=", "limit": 1.2, "text": "≤ 1.2×"},
}
HEALTH_GPUS = (1, 8, 16)
HEALTH_LATENCY_MS = 1000
SIM_GPUS = 8


class Unavailable(Exception):
    """A group cannot run here (not root, a tool missing): its rows say why, with no number."""


# --- the containers' configuration ------------------------------------------------------

def base_spec() -> dict:
    """A config.json like `runc spec` writes (runc's default mounts, namespaces, masks)."""
    return {
        "ociVersion": "1.0.2-dev",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["/bin/busybox", "true"],
                    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
                    "cwd": "/",
                    "capabilities": {k: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
                                     for k in ("bounding", "effective", "permitted", "ambient")},
                    "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}], "noNewPrivileges": True},
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "runc",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                  "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/sys/firmware"],
                  "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]},
    }


# "big": the size tests/integration/test_hot_path.py uses (2000 mounts, 500 annotations of 100 bytes);
# "huge": four times that, plus a long environment: a stress row, informational.
BIG = {"mounts": 2000, "annotations": 500, "env": 2}
HUGE = {"mounts": 8000, "annotations": 2000, "env": 200}


def big_spec(size: dict) -> dict:
    spec = base_spec()
    spec["process"]["env"] += ["HOME=/root", "LANG=C.UTF-8"][: size["env"]]
    spec["process"]["env"] += [f"APP_SETTING_{i}=value-{i}" for i in range(max(0, size["env"] - 2))]
    spec["mounts"] += [{"destination": f"/data/{i}", "type": "bind", "source": f"/srv/volumes/{i}",
                        "options": ["rbind", "ro"]} for i in range(size["mounts"])]
    spec["annotations"] = {f"io.example.team/annotation-{i}": "x" * 100 for i in range(size["annotations"])}
    return spec


def nogpu_cases() -> dict:
    """The no-GPU containers: name -> (label, spec, informational)."""
    noenv = base_spec()
    del noenv["process"]["env"]
    void = base_spec()
    void["process"]["env"].append("NVIDIA_VISIBLE_DEVICES=void")

    def label(size):
        return f"big config.json ({size['mounts']} mounts, {size['annotations']} annotations), no GPU vars"
    return {
        "noenv": ("no env at all", noenv, False),
        "big": (label(BIG), big_spec(BIG), False),
        "void": ("NVIDIA_VISIBLE_DEVICES=void", void, False),
        "huge": (label(HUGE).replace("big", "stress: huge") + f", {HUGE['env']} env", big_spec(HUGE), True),
    }


def write_bundle(directory: str, spec: dict, container_id: str) -> str:
    """Write config.json (and an empty rootfs) under `directory`; returns the state file:
    the OCI state runc gives a prestart hook (its annotations are the spec's)."""
    os.makedirs(f"{directory}/rootfs", exist_ok=True)
    with open(f"{directory}/config.json", "w") as f:
        json.dump(spec, f, separators=(",", ":"))  # compact, as Go's json.Marshal writes it
    state = {"ociVersion": "1.0.2", "id": container_id, "status": "creating", "pid": os.getpid(),
             "bundle": directory}
    if spec.get("annotations"):
        state["annotations"] = spec["annotations"]
    path = f"{directory}/state.json"
    with open(path, "w") as f:
        json.dump(state, f, separators=(",", ":"))
    return path


# --- group: no-GPU path -----------------------------------------------------------------

def group_nogpu(ctx) -> list:
    hook = ctx.hook
    python = hook["path"]
    env = H.env_dict(hook["env"])
    bare = H.bare_interpreter_argv(hook)
    states, sizes, labels, info = {}, {}, {}, {}
    for name, (label, spec, informational) in nogpu_cases().items():
        states[name] = write_bundle(f"{ctx.workdir}/nogpu/{name}", spec, f"bench-nogpu-{name}")
        sizes[name] = (os.path.getsize(f"{ctx.workdir}/nogpu/{name}/config.json"), os.path.getsize(states[name]))
        labels[name] = label
        info[name] = informational
    # Correctness first: each case exits 0 and takes the fast path (gpuhook.hook never imported).
    paths = {}
    for name, state in states.items():
        with open(state, "rb") as f:
            done = subprocess.run([hook["args"][0], *hook["args"][1:3], "-X", "importtime", *hook["args"][3:]],
                                  executable=python, stdin=f, capture_output=True, env=env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"no-GPU hook ({name}) exited {done.returncode}: {done.stderr.decode()[-500:]}")
        modules = {m for m, *_ in H.parse_importtime(done.stderr.decode())}
        paths[name] = "full GPU path (gpuhook.hook imported)" if "gpuhook.hook" in modules else "fast path"

    def runner(argv, stdin):
        def call():
            done = H.spawn(python, argv, env, stdin=stdin)
            if done.status != 0:
                raise RuntimeError(f"{argv} exited with {done.exit_code}")
            return done
        return call

    candidates = {"bare": runner(bare, states["noenv"])}
    for name, state in states.items():
        candidates[name] = runner(hook["args"], state)
    ctx.note_noise("nogpu", "start")
    samples = H.interleave(candidates, ctx.s["nogpu_rounds"], warmup=ctx.s["warmup"], seed=ctx.seed)
    ctx.note_noise("nogpu", "end")

    rows = []
    base = H.summary(samples["bare"]["ms"])
    base_cpu = H.summary(samples["bare"]["cpu_ms"])
    rows.append(H.row("nogpu.wall.bare", "nogpu", "python3 -I -S -c pass (baseline)", "ms", base,
                      extra={"cpu_ms": base_cpu}, note="same interpreter, argv[0], flags, env and stdin as the hook"))
    for name in states:
        stats = H.summary(samples[name]["ms"])
        cpu = H.summary(samples[name]["cpu_ms"])
        target = dict(TARGETS["nogpu_wall"], informational=True) if info[name] else TARGETS["nogpu_wall"]
        rows.append(H.row(f"nogpu.wall.{name}", "nogpu", f"no-GPU hook: {labels[name]}", "ms", stats,
                          baseline="nogpu.wall.bare", baseline_stats=base, target=target,
                          paired=H.paired_ratios(samples[name]["ms"], samples["bare"]["ms"]),
                          note=f"{paths[name]}; config.json {sizes[name][0] / 1024:.0f} KiB, state "
                               f"{sizes[name][1] / 1024:.0f} KiB; +{stats['median'] - base['median']:.2f} ms"
                               + ("; stress row beyond the issue's case, informational" if info[name] else ""),
                          extra={"cpu_ms": cpu, "cpu_ratio": cpu["median"] / base_cpu["median"] if base_cpu["median"] else None,
                                 "config_bytes": sizes[name][0], "state_bytes": sizes[name][1],
                                 "path_taken": paths[name]}))

    # Peak RSS: each measurement in a fresh measuring process, interleaved too.
    tool = H.rss_tool()
    if tool is None:
        for name in ["bare", *states]:
            rows.append(H.unavailable_row(f"nogpu.rss.{name}", "nogpu", f"peak RSS: {name}",
                                          "no /usr/bin/time and no busybox to measure with", TARGETS["nogpu_rss"]))
        return rows
    floor_kib = H.rss_floor_kib(tool)

    def rss(argv, stdin):
        return lambda: H.peak_rss_kib(python, argv, env, stdin=stdin, tool=tool) / 1024
    rss_candidates = {"bare": rss(bare, states["noenv"])}
    for name, state in states.items():
        rss_candidates[name] = rss(hook["args"], state)
    rss_samples = H.interleave(rss_candidates, ctx.s["rss_rounds"], warmup=0, seed=ctx.seed + 1)
    rss_base = H.summary(rss_samples["bare"]["ms"])
    tool_note = f"measured by {os.path.basename(tool[0])} (its own floor: {floor_kib / 1024:.2f} MiB)"
    rows.append(H.row("nogpu.rss.bare", "nogpu", "peak RSS: python3 -I -S -c pass (baseline)", "MiB", rss_base,
                      note=tool_note, extra={"rss_floor_mib": floor_kib / 1024}))
    for name in states:
        stats = H.summary(rss_samples[name]["ms"])
        target = dict(TARGETS["nogpu_rss"], informational=True) if info[name] else TARGETS["nogpu_rss"]
        rows.append(H.row(f"nogpu.rss.{name}", "nogpu", f"peak RSS, no-GPU hook: {labels[name]}", "MiB", stats,
                          baseline="nogpu.rss.bare", baseline_stats=rss_base, target=target,
                          note=f"+{stats['median'] - rss_base['median']:.2f} MiB over the bare interpreter"))
    return rows


# --- runc helpers -------------------------------------------------------------------------

def need_root_tools(*tools):
    if os.geteuid() != 0:
        raise Unavailable("needs root (runc containers)")
    for tool in tools:
        if shutil.which(tool) is None:
            raise Unavailable(f"needs {tool}")


class Runc:
    """Times `runc run` of bundles made by the tests' harness (tests/helpers/testbed.py: busybox
    rootfs, runc's spec)."""

    def __init__(self, workdir: str):
        from helpers import testbed

        self.testbed = testbed
        try:
            testbed.find_busybox()
        except testbed.TestbedError as err:
            raise Unavailable(str(err)) from None
        self.bed = testbed.Testbed(workdir)
        self.counter = 0
        self.errfile = f"{workdir}/runc.stderr"

    def run(self, bundle: str, prefix: str) -> "H.Spawned":
        self.counter += 1
        cid = f"{prefix}-{os.getpid()}-{self.counter}"
        runc = self.bed.runc
        done = H.spawn(runc, [runc, "--root", self.bed.state_root, "run", "--bundle", bundle, cid],
                       self.testbed.RUN_ENV, stderr=self.errfile)
        if done.status != 0:
            self.bed.delete(cid)
            with open(self.errfile, errors="replace") as f:
                raise RuntimeError(f"runc run {os.path.basename(bundle)} exited {done.exit_code}: {f.read()[-800:]}")
        return done


def build_native(ctx) -> str | None:
    """native/prescan.c built into the scratch dir (native/build.py), or None without gcc."""
    if shutil.which("gcc") is None or not os.path.exists(os.path.join(REPO, "native", "build.py")):
        return None
    done = subprocess.run([sys.executable, os.path.join(REPO, "native", "build.py"), f"{ctx.workdir}/native"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"native/build.py failed: {done.stderr[-500:]}")
    return done.stdout.strip()


def true_hook(hook: dict) -> dict:
    return {"path": "/bin/true", "args": ["true"], "env": list(hook["env"]), "timeout": hook["timeout"]}


def runc_hook(hook: dict) -> dict:
    return {k: hook[k] for k in ("path", "args", "env", "timeout")}


def agent_socket() -> str:
    """A socket path for a benchmark's own agent: in a fresh root-owned 0700 directory (the
    front uses no other), short enough for a unix socket, and never the packaged
    /run/gpuhook/agent.sock, which a host's own agent or another run may be serving."""
    return f"{tempfile.mkdtemp(prefix='gpuhook-agent-')}/agent.sock"


def with_agent_socket(entry: dict, socket_path: str) -> dict:
    """`entry` (a hook entry run by the front) pointed at `socket_path` instead of the packaged
    default socket, through GPUHOOK_AGENT_SOCKET, a variable the front keeps."""
    return dict(entry, env=[*entry["env"], f"GPUHOOK_AGENT_SOCKET={socket_path}"])


def start_agent(socket_path: str, tree: str | None = None) -> subprocess.Popen:
    """`gpuhook agent --socket PATH` as gpuhook-agent.service starts it (Type=notify); with
    `tree`, that checkout's gpuhook (for --against) instead of the installed one."""
    return start_service([sys.executable, "-m", "gpuhook", "agent", "--socket", socket_path], "notify", socket_path,
                         {"PYTHONPATH": tree} if tree else None)


def stop_service(served: subprocess.Popen) -> None:
    served.terminate()
    try:
        served.wait(timeout=30)
    except subprocess.TimeoutExpired:
        served.kill()
        served.wait()


# --- group: runc, no GPU ----------------------------------------------------------------

def group_runc(ctx) -> list:
    need_root_tools("runc")
    rc = Runc(f"{ctx.workdir}/runc")
    args = ["/bin/busybox", "true"]
    bare = dict(runc_hook(ctx.hook), args=H.bare_interpreter_argv(ctx.hook))
    bundles = {
        "none": rc.bed.bundle("none", args),
        "true": rc.bed.bundle("true", args, hooks={"prestart": [true_hook(ctx.hook)]}),
        "python": rc.bed.bundle("python", args, hooks={"prestart": [bare]}),
        "pycommand": rc.bed.bundle("pycommand", args, hooks={"prestart": [runc_hook(ctx.hook)]}),
    }
    # gpuhook as hooks.d registers it: the native front (built by native/build.py in place of
    # the packaged one) in front of the Python command; without gcc, the Python command alone.
    native = build_native(ctx)
    registered = dict(runc_hook(ctx.hook), path=native, args=[native, *ctx.hook["args"]]) if native \
        else runc_hook(ctx.hook)
    bundles["gpuhook"] = rc.bed.bundle("gpuhook", args, hooks={"prestart": [registered]})
    candidates = {name: (lambda b=bundle: rc.run(b, "bench-runc")) for name, bundle in bundles.items()}
    ctx.note_noise("runc", "start")
    samples = H.interleave(candidates, ctx.s["runc_rounds"], warmup=ctx.s["warmup"], seed=ctx.seed + 2)
    ctx.note_noise("runc", "end")
    none = H.summary(samples["none"]["ms"])
    true = H.summary(samples["true"]["ms"])
    hooked = H.summary(samples["gpuhook"]["ms"])
    python = H.summary(samples["python"]["ms"])
    return [
        H.row("runc.none", "runc", "runc run busybox, no hook (info)", "ms", none),
        H.row("runc.true", "runc", "runc run busybox, /bin/true as hook (baseline)", "ms", true,
              baseline="runc.none", baseline_stats=none),
        H.row("runc.python", "runc", "runc run busybox, python3 -I -S -c pass as hook (info: a Python hook's floor)",
              "ms", python, baseline="runc.true", baseline_stats=true,
              paired=H.paired_ratios(samples["python"]["ms"], samples["true"]["ms"]),
              note="the hook's interpreter, argv[0], flags and env, running nothing: no Python hook costs less"),
        H.row("runc.pycommand", "runc", "runc run busybox, gpuhook's Python command alone as hook (no native "
              "front: a source install), no GPU request (info)", "ms", H.summary(samples["pycommand"]["ms"]),
              baseline="runc.true", baseline_stats=true,
              paired=H.paired_ratios(samples["pycommand"]["ms"], samples["true"]["ms"]),
              note=f"{H.summary(samples['pycommand']['ms'])['median'] - hooked['median']:+.2f} ms against the "
                   f"gpuhook row"),
        H.row("runc.gpuhook", "runc", "runc run busybox, gpuhook as hook, no GPU request", "ms", hooked,
              baseline="runc.true", baseline_stats=true, target=TARGETS["runc"],
              paired=H.paired_ratios(samples["gpuhook"]["ms"], samples["true"]["ms"]),
              note=("hook as hooks.d registers it: the native front (native/build.py's binary) in front of the "
                    "Python command" if native else "no gcc: the Python command alone, not as hooks.d registers it")
                   + f"; +{hooked['median'] - true['median']:.2f} ms over /bin/true, "
                   f"{hooked['median'] / none['median']:.2f}x vs no hook"),
    ]


# --- group: GPU path on a simulated host --------------------------------------------------

class SimGpu:
    """An 8-GPU simulated host, a config for it, and busybox bundles that request GPU 0."""

    VARIANTS = {
        # name: (label, NVIDIA_VISIBLE_DEVICES, glibc-style image, check run in the container)
        "static": ("GPU path, static busybox image (no ld cache), GPU 0", "0", False, "test -c /dev/nvidia0"),
        "glibc": ("GPU path, glibc-style image (host ldconfig runs), GPU 0", "0", True,
                  "test -c /dev/nvidia0 && test -s /etc/ld.so.cache"),
        "all": ("GPU path, static image, NVIDIA_VISIBLE_DEVICES=all (8 GPUs)", "all", False,
                f"test -c /dev/nvidia{SIM_GPUS - 1}"),
    }

    def __init__(self, ctx, name: str = "gpu", nvml_init_latency_ms: int = 0, health_text: str | None = None):
        need_root_tools("runc", "gcc", "ldconfig")
        from gpuhook import config as cfg
        from gpuhook.simulate import host as simhost

        self.ctx = ctx
        self.dir = f"{ctx.workdir}/{name}"
        self.rc = Runc(f"{self.dir}/bed")
        started = time.monotonic()
        self.sim = simhost.build(f"{self.dir}/sim", gpus=SIM_GPUS, **(
            {"nvml_init_latency_ms": nvml_init_latency_ms} if nvml_init_latency_ms else {}))
        self.build_seconds = time.monotonic() - started
        with open(self.sim["config"]) as f:
            text = f.read()
        # The state dir on a tmpfs, as /run/gpuhook is on a host (/run is a tmpfs under systemd);
        # here /run and /tmp are on the VM's disk, where a file's creation took 0.28 ms in /tmp.
        self.state_dir = f"{ctx.state_root}/{name}"
        text = "\n".join(f"state-dir = {json.dumps(self.state_dir)}" if line.startswith("state-dir =") else line
                         for line in text.splitlines()) + "\n"
        # Health checks off, but only through keys this version of gpuhook has.
        keys = {k.dotted: k for k in cfg.KEYS}
        health = keys.get("health.mode")
        if health_text is not None:
            text += health_text
            self.health = health_text.strip().replace("\n", "; ")
        elif health is not None and (health.kind != "choice" or "off" in health.choices):
            text += '\n[health]\nmode = "off"\n'
            self.health = 'off ([health] mode = "off")'
        else:
            self.health = "no health.mode key in gpuhook.config.KEYS: this version runs no health checks"
        self.config = f"{self.dir}/config.toml"
        with open(self.config, "w") as f:
            f.write(text)
        self.hook = H.hooksd_hook(ctx.hook["path"], launcher=ctx.launcher, extra_args=["--config", self.config])
        self.templates = {}
        for glibc in (False, True):
            template = self.rc.bed.rootfs(f"{self.dir}/templates/{'glibc' if glibc else 'static'}")
            if glibc:
                os.makedirs(f"{template}/etc", exist_ok=True)
                with open(f"{template}/etc/ld.so.conf", "w") as f:
                    f.write("include /etc/ld.so.conf.d/*.conf\n")
            self.templates[glibc] = template
        self.kinds = {}  # name -> (args, env, hooks, glibc)
        self.ready = {}  # name -> bundles not yet run
        self.made = {}

    def add(self, name: str, hook_entry: dict | None, visible: str | None, glibc: bool, check: str,
            hooks: dict | None = None) -> None:
        """Bundles named `name`: `hook_entry` as the prestart hook, or `hooks` as given;
        `visible` None: a container with no GPU variables at all."""
        env = [] if visible is None else [f"NVIDIA_VISIBLE_DEVICES={visible}",
                                          "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
        if hooks is None:
            hooks = {"prestart": [hook_entry]} if hook_entry else None
        self.kinds[name] = (["/bin/busybox", "sh", "-c", check], env, hooks, glibc)
        self.ready[name] = []
        self.made[name] = 0

    def prepare(self, name: str, count: int) -> None:
        """`count` bundles for `name`, each with a fresh rootfs, as a runtime's fresh overlay
        would be: the hook's device nodes, mount targets, symlinks and ld cache never carry
        over. Made before timing (hard links to a template) and synced, so no file system
        work of ours runs between or during timed starts."""
        args, env, hooks, glibc = self.kinds[name]
        for _ in range(count):
            self.made[name] += 1
            bundle_name = f"{name}-{self.made[name]}"
            rootfs = f"{self.rc.bed.workdir}/bundles/{bundle_name}/rootfs"
            shutil.copytree(self.templates[glibc], rootfs, symlinks=True, copy_function=os.link)
            self.ready[name].append(self.rc.bed.bundle(bundle_name, args, env=env, hooks=hooks, rootfs=rootfs))
        os.sync()

    def run(self, name: str):
        if not self.ready[name]:
            self.prepare(name, 1)
        return self.rc.run(self.ready[name].pop(0), f"bench-{name}")  # the log names the variant

    def log_records(self) -> list:
        try:
            with open(self.sim["directory"] + "/gpuhook.log") as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def last_log(self) -> dict:
        try:
            with open(self.sim["directory"] + "/gpuhook.log") as f:
                lines = f.read().splitlines()
            return json.loads(lines[-1]) if lines else {}
        except (OSError, ValueError):
            return {}


def group_gpu(ctx) -> list:
    """The GPU path with gpuhook as hooks.d registers it and the packages run it: the native
    front (native/build.py's binary) in front of the Python command, with the agent (gpuhook
    agent, which the packages start, here on a socket of its own) serving it. The same starts
    with the Python command alone (a source install, or a host where the agent is not running)
    are informational rows beside them. Without gcc there is no front: the target rows then
    time the Python command, and say so."""
    sim = SimGpu(ctx)
    ctx.sim_gpu = sim
    sim.add("none", None, "0", False, "true")
    front = build_native(ctx)
    agent = socket_path = None
    registered = runc_hook(sim.hook)
    if front:
        socket_path = agent_socket()
        registered = with_agent_socket(runc_hook(H.hooksd_hook(ctx.hook["path"], launcher=ctx.launcher, front=front,
                                                               extra_args=["--config", sim.config])), socket_path)
    names = ["none"]
    for name, (_, visible, glibc, check) in SimGpu.VARIANTS.items():
        sim.add(name, registered, visible, glibc, check)
        names.append(name)
        if front and name in PYTHON_ROWS:
            sim.add(f"{name}-python", runc_hook(sim.hook), visible, glibc, check)
            names.append(f"{name}-python")
    against = getattr(ctx.args, "against", None)
    other_agent = other_socket = None
    if against:
        # The other tree's own state dir: two trees whose inventory cache formats differ
        # would otherwise rebuild each other's cache on every start.
        with open(sim.config) as f:
            lines = f.read().splitlines()
        other_config = f"{sim.dir}/config-against.toml"
        with open(other_config, "w") as f:
            f.write("\n".join(f'state-dir = "{sim.state_dir}-against"' if line.startswith("state-dir =")
                              else line for line in lines) + "\n")
        launcher = os.path.abspath(against)
        other = H.hooksd_hook(ctx.hook["path"], launcher=launcher, extra_args=["--config", other_config])
        _, visible, glibc, check = SimGpu.VARIANTS["static"]
        sim.add("against", runc_hook(other), visible, glibc, check)
        names.append("against")
        if front:  # and as the packages run it: this front, the other tree's agent
            other_socket = agent_socket()
            entry = with_agent_socket(runc_hook(H.hooksd_hook(ctx.hook["path"], launcher=launcher, front=front,
                                                              extra_args=["--config", other_config])), other_socket)
            for name in AGAINST_ROWS:
                _, visible, glibc, check = SimGpu.VARIANTS[name]
                sim.add(f"against-{name}", entry, visible, glibc, check)
                names.append(f"against-{name}")
    try:
        if front:
            agent = start_agent(socket_path)
        if other_socket:
            other_agent = start_agent(other_socket, os.path.dirname(os.path.dirname(launcher)))
        return _group_gpu(ctx, sim, names, front)
    finally:
        for served, path in ((agent, socket_path), (other_agent, other_socket)):
            if served is not None:
                stop_service(served)
            if path:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


PYTHON_ROWS = ("static", "glibc")  # the variants also timed with the Python command alone
AGAINST_ROWS = ("static", "glibc")  # the variants --against also times through the other tree's agent


def _group_gpu(ctx, sim, names: list, front) -> list:
    against = getattr(ctx.args, "against", None)
    reference = "static-python" if front else "static"  # what --against compares with: the Python command
    # Warm the config and inventory caches (untimed), then check they are warm.
    for name in names:
        sim.run(name)
    inventory_cache = f"{sim.state_dir}/inventory.json"
    if not os.path.exists(inventory_cache):
        raise RuntimeError(f"the inventory cache {inventory_cache} was not written by the warm-up run")
    decision = sim.last_log().get("decision")
    for name in names:
        sim.prepare(name, ctx.s["warmup"] + ctx.s["gpu_rounds"])
    candidates = {name: (lambda n=name: sim.run(n)) for name in names}
    ctx.note_noise("gpu", "start")
    samples = H.interleave(candidates, ctx.s["gpu_rounds"], warmup=ctx.s["warmup"], seed=ctx.seed + 3)
    ctx.note_noise("gpu", "end")
    none = H.summary(samples["none"]["ms"])
    setup = (f"{SIM_GPUS}-GPU simulated host; NVIDIA_DRIVER_CAPABILITIES=compute,utility; config and "
             f"inventory caches warm; health: {sim.health}")
    rows = [H.row("gpu.none", "gpu", f"runc run busybox, no hook ({SIM_GPUS}-GPU sim host, baseline)", "ms", none,
                  note=setup, extra={"sim_build_seconds": round(sim.build_seconds, 1), "health": sim.health,
                                     "last_decision": decision})]
    starts = [r for r in sim.log_records() if r.get("stage") == "prestart"]
    served = {}  # variant -> [starts the agent served, starts logged]
    for r in starts:
        kind = str(r.get("container", "")).rsplit("-", 2)[0].removeprefix("bench-")
        served.setdefault(kind, [0, 0])
        served[kind][0] += r.get("agent") is True
        served[kind][1] += 1
    how = ("gpuhook as hooks.d registers it (the native front, native/build.py's binary, in front of the Python "
           "command) with the agent running (gpuhook agent on a socket of its own, the hooks.d entry's "
           "GPUHOOK_AGENT_SOCKET pointing at it)" if front else
           "no gcc, so no native front: the Python command alone, not as hooks.d registers it")
    for name, (label, visible, glibc, _) in SimGpu.VARIANTS.items():
        stats = H.summary(samples[name]["ms"])
        target = {"static": TARGETS["gpu"], "glibc": TARGETS["gpu_glibc"]}.get(name)
        note = f"+{stats['median'] - none['median']:.1f} ms over no hook; {how}"
        if front:
            note += "; starts the agent served: {} of {}".format(*served.get(name, [0, 0]))
        if name == "all":
            note += "; info"
        rows.append(H.row(f"gpu.{name}", "gpu", label, "ms", stats, baseline="gpu.none", baseline_stats=none,
                          target=target, paired=H.paired_ratios(samples[name]["ms"], samples["none"]["ms"]),
                          note=note, extra={"visible_devices": visible, "glibc_image": glibc}))
        if f"{name}-python" in samples:
            py = H.summary(samples[f"{name}-python"]["ms"])
            rows.append(H.row(f"gpu.{name}-python", "gpu", f"{label}, the Python command alone (no front, no agent: "
                              "a source install) (info)", "ms", py, baseline="gpu.none", baseline_stats=none,
                              paired=H.paired_ratios(samples[f"{name}-python"]["ms"], samples["none"]["ms"]),
                              note=f"{py['median'] - stats['median']:+.1f} ms against the row above; starts the "
                                   "agent served: {} of {}".format(*served.get(f"{name}-python", [0, 0]))))
    if against:
        stats = H.summary(samples["against"]["ms"])
        rows.append(H.row("gpu.against", "gpu", f"GPU path, static image, GPU 0, with {against} (A/B)", "ms", stats,
                          baseline="gpu.none", baseline_stats=none,
                          paired=H.paired_ratios(samples["against"]["ms"], samples[reference]["ms"]),
                          note=f"{stats['median'] - samples_median(samples, reference):+.1f} ms against this "
                               f"checkout's Python command ({reference}); paired ratio is against that row; CPU "
                               f"time (user+sys of runc and its hooks) "
                               f"{H.summary(samples['against']['cpu_ms'])['median']:.1f} ms "
                               f"vs {H.summary(samples[reference]['cpu_ms'])['median']:.1f} ms; minor page faults "
                               f"{H.summary(samples['against']['minflt'])['median']:.0f} vs "
                               f"{H.summary(samples[reference]['minflt'])['median']:.0f}"))
        for name in AGAINST_ROWS:
            if f"against-{name}" not in samples:
                continue
            stats = H.summary(samples[f"against-{name}"]["ms"])
            label = SimGpu.VARIANTS[name][0]
            rows.append(H.row(f"gpu.against-{name}", "gpu", f"{label}, front + agent of {against} (A/B)", "ms", stats,
                              baseline="gpu.none", baseline_stats=none,
                              paired=H.paired_ratios(samples[f"against-{name}"]["ms"], samples[name]["ms"]),
                              note=f"{stats['median'] - samples_median(samples, name):+.1f} ms against this "
                                   f"checkout's front + agent (gpu.{name}); paired ratio is against that row; "
                                   "starts the other agent served: {} of {}".format(
                                       *served.get(f"against-{name}", [0, 0]))))
    return rows


def samples_median(samples: dict, name: str) -> float:
    return H.summary(samples[name]["ms"])["median"]


# --- group: the health daemon -------------------------------------------------------------

DAEMON_INIT_MS = 1500  # nvmlInit without persistence mode, as hosts without it see


def group_daemon(ctx) -> list:
    """A GPU start with health on, on an 8-GPU host whose NVML takes 1.5 s to load: without
    and with the health daemon (`gpuhook plugin --standalone`) running, next to health off;
    each a ratio to a no-hook `runc run` on the same host (the device plugin's target: ≤ 2× with the
    daemon)."""
    from gpuhook import config as cfg

    if "health.daemon-socket" not in {k.dotted for k in cfg.KEYS}:
        raise Unavailable("this gpuhook has no health daemon (health.daemon-socket)")
    variants = {  # name: (label, extra config)
        "off": ("health off", '\n[health]\nmode = "off"\n'),
        "on": ("health on, no daemon", '\n[health]\nmode = "always"\ndaemon-socket = "/nonexistent/health.sock"\n'),
        "daemon": ("health on, daemon running", '\n[health]\nmode = "fallback"\n'),
    }
    sims = {name: SimGpu(ctx, f"daemon-{name}", DAEMON_INIT_MS, text) for name, (_, text) in variants.items()}
    daemon_sim = sims["daemon"]
    served = subprocess.Popen([sys.executable, "-m", "gpuhook", "plugin", "--standalone", "--config",
                               daemon_sim.config], cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        socket_path = f"{daemon_sim.state_dir}/health.sock"
        end = time.monotonic() + 30
        while not os.path.exists(socket_path) and time.monotonic() < end:
            time.sleep(0.05)
        if not os.path.exists(socket_path):
            raise RuntimeError("the health daemon did not create its socket")
        rounds = max(3, ctx.s["gpu_rounds"] // 2)  # 30 in a full run: the target row needs them
        for name, sim in sims.items():
            sim.add("none", None, "0", False, "true")
            sim.add(name, runc_hook(sim.hook), "0", False, "test -c /dev/nvidia0")
            sim.run("none")
            sim.run(name)  # warm the config and inventory caches
            sim.prepare("none", rounds + 1)
            sim.prepare(name, rounds + 1)
        candidates = {}
        for name, sim in sims.items():
            candidates[f"{name}.none"] = (lambda s=sim: s.run("none"))
            candidates[name] = (lambda s=sim, n=name: s.run(n))
        samples = H.interleave(candidates, rounds, warmup=1, seed=ctx.seed + 7)
        logs = {name: sim.last_log() for name, sim in sims.items()}
    finally:
        served.terminate()
        served.wait(timeout=30)
    rows = []
    for name, (label, _) in variants.items():
        none = H.summary(samples[f"{name}.none"]["ms"])
        stats = H.summary(samples[name]["ms"])
        base = f"daemon.{name}.none"
        rows.append(H.row(base, "daemon", f"runc run busybox, no hook ({SIM_GPUS}-GPU host, NVML init "
                                          f"{DAEMON_INIT_MS} ms; {label} host)", "ms", none))
        # Informational: the Python command alone (a source install, no agent). The issue's
        # target for a start with health on is on the installed group, which runs gpuhook as
        # the packages do (front, agent and health daemon).
        rows.append(H.row(f"daemon.{name}", "daemon", f"GPU start, {label}, NVML init {DAEMON_INIT_MS} ms, "
                                                      f"the Python command alone (info)", "ms",
                          stats, baseline=base, baseline_stats=none,
                          paired=H.paired_ratios(samples[name]["ms"], samples[f"{name}.none"]["ms"]),
                          note=f"nvml in the hook: {logs[name].get('nvml', '?')}; "
                               f"health: {(logs[name].get('health') or {}).get('daemon', '-')}"))
    return rows


# --- group: as the packages install gpuhook: start and stop --------------------------------

SYSTEMD_DIR = os.path.join(REPO, "packaging", "systemd")
HOOKSD_FILES = (os.path.join(REPO, "hooks.d", "gpuhook.json"), os.path.join(REPO, "hooks.d", "gpuhook-poststop.json"))


def packaged_services(directory: str = SYSTEMD_DIR) -> dict:
    """The long-running services the packages enable and start: every unit there with an
    [Install] section whose ExecStart is the packaged /usr/bin/gpuhook. name -> {"args":
    gpuhook's arguments, "type": the unit's Type}. A tree whose packages start none: {}."""
    import configparser

    found = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if not name.endswith(".service"):
            continue
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str
        with open(os.path.join(directory, name)) as f:
            unit.read_file(f)
        argv = unit.get("Service", "ExecStart", fallback="").split()
        if unit.has_section("Install") and argv[:1] == ["/usr/bin/gpuhook"] and \
                unit.get("Service", "Type", fallback="simple") != "oneshot":
            found[name] = {"args": argv[1:], "type": unit.get("Service", "Type", fallback="simple")}
    return found


def start_service(argv: list, unit_type: str, ready_path: str, extra_env: dict | None = None) -> subprocess.Popen:
    """Start `argv` as systemd starts a service of `unit_type`: a clean environment (plus
    `extra_env`), for Type=notify a NOTIFY_SOCKET and the wait for READY=1; otherwise the
    wait for `ready_path`."""
    import socket

    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", **(extra_env or {})}
    notify = None
    if unit_type == "notify":
        short = tempfile.mkdtemp(prefix="gpuhook-notify-")  # a unix socket path has 107 bytes at most
        notify_path = f"{short}/notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        env["NOTIFY_SOCKET"] = notify_path
    errors = tempfile.TemporaryFile()
    served = subprocess.Popen(argv, cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=errors)

    def failed(why: str) -> RuntimeError:
        errors.seek(0)
        return RuntimeError(f"{' '.join(argv)}: {why}: {errors.read()[-600:].decode(errors='replace')}")
    try:
        end = time.monotonic() + 60
        while True:
            if served.poll() is not None:
                raise failed(f"exited {served.returncode} before it was ready")
            if time.monotonic() > end:
                raise failed("not ready after 60 s")
            if notify is None:
                if os.path.exists(ready_path):
                    break
                time.sleep(0.05)
                continue
            notify.settimeout(0.2)
            try:
                message = notify.recv(4096)
            except TimeoutError:
                continue
            if message != b"READY=1":
                raise failed(f"sent {message!r}, not READY=1")
            break
    except BaseException:
        served.kill()
        served.wait()
        raise
    finally:
        errors.close()
        if notify is not None:
            notify.close()
            shutil.rmtree(short, ignore_errors=True)
    return served


class Lifecycle:
    """create -> start -> wait -> delete of a container, the hooks' stages where the runtime
    runs them: prestart in `runc create`, poststop in `runc delete` (runc 1.1). The runner is
    a child subreaper meanwhile, so the container's init (orphaned when `runc create` exits)
    is its child: the wait is a waitpid, not polling."""

    PR_SET_CHILD_SUBREAPER = 36

    def __init__(self, rc: Runc):
        import ctypes

        self.rc = rc
        self.libc = ctypes.CDLL(None, use_errno=True)

    def __enter__(self):
        if self.libc.prctl(self.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise RuntimeError("prctl(PR_SET_CHILD_SUBREAPER) failed")
        return self

    def __exit__(self, *exc):
        self.libc.prctl(self.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def run(self, bundle: str, prefix: str) -> dict:
        """{"create", "start", "delete": Spawned, "wait_ms": float}; raises (after a forced
        delete) when a step or the container failed."""
        rc = self.rc
        rc.counter += 1
        cid = f"{prefix}-{os.getpid()}-{rc.counter}"
        runc = rc.bed.runc
        base = [runc, "--root", rc.bed.state_root]
        pid_file = f"{rc.bed.workdir}/{cid}.pid"
        out = {}
        try:
            for step, argv in (("create", [*base, "create", "--bundle", bundle, "--pid-file", pid_file, cid]),
                               ("start", [*base, "start", cid])):
                out[step] = done = H.spawn(runc, argv, rc.testbed.RUN_ENV, stderr=rc.errfile)
                if done.status != 0:
                    raise RuntimeError(f"runc {step} {os.path.basename(bundle)} exited {done.exit_code}: "
                                       f"{read_tail(rc.errfile)}")
                if step == "create":
                    with open(pid_file) as f:
                        pid = int(f.read())
            waited = time.perf_counter_ns()
            _, status = os.waitpid(pid, 0)
            out["wait_ms"] = (time.perf_counter_ns() - waited) / 1e6
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError(f"the container of {os.path.basename(bundle)} exited "
                                   f"{os.waitstatus_to_exitcode(status)}")
            out["delete"] = done = H.spawn(runc, [*base, "delete", cid], rc.testbed.RUN_ENV, stderr=rc.errfile)
            if done.status != 0:
                raise RuntimeError(f"runc delete exited {done.exit_code}: {read_tail(rc.errfile)}")
        except BaseException:
            rc.bed.delete(cid)
            raise
        finally:
            if os.path.exists(pid_file):
                os.unlink(pid_file)
        return out


def read_tail(path: str, size: int = 800) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-size:]


INSTALLED_EVERY = {"no-daemon": 4}  # the installed group's slow informational start (1.5 s) runs every 4th round


def group_installed(ctx) -> list:
    """gpuhook as the packages install it, on an 8-GPU host whose NVML takes 1.5 s to load:
    both hooks.d files (prestart and poststop) as shipped, so run by the native front (built
    by native/build.py in place of the packaged /usr/libexec/gpuhook/gpuhook-front), the
    packaged configuration (every key at its default: health.mode = fallback), and the
    services the packages start (the health daemon, packaging/systemd/gpuhook-health.service,
    and the agent, gpuhook-agent.service, each started from its ExecStart; the agent on a
    socket of its own, which the hooks.d entries are pointed at with GPUHOOK_AGENT_SOCKET). Each
    container is created, started, waited for and deleted; the start (create + start, where
    prestart runs) and the stop (delete, where poststop runs) are timed apart, against the
    same container with no hook. Informational: the same without the daemon."""
    sim = SimGpu(ctx, "installed", DAEMON_INIT_MS, "\n# the packaged defaults: no [health] keys\n")
    sim.health = "the packaged defaults (health.mode = fallback)"
    with open(sim.config) as f:
        text = f.read()
    no_daemon_config = f"{sim.dir}/config-no-daemon.toml"
    with open(no_daemon_config, "w") as f:
        f.write(text + '\n[health]\ndaemon-socket = "/nonexistent/health.sock"\n')

    front = build_native(ctx)
    if front is None:
        raise RuntimeError("the installed group needs gcc: the packages register the native front")
    socket_path = agent_socket()

    def packaged_hooks(config: str) -> dict:
        hooks = {}
        for path in HOOKSD_FILES:
            with open(path) as f:
                stages = json.load(f)["stages"]
            entry = with_agent_socket(runc_hook(H.hooksd_hook(ctx.hook["path"], launcher=ctx.launcher, hooksd=path,
                                                              extra_args=["--config", config], front=front)),
                                      socket_path)
            for stage in stages:
                hooks.setdefault(stage, []).append(entry)
        return hooks
    check = "test -c /dev/nvidia0"
    sim.add("none", None, "0", False, "true")
    sim.add("installed", None, "0", False, check, hooks=packaged_hooks(sim.config))
    sim.add("no-daemon", None, "0", False, check, hooks=packaged_hooks(no_daemon_config))
    sim.add("nogpu", None, None, False, "true", hooks=packaged_hooks(sim.config))
    # The floor of registering any hook at all: /bin/true in both stages, registered as the
    # hooks.d entries are (env, timeout), on a GPU container.
    floor = runc_hook(true_hook(ctx.hook))
    sim.add("true", None, "0", False, "true", hooks={"prestart": [floor], "poststop": [floor]})
    services = packaged_services()
    running = []
    life = Lifecycle(sim.rc)
    try:
        for name, unit in services.items():
            if unit["args"][:1] == ["agent"]:  # the hook's own --config reaches it in each request
                argv = [sys.executable, "-m", "gpuhook", *unit["args"], "--socket", socket_path]
            else:
                argv = [sys.executable, "-m", "gpuhook", *unit["args"], "--config", sim.config]
            running.append(start_service(argv, unit["type"], f"{sim.state_dir}/health.sock"))
        # The stop's rows are a few ms with a floor (/bin/true) near the target: they need the
        # rounds. The start without the daemon (1.5 s each, informational) runs every 4th.
        rounds = max(3, ctx.s["gpu_rounds"])
        names = ["none", "installed", "no-daemon", "nogpu", "true"]
        for name in names:
            sim.prepare(name, rounds // INSTALLED_EVERY.get(name, 1) + 2)
        per_step = {name: {"start": [], "stop": [], "life": []} for name in names}

        def one(name):
            def call():
                if not sim.ready[name]:
                    sim.prepare(name, 1)
                done = life.run(sim.ready[name].pop(0), f"bench-{name}")
                start = done["create"].ms + done["start"].ms
                per_step[name]["start"].append(start)
                per_step[name]["stop"].append(done["delete"].ms)
                per_step[name]["life"].append(start + done["wait_ms"] + done["delete"].ms)
                return start + done["delete"].ms
            return call
        with life:
            for name in names:  # warm the config and inventory caches, untimed
                one(name)()
            for steps in per_step.values():
                for values in steps.values():
                    values.clear()
            ctx.note_noise("installed", "start")
            H.interleave({name: one(name) for name in names}, rounds, warmup=0, seed=ctx.seed + 9,
                         every=INSTALLED_EVERY)
            ctx.note_noise("installed", "end")
        logs = {}
        with open(sim.sim["directory"] + "/gpuhook.log") as f:
            for line in f:
                record = json.loads(line)
                logs.setdefault(record.get("stage"), []).append(record)
    finally:
        for served in running:
            stop_service(served)
        shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
    mine = [r for r in logs.get("prestart", []) if str(r.get("container", "")).startswith("bench-installed-")]
    by_agent = sum(1 for r in mine if r.get("agent") is True)
    last_start = (mine or [{}])[-1]
    stops = [r.get("decision") for r in logs.get("poststop", [])
             if str(r.get("container", "")).startswith("bench-installed-")]
    setup = (f"{SIM_GPUS}-GPU host, NVML init {DAEMON_INIT_MS} ms; hooks.d/gpuhook.json and "
             f"gpuhook-poststop.json run by the native front; packaged config; services started: "
             f"{', '.join(services) or 'none'}; GPU starts the agent served: {by_agent} of {len(mine)}")
    rows = []
    labels = {"installed": "GPU container {what} ({op}), as installed",
              "no-daemon": "GPU container {what} ({op}), as installed but no health daemon (info)",
              "nogpu": "container {what} ({op}) without a GPU request, as installed (info)",
              "true": "container {what} ({op}) with /bin/true as prestart and poststop hook (info: any hook's floor)"}
    for what, op, target in (("start", "runc create + start", TARGETS["installed_start"]),
                             ("stop", "runc delete", TARGETS["installed_stop"])):
        base = H.summary(per_step["none"][what])
        rows.append(H.row(f"installed.{what}.none", "installed", f"container {what} ({op}), no hook (baseline)",
                          "ms", base, note=setup if what == "start" else ""))
        for name, label in labels.items():
            stats = H.summary(per_step[name][what])
            rows.append(H.row(f"installed.{what}.{name}", "installed", label.format(what=what, op=op),
                              "ms", stats, baseline=f"installed.{what}.none", baseline_stats=base,
                              target=target if name == "installed" else None,
                              paired=H.paired_ratios(per_step[name][what],
                                                     per_step["none"][what][::INSTALLED_EVERY.get(name, 1)]),
                              note=f"+{stats['median'] - base['median']:.1f} ms over no hook"))
    life_none = H.summary(per_step["none"]["life"])
    rows.append(H.row("installed.life.none", "installed", "container life (create, start, wait, delete), no hook",
                      "ms", life_none))
    stats = H.summary(per_step["installed"]["life"])
    rows.append(H.row("installed.life.installed", "installed", "GPU container life, as installed (info)", "ms", stats,
                      baseline="installed.life.none", baseline_stats=life_none,
                      note=f"last start's health: {json.dumps(last_start.get('health'))[:300]}; nvml: "
                           f"{last_start.get('nvml', '?')}; poststop decisions: "
                           f"{', '.join(sorted(set(filter(None, stops)))) or '-'}"))
    return rows


# --- group: health checks ---------------------------------------------------------------

def load_health_bench(path: str = HEALTH_BENCH):
    """benchmarks/health_bench.py as a module, or None while it does not exist."""
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("health_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def health_label(gpus: int) -> str:
    return f"health check, {gpus} healthy simulated GPU(s), {HEALTH_LATENCY_MS} ms per GPU"


def group_health(ctx, path: str = HEALTH_BENCH) -> list:
    rows = []
    try:
        bench = load_health_bench(path)
        why = None if bench is None else ("" if hasattr(bench, "measure") else "health_bench.py has no measure()")
        if bench is None:
            why = "not available yet (benchmarks/health_bench.py does not exist)"
    except Exception as err:  # someone else's file, maybe half-written: report, never guess
        bench, why = None, f"not available: importing health_bench.py failed: {type(err).__name__}: {err}"
    for gpus in HEALTH_GPUS:
        target = TARGETS["health"] if gpus == 16 else None
        rid, label = f"health.{gpus}", health_label(gpus)
        if why:
            rows.append(H.unavailable_row(rid, "health", label, why, target))
            continue
        try:
            result = bench.measure(gpus=gpus, latency_ms=HEALTH_LATENCY_MS, repeat=ctx.s["health_repeat"])
            stats = {"n": ctx.s["health_repeat"], "median": float(result["median_s"]),
                     "min": float(result["min_s"]), "max": float(result["max_s"])}
            serial = result.get("serial_estimate_s")
        except Exception as err:
            rows.append(H.unavailable_row(rid, "health", label,
                                          f"health_bench.measure failed: {type(err).__name__}: {err}", target))
            continue
        out = H.row(rid, "health", label, "s", stats, target=target,
                    note=("ratio = median / serial estimate" + (f" ({float(serial):.1f} s)" if serial else "")),
                    extra={"serial_estimate_s": serial, "raw": result})
        if serial:
            out["ratio"] = stats["median"] / float(serial)
            out["baseline"] = "serial estimate"
        rows.append(out)
    return rows


# --- importtime and breakdown -------------------------------------------------------------

def importtime_nogpu(ctx) -> dict:
    hook = ctx.hook
    env = H.env_dict(hook["env"])
    case = nogpu_cases()["void"][1]
    state = write_bundle(f"{ctx.workdir}/importtime/void", case, "bench-importtime")
    argv = [hook["args"][0], *hook["args"][1:3], "-X", "importtime", *hook["args"][3:]]
    bare = [hook["args"][0], *hook["args"][1:3], "-X", "importtime", "-c", "pass"]
    out, modules = {}, {}
    for name, command in (("bare", bare), ("nogpu", argv)):
        runs = []
        for _ in range(ctx.s["importtime_runs"]):
            with open(state, "rb") as f:
                done = subprocess.run(command, executable=hook["path"], stdin=f, capture_output=True, env=env,
                                      timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr.decode()[-300:]}")
            text = done.stderr.decode()
            runs.append((H.importtime_top(text, top=12), text))
        runs.sort(key=lambda r: r[0]["total_self_us"])
        out[name], text = runs[len(runs) // 2]
        modules[name] = {m: (s, c) for m, s, c, _ in H.parse_importtime(text)}
    out["nogpu"]["beyond_bare"] = [{"module": m, "self_us": s, "cumulative_us": c}
                                   for m, (s, c) in modules["nogpu"].items() if m not in modules["bare"]]
    return out


def importtime_gpu(ctx) -> dict:
    """-X importtime of the warm GPU path inside a real runc start (static image, GPU 0);
    runc keeps a successful hook's stderr to itself, so /bin/sh sends it to a file."""
    sim = ctx.sim_gpu or SimGpu(ctx)
    ctx.sim_gpu = sim
    errfile = f"{ctx.workdir}/importtime-gpu.txt"
    hook = sim.hook
    entry = {"path": "/bin/sh", "args": ["sh", "-c", 'exec "$@" 2>"$0"', errfile, hook["path"],
                                          *hook["args"][1:3], "-X", "importtime", *hook["args"][3:]],
             "env": hook["env"], "timeout": 30}
    sim.add("importtime", entry, "0", False, "test -c /dev/nvidia0")
    sim.run("importtime")  # warms anything this bundle has that the others had not
    sim.prepare("importtime", ctx.s["importtime_runs"])
    runs = []
    for _ in range(ctx.s["importtime_runs"]):
        sim.run("importtime")
        with open(errfile) as f:
            runs.append(H.importtime_top(f.read(), top=25))
    runs.sort(key=lambda r: r["total_self_us"])
    return runs[len(runs) // 2]


def breakdown_gpu(ctx) -> dict:
    """Phase timers inside the warm GPU-path hook (benchmarks/hook_profile.py runs as the
    hook, wraps gpuhook's functions, then calls gpuhook.entry.main), for the static and the
    glibc-style image; and, side by side for the static image, the same hook ending with
    os._exit instead of the interpreter's finalization: the difference is what teardown
    costs a container start."""
    sim = ctx.sim_gpu or SimGpu(ctx)
    ctx.sim_gpu = sim
    hook = sim.hook
    variants = {
        "static": (False, "test -c /dev/nvidia0", []),
        "static-fast-exit": (False, "test -c /dev/nvidia0", ["--fast-exit"]),
        "glibc": (True, "test -c /dev/nvidia0 && test -s /etc/ld.so.cache", []),
    }
    records = {}
    for name, (glibc, check, flags) in variants.items():
        records[name] = f"{ctx.workdir}/breakdown-{name}.tsv"
        entry = {"path": hook["path"],
                 "args": [*hook["args"][:3], HOOK_PROFILE, records[name], *flags, *hook["args"][4:]],
                 "env": hook["env"], "timeout": 30}
        sim.add(f"breakdown-{name}", entry, "0", glibc, check)
        sim.run(f"breakdown-{name}")
        sim.prepare(f"breakdown-{name}", ctx.s["breakdown_runs"])
    per_run = {name: [] for name in variants}

    def one(name):
        def call():
            if os.path.exists(records[name]):
                os.unlink(records[name])
            done = sim.run(f"breakdown-{name}")
            per_run[name].append((done.ms, read_profile(records[name])))
            return done
        return call
    samples = H.interleave({name: one(name) for name in variants}, ctx.s["breakdown_runs"], warmup=0,
                           seed=ctx.seed + 4)
    out = {name: summarize_profile(per_run[name]) for name in ("static", "glibc")}
    normal, fast = H.summary(samples["static"]["ms"]), H.summary(samples["static-fast-exit"]["ms"])
    out["teardown"] = {
        "runc_run_ms_normal_exit": normal, "runc_run_ms_fast_exit": fast,
        "saving_ms": normal["median"] - fast["median"],
        "paired_ratio": H.paired_ratios(samples["static-fast-exit"]["ms"], samples["static"]["ms"]),
    }
    return out


WORKER_STEP = "[worker] step: "  # hook_profile.STEP, as recorded by the forked worker
STEP_KINDS = ("device node", "mount", "symlink", "mask", "ldconfig", "install")


def step_kind(step: str) -> str:
    return next((kind for kind in STEP_KINDS if step.startswith(kind)), "other")


def step_totals(steps: list) -> dict:
    """{kind: {"ms": sum of the steps' medians, "count": steps}} over the worker's steps."""
    totals = {}
    for p in steps:
        kind = step_kind(p["phase"][len(WORKER_STEP):])
        entry = totals.setdefault(kind, {"ms": 0.0, "count": 0})
        entry["ms"] += p["median_ms"]
        entry["count"] += 1
    return totals


def worker_timeline(per_run: list) -> dict:
    """Medians over the runs of when the namespace worker was ready (its start-up: fork to
    gpuhook.apply.nsworker loaded) and when the hook sent its order: start-up is off the critical
    path while it ends before the order is sent."""
    startup, ready, order, waited = [], [], [], []
    for _, records in per_run:
        up = [r for r in records if r[0].startswith("[worker] worker start-up")]
        sent = [r for r in records if r[0] == "Worker.send_order"]
        if up and sent:
            startup.append(up[0][3] - up[0][2])
            ready.append(up[0][3])
            order.append(sent[0][2])
            waited.append(sent[0][2] - up[0][3])
    if not startup:
        return {}
    med = lambda values: H.summary(values)["median"]  # noqa: E731
    return {"worker start-up (fork to gpuhook.apply.nsworker loaded)": med(startup),
            "worker ready, ms after the hook's first line": med(ready),
            "order sent, ms after the hook's first line": med(order),
            "worker idle before its order (> 0: start-up off the critical path)": med(waited)}


def read_profile(path: str) -> list:
    """Records of hook_profile.py: (phase, depth, start_ms, end_ms, pid)."""
    records = []
    with open(path) as f:
        for line in f:
            name, depth, start, end, pid = line.rstrip("\n").split("\t")
            records.append((name, int(depth), float(start), float(end), int(pid)))
    return records


def summarize_profile(per_run: list) -> dict:
    """Median per phase (summed within a run, e.g. all bind mounts) over the runs, in the
    order phases first start; `calls` is per run."""
    samples, depth, calls, first = {}, {}, {}, {}
    for _, records in per_run:
        totals, counts = {}, {}
        for name, d, start, end, _pid in records:
            totals[name] = totals.get(name, 0.0) + (end - start)
            counts[name] = counts.get(name, 0) + 1
            depth.setdefault(name, d)
            first[name] = min(first.get(name, start), start)
        for name, total in totals.items():
            samples.setdefault(name, []).append(total)
            calls[name] = counts[name]
    table = []
    for name in sorted(samples, key=lambda n: (first[n], depth[n])):
        stats = H.summary(samples[name])
        table.append({"phase": name, "depth": depth[name], "calls": calls[name],
                      "median_ms": stats["median"], "min_ms": stats["min"], "max_ms": stats["max"]})
    return {"runs": len(per_run), "runc_run_ms": H.summary([r for r, _ in per_run]), "phases": table,
            "steps": {kind: round(total["ms"], 3) for kind, total in
                      step_totals([p for p in table if p["phase"].startswith(WORKER_STEP)]).items()},
            "worker": worker_timeline(per_run)}


# --- context, noise, output ---------------------------------------------------------------

class Context:
    def __init__(self, args):
        self.args = args
        self.mode = "quick" if args.quick else "full"
        self.s = SETTINGS[self.mode]
        self.seed = args.seed
        self.launcher = os.path.abspath(args.launcher)
        self.hook = H.hooksd_hook(args.python, launcher=self.launcher)
        self.workdir = tempfile.mkdtemp(prefix="gpuhook-bench-", dir=args.workdir)
        self.state_root = tmpfs_dir() or f"{self.workdir}/state"
        self.noise = []
        self.sim_gpu = None

    def note_noise(self, group: str, when: str) -> None:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        self.noise.append({"group": group, "when": when, "loadavg_1_5_15": [float(x) for x in load],
                           "other_pytest_processes": count_processes(b"pytest"),
                           "creates_ms": create_probe(self.workdir)})


def create_probe(parent: str, rounds: int = 5) -> float:
    """Milliseconds the file system of `parent` (the bundles' rootfs) takes to make what a GPU
    start makes in a busybox rootfs: 10 directories, 20 empty files and 10 symlinks (median of
    `rounds`). A GPU start's mount points and links go there while a start without the hook
    makes nothing there, so the GPU rows move with it: on this VM's disk it went from 0.5 to
    12 ms within an hour (benchmarks/README.md, "Machine noise")."""
    times = []
    for _ in range(rounds):
        top = tempfile.mkdtemp(prefix="create-probe-", dir=parent)
        began = time.perf_counter()
        for i in range(10):
            os.mkdir(f"{top}/d{i}")
        for i in range(20):
            os.close(os.open(f"{top}/f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        for i in range(10):
            os.symlink("f0", f"{top}/l{i}")
        times.append((time.perf_counter() - began) * 1000)
        shutil.rmtree(top)
    return round(statistics.median(times), 2)


def tmpfs_dir() -> str | None:
    """A new directory on /dev/shm when that is a tmpfs (for the simulated hosts' state dirs),
    else None."""
    with open("/proc/self/mounts") as f:
        if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f):
            return None
    return tempfile.mkdtemp(prefix="gpuhook-bench-state-", dir="/dev/shm")


def count_processes(needle: bytes) -> int:
    found = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        found += 1
            except OSError:
                continue
    return found


def git_describe() -> dict:
    """Read-only: the commit and whether the tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no", "--", "gpuhook"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": head, "gpuhook_modified": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {}


def machine() -> dict:
    info = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    runc = shutil.which("runc")
    if runc:
        try:
            info["runc"] = subprocess.run([runc, "--version"], capture_output=True, text=True,
                                          timeout=10).stdout.splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    info["cgroup"] = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"
    return info


def fmt_value(value, unit) -> str:
    if value is None:
        return "—"
    if unit == "ms":
        return f"{value:.1f} ms" if value >= 100 else f"{value:.2f} ms"
    if unit == "MiB":
        return f"{value:.2f} MiB"
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:.3g}"


def fmt_range(r) -> str:
    if r.get("min") is None:
        return "—"
    lo, hi = fmt_value(r["min"], r["unit"]), fmt_value(r["max"], r["unit"])
    return f"{lo.split()[0]}–{hi}"


def fmt_row(r) -> list:
    if r.get("unavailable"):
        return [r["label"], "not available yet" if "not available yet" in r["note"] else "not available",
                "—", "—", (r["target"] or {}).get("text", "—"), "—"]
    ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
    result = {True: "PASS", False: "FAIL", None: "—" if not r["target"] else "?"}[r["pass"]]
    if (r["target"] or {}).get("informational") and r["pass"] is not None:
        result = f"({result.lower()}, info)"
    return [r["label"], fmt_value(r.get("median"), r["unit"]), fmt_range(r), ratio,
            (r["target"] or {}).get("text", "—"), result]


HEADER = ["benchmark", "median", "min–max", "ratio", "target", "result"]


def text_table(rows: list) -> str:
    cells = [HEADER] + [fmt_row(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(c[i].ljust(widths[i]) for i in range(len(HEADER))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] * len(HEADER)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in fmt_row(r)) + " |")
    return "\n".join(lines)


def importtime_text(data: dict) -> str:
    lines = []
    for name, title in (("bare", "bare interpreter (python3 -I -S -c pass)"),
                        ("nogpu", "no-GPU path (NVIDIA_VISIBLE_DEVICES=void)"),
                        ("gpu", "warm GPU path (static image, GPU 0, inside runc)")):
        prof = data.get(name)
        if not prof:
            continue
        if "error" in prof:
            lines.append(f"{title}: {prof['error']}")
            continue
        lines.append(f"{title}: {prof['modules']} imports, {prof['total_self_us'] / 1000:.1f} ms in imports "
                     f"(sum of self times)")
        if prof.get("beyond_bare") is not None:
            lines.append("  beyond the bare interpreter: " + (", ".join(
                f"{e['module']} ({e['cumulative_us'] / 1000:.2f} ms)" for e in prof["beyond_bare"]) or "nothing"))
        lines.append(f"  {'cumulative':>10}  {'self':>8}  module")
        for e in prof["top"]:
            lines.append(f"  {e['cumulative_us'] / 1000:>8.2f}ms  {e['self_us'] / 1000:>6.2f}ms  "
                         f"{'  ' * e['depth']}{e['module']}")
    return "\n".join(lines)


def breakdown_text(data: dict) -> str:
    lines = []
    for name, prof in data.items():
        if name == "teardown":
            continue
        if "error" in prof:
            lines.append(f"{name}: {prof['error']}")
            continue
        lines.append(f"GPU path breakdown, {name} image ({prof['runs']} runs; runc run median "
                     f"{prof['runc_run_ms']['median']:.1f} ms); medians, phases nested by indent:")
        steps = [p for p in prof["phases"] if p["phase"].startswith(WORKER_STEP)]
        for p in prof["phases"]:
            if p in steps:
                continue
            calls = f" ×{p['calls']}" if p["calls"] > 1 else ""
            lines.append(f"  {p['median_ms']:>8.2f} ms  {'  ' * p['depth']}{p['phase']}{calls}")
        if steps:
            lines.append(f"  per step of the namespace worker ({name} image), in the order taken; medians:")
            for p in steps:
                lines.append(f"  {p['median_ms']:>8.2f} ms    {p['phase'][len(WORKER_STEP):]}")
            for kind, total in step_totals(steps).items():
                lines.append(f"  {total['ms']:>8.2f} ms    all {kind} steps ({total['count']})")
        for label, value in (prof.get("worker") or {}).items():
            lines.append(f"  {value:>8.2f} ms  {label}")
    teardown = data.get("teardown")
    if teardown:
        lines.append(f"Interpreter teardown (static image, side by side): runc run median "
                     f"{teardown['runc_run_ms_normal_exit']['median']:.1f} ms with the normal exit, "
                     f"{teardown['runc_run_ms_fast_exit']['median']:.1f} ms when the hook ends with os._exit "
                     f"after flushing: {teardown['saving_ms']:.1f} ms of the start is finalization")
    return "\n".join(lines)


def verdict_lines(rows: list) -> list:
    lines = []
    for r in rows:
        if r.get("target") and not r.get("unavailable"):
            measured = r["ratio"] if r["target"]["on"] == "ratio" else r.get("median")
            shown = f"{measured:.2f}×" if r["target"]["on"] == "ratio" else fmt_value(measured, r["unit"])
            verdict = "PASS" if r["pass"] else "FAIL"
            if r["target"].get("informational"):
                verdict = f"{verdict.lower()} (informational row: a stress case beyond the target's)"
            lines.append(f"- {r['label']}: {shown} (target {r['target']['text']}): {verdict}")
        elif r.get("target") or r.get("unavailable"):
            lines.append(f"- {r['label']}: {r['note']}")
    return lines


def substitution_text(hook: dict) -> str:
    sub = hook["substituted"]
    argv0 = (f"; argv[0] {sub['argv0'][0]} → the same interpreter path (CPython finds its venv from it)"
             if "argv0" in sub else f"; argv[0] stays {hook['args'][0]!r}")
    front = "" if "front" not in sub else (
        f"the native front {sub['front'][0]} → `{sub['front'][1]}`, " if sub["front"][1] else
        f"the native front {sub['front'][0]} dropped (the Python command it runs alone), ")
    return (f"hooks.d/gpuhook.json's hook entry as shipped, with {front}`path` {sub['path'][0]} → `{sub['path'][1]}` "
            f"(this checkout's venv interpreter, not resolved) and the launcher {sub['launcher'][0]} → "
            f"`{sub['launcher'][1]}`{argv0}; nothing else changed: argv `{' '.join(hook['args'])}`, "
            f"env `{' '.join(hook['env'])}`")


def write_markdown(path: str, doc: dict) -> None:
    meta = doc["meta"]
    out = ["# gpuhook benchmark results", "",
           "Generated by `benchmarks/run.py --write-markdown`; do not edit by hand. How to read it: "
           "benchmarks/README.md.", "",
           f"- command: `{meta['command']}`",
           f"- date: {meta['date']}; mode: {meta['mode']}; seed {meta['seed']}",
           f"- commit: {meta['git'].get('commit', '?')}"
           + (" (gpuhook/ modified in the working tree)" if meta["git"].get("gpuhook_modified") else ""),
           f"- machine: {meta['machine'].get('cpu', '?')}, {meta['machine']['cpus']} CPUs, kernel "
           f"{meta['machine']['kernel']}, cgroup {meta['machine']['cgroup']}, Python {meta['machine']['python']}, "
           f"{meta['machine'].get('runc', 'runc ?')}",
           f"- hook invocation: {substitution_text(meta['hook'])}. The rows that say so (the gpu group's "
           "target rows, the runc and installed groups) put the native front (native/build.py's binary) back "
           "in front of that Python command, as hooks.d registers it, with the agent running where a row says "
           "the agent served its starts",
           f"- repetitions: {json.dumps(meta['settings'])}",
           "", markdown_table(doc["rows"]), "", "Against the targets:", "", *verdict_lines(doc["rows"]), ""]
    notes = [f"- `{r['id']}`: {r['note']}" for r in doc["rows"] if r.get("note")]
    if notes:
        out += ["Notes per row:", "", *notes, ""]
    noise = doc.get("noise") or []
    if noise:
        out += ["Machine noise seen (load average 1/5/15 min, other pytest processes, ms to make the 40 entries of a "
                "GPU start in the bundles' file system):", ""]
        out += [f"- {n['group']} {n['when']}: {n['loadavg_1_5_15']}, {n['other_pytest_processes']}, "
                f"{n.get('creates_ms', '?')} ms" for n in noise]
        out.append("")
    if doc.get("importtime"):
        out += ["## -X importtime", "", "```", importtime_text(doc["importtime"]), "```", ""]
    if doc.get("breakdown"):
        out += ["## Where the warm GPU path's time goes", "", "```", breakdown_text(doc["breakdown"]), "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few repetitions: checks the runner, not the targets")
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated groups: {', '.join(GROUPS + EXTRA_GROUPS)} (default: {','.join(GROUPS)})")
    p.add_argument("--importtime", action="store_true", help="also profile imports (-X importtime)")
    p.add_argument("--breakdown", action="store_true", help="also time the warm GPU path's phases")
    p.add_argument("--json", metavar="FILE", help="also write the JSON here")
    p.add_argument("--latest", default=LATEST, metavar="FILE",
                   help=f"where the JSON always goes (default {os.path.relpath(LATEST, REPO)}, git-ignored)")
    p.add_argument("--write-markdown", nargs="?", const=MARKDOWN, metavar="FILE",
                   help=f"write the Markdown report (default {os.path.relpath(MARKDOWN, REPO)})")
    p.add_argument("--python", default=None, help="interpreter registered as the hook's path (default: the venv's)")
    p.add_argument("--launcher", default=H.LAUNCHER,
                   help="gpuhook/launch.py to register (default: this checkout's; another tree's for an A/B "
                        "comparison; --breakdown always profiles this checkout)")
    p.add_argument("--against", default=None, metavar="LAUNCHER",
                   help="gpu group: also time the static-image start with another tree's gpuhook/launch.py, "
                        "interleaved with this one's (an A/B comparison in the same run; informational row)")
    p.add_argument("--seed", type=int, default=8, help="seed of the interleaving order")
    p.add_argument("--workdir", default=None, help="parent of the scratch directory (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS + EXTRA_GROUPS]
    if unknown:
        p.error(f"unknown group(s): {', '.join(unknown)}")
    if args.importtime:
        groups.append("importtime")
    if args.breakdown:
        groups.append("breakdown")
    args.groups = list(dict.fromkeys(groups))
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = Context(args)
    started = time.monotonic()
    doc = {"meta": {
        "command": "benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "mode": ctx.mode, "seed": ctx.seed, "settings": ctx.s, "groups": args.groups,
        "machine": machine(), "git": git_describe(),
        "hook": {k: ctx.hook[k] for k in ("path", "args", "env", "substituted")},
        "substitution_note": substitution_text(ctx.hook),
        "targets": TARGETS,
    }, "rows": [], "errors": {}}
    functions = {"nogpu": group_nogpu, "runc": group_runc, "gpu": group_gpu, "health": group_health,
                 "daemon": group_daemon, "installed": group_installed}
    try:
        for group in args.groups:
            if group not in functions:
                continue
            print(f"[{group}] running ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                doc["rows"] += functions[group](ctx)
            except Unavailable as err:
                doc["rows"].append(H.unavailable_row(group, group, f"{group}: all rows", f"not available: {err}"))
                doc["errors"][group] = str(err)
            except Exception as err:  # noqa: BLE001 - report the group as failed, keep the others
                doc["rows"].append(H.unavailable_row(group, group, f"{group}: all rows",
                                                     f"not available: failed: {type(err).__name__}: {err}"))
                doc["errors"][group] = f"{type(err).__name__}: {err}"
            print(f"[{group}] {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        if "importtime" in args.groups:
            doc["importtime"] = {}
            for name, fn in (("nogpu", importtime_nogpu), ("gpu", importtime_gpu)):
                try:
                    result = fn(ctx)
                    if name == "nogpu":
                        doc["importtime"].update(result)
                    else:
                        doc["importtime"]["gpu"] = result
                except Unavailable as err:
                    doc["importtime"][name] = {"error": f"not available: {err}"}
                    doc["errors"][f"importtime.{name}"] = str(err)
                except Exception as err:  # noqa: BLE001
                    doc["importtime"][name] = {"error": f"failed: {type(err).__name__}: {err}"}
                    doc["errors"][f"importtime.{name}"] = f"{type(err).__name__}: {err}"
        if "breakdown" in args.groups:
            try:
                doc["breakdown"] = breakdown_gpu(ctx)
            except Unavailable as err:
                doc["breakdown"] = {"gpu": {"error": f"not available: {err}"}}
                doc["errors"]["breakdown"] = str(err)
            except Exception as err:  # noqa: BLE001
                doc["breakdown"] = {"gpu": {"error": f"failed: {type(err).__name__}: {err}"}}
                doc["errors"]["breakdown"] = f"{type(err).__name__}: {err}"
    finally:
        if args.keep:
            print(f"scratch kept: {ctx.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(ctx.workdir, ignore_errors=True)
            shutil.rmtree(ctx.state_root, ignore_errors=True)
    doc["noise"] = ctx.noise
    for r in doc["rows"]:
        extra = []
        if r.get("paired_ratio"):
            p = r["paired_ratio"]
            extra.append(f"per-round paired ratio {p['median']:.2f}× (p10–p90 {p['p10']:.2f}–{p['p90']:.2f})")
        if r.get("cpu_ratio"):
            extra.append(f"CPU-time (user+sys) ratio {r['cpu_ratio']:.2f}×")
        if extra:
            r["note"] = "; ".join(filter(None, [r["note"], *extra]))
    doc["meta"]["seconds"] = round(time.monotonic() - started, 1)

    # Files first: a closed stdout (| head) must not lose the results.
    text = json.dumps(doc, indent=2, default=str) + "\n"
    for path in filter(None, (args.latest, args.json)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    if args.write_markdown:
        write_markdown(args.write_markdown, doc)
    print(text_table(doc["rows"]))
    verdicts = verdict_lines(doc["rows"])
    if verdicts:
        if ctx.mode == "quick":
            verdicts.insert(0, "(--quick: a few rounds only, to check the runner; these verdicts are not measurements)")
        print("\n" + "\n".join(verdicts))
    if doc.get("importtime"):
        print("\n" + importtime_text(doc["importtime"]))
    if doc.get("breakdown"):
        print("\n" + breakdown_text(doc["breakdown"]))
    print(f"\nJSON: {args.latest}" + (f", {args.json}" if args.json else ""))
    if args.write_markdown:
        print(f"Markdown: {args.write_markdown}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
