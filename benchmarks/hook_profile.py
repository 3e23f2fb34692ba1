"""Runs as the prestart hook in place of gpuhook/launch.py and times the GPU path's phases.

    python3 -I -S benchmarks/hook_profile.py RECORD_FILE [--fast-exit] prestart --config FILE

benchmarks/run.py --breakdown registers this in a runc bundle. It imports gpuhook the way
launch.py does, wraps gpuhook's functions with timers (module attributes, so the product
code runs unchanged), then calls gpuhook.entry.main. Each timed call appends one line to
RECORD_FILE: phase, nesting depth, start and end in ms since this file started, pid. The
forked namespace worker inherits the open file (it is opened before the worker enters the
container's mount namespace, where the path would not resolve). In the worker, each step it
takes (every device node, bind mount, symlink, the /proc mask, ldconfig) gets its own record
named "step: <the worker's name of the step>", e.g. "step: mount /usr/bin/nvidia-smi", and the
mount system calls (open_tree, mount_setattr, move_mount, mount) are timed; "worker start-up"
runs from the fork to gpuhook.apply.nsworker loaded.

With --fast-exit the process ends with os._exit after flushing stdio instead of the normal
interpreter finalization; run.py times both side by side to measure what teardown costs.

Only `time`, `os` and `sys` are used here, all of which the hook loads anyway. What this
cannot see: the interpreter's start-up before this file runs (the bare interpreter's time
in the nogpu group) and its teardown.
"""

import sys
import time

T0 = time.perf_counter_ns()

import os  # noqa: E402

sys.path.insert(0, __file__.rpartition("/")[0].rpartition("/")[0])
RECORD = os.open(sys.argv.pop(1), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
FAST_EXIT = sys.argv[1:2] == ["--fast-exit"]
if FAST_EXIT:
    del sys.argv[1]
MAIN_PID = os.getpid()
_depth = [0]
READY_AT = [T0]  # when the namespace worker was forked (set just before the fork)


def emit(name: str, depth: int, start: int, end: int) -> None:
    pid = os.getpid()
    if pid != MAIN_PID:
        name = "[worker] " + name
    os.write(RECORD, f"{name}\t{depth}\t{(start - T0) / 1e6:.4f}\t{(end - T0) / 1e6:.4f}\t{pid}\n".encode())


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        depth = _depth[0]
        _depth[0] = depth + 1
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            _depth[0] = depth
            emit(name, depth, start, end)
    wrapper.__wrapped__ = fn
    return wrapper


class MissingName(SystemExit):
    """A function this profiler times is no longer where it looks: the product moved or
    renamed it. The hook fails (so does `run.py --breakdown`) with one line naming it,
    rather than leaving a phase out of the table unnoticed."""


def patch(module, attribute: str, name: str) -> None:
    """Wrap module.attribute. A name the product no longer has is an error (MissingName):
    re-point it here when gpuhook's internals move."""
    original = getattr(module, attribute, None)
    if not callable(original):
        where = getattr(module, "__module__", None) or getattr(module, "__name__", repr(module))
        owner = f"{where}.{module.__qualname__}" if isinstance(module, type) else where
        raise MissingName(f"benchmarks/hook_profile.py: {owner}.{attribute} does not exist (phase {name!r}); "
                          "re-point the profiler at where it lives now")
    setattr(module, attribute, timed(name, original))


class PatchOnImport:
    """A meta path finder that lets the normal finders find module `name`, then times its
    import and calls `patcher(module)` once it has run."""

    def __init__(self, name: str, patcher):
        self.name = name
        self.patcher = patcher

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            start = time.perf_counter_ns()
            exec_module(module)
            emit(f"import {fullname}", 1, start, time.perf_counter_ns())
            self.patcher(module)

        spec.loader.exec_module = exec_and_patch
        return spec


# Prefix of the per-step records (one per device node, bind mount, symlink, the /proc mask
# and ldconfig, named as the worker names its steps): run.py's per-mount table reads them.
STEP = "step: "


def patch_steps(nsworker) -> None:
    """Time each step the worker takes (nsworker.steps yields (name, action) pairs), one record
    per step, named by the step: "device node /dev/nvidia0", "mount /usr/bin/nvidia-smi"."""
    original = getattr(nsworker, "steps", None)
    if not callable(original):
        raise MissingName("benchmarks/hook_profile.py: gpuhook.apply.nsworker.steps does not exist; "
                          "re-point the per-step timers")

    def steps(*args, **kwargs):
        for name, action in original(*args, **kwargs):
            yield name, timed(STEP + name, action)
    nsworker.steps = steps


def patch_ldconfig(ldconfig) -> None:
    """The ld cache step and, inside it, the sandbox's phases (gpuhook.apply.ldsandbox: they
    run in the sandbox process, which inherits the record file like the worker)."""
    from gpuhook.apply import ldsandbox
    from gpuhook.kernel import child, linux

    patch(ldconfig, "build_cache", "ldconfig.build_cache")
    patch(ldconfig, "install_cache", "ldconfig.install_cache")
    # _sandbox is not timed: it becomes ldconfig (exec), so it never returns to say when it ended
    for name in ("_fork_in_new_pid_namespace", "_ready", "_readonly_copy", "_detach_foreign", "_output_dir",
                 "_verify", "_hand_back"):
        patch(ldsandbox, name, f"ldsandbox.{name}")
    patch(child, "wait_for", "child.wait_for (ldconfig itself: exec, run, exit)")
    patch(child, "kill_group", "child.kill_group")
    for name in ("unshare", "umount2", "pivot_root"):
        patch(linux, name, f"linux.{name}")


def patch_worker(nsworker) -> None:
    from gpuhook.apply import rootfs
    from gpuhook.kernel import linux

    # The worker's start-up: from the fork to its module loaded, ready for the order.
    emit("worker start-up (fork to gpuhook.apply.nsworker loaded)", 1, READY_AT[0], time.perf_counter_ns())
    patch(nsworker, "read_exactly", "nsworker.read_exactly (waiting for the order)")
    patch(nsworker, "run", "nsworker.run (in the container's mount ns)")
    from gpuhook.apply import mounts, nodes, procmask, target

    for method in ("open_sources", "check_rootfs", "refuse_shared"):
        patch(target.Target, method, f"Target.{method}")
    patch(nodes, "make_node", "nodes.make_node")
    patch(mounts, "bind", "mounts.bind")
    patch(nodes, "make_symlink", "nodes.make_symlink")
    patch(procmask, "mask_proc", "procmask.mask_proc")
    for name in ("_new_mount_point", "_attach", "_bind_and_remount"):
        patch(mounts, name, f"mounts.{name}")
    # The ld cache steps' module is imported only for an image with an ld cache.
    sys.meta_path.insert(0, PatchOnImport("gpuhook.apply.ldconfig", patch_ldconfig))
    patch_steps(nsworker)
    patch(rootfs, "make_dirs", "rootfs.make_dirs")
    patch(rootfs, "ensure_file", "rootfs.ensure_file")
    for name in ("mount", "setns", "open_tree_clone", "mount_setattr", "move_mount"):
        patch(linux, name, f"linux.{name}")


def main() -> None:
    start = time.perf_counter_ns()
    _depth[0] = 1
    from gpuhook import entry, prescan  # noqa: F401
    emit("import gpuhook.entry, gpuhook.prescan", 1, start, time.perf_counter_ns())
    start = time.perf_counter_ns()
    from gpuhook import hook
    emit("import gpuhook.hook (config, oci, request, discover, inventory, plan, journal, fastjson, ...)",
         1, start, time.perf_counter_ns())
    start = time.perf_counter_ns()
    from gpuhook.apply import run as apply
    emit("import gpuhook.apply.run (worker, order, cgroup.hierarchy, ...)", 1, start, time.perf_counter_ns())
    from gpuhook import config, journal
    from gpuhook.apply import statefiles
    from gpuhook.apply.cgroup import hierarchy
    from gpuhook.discover import inventory
    from gpuhook.kernel import files
    from gpuhook.plan import select
    from gpuhook.request import oci, resolve

    patch(entry, "run_stage", "entry.run_stage (stdin, config.json, prescan, hook)")
    patch(prescan, "may_request_gpu", "prescan.may_request_gpu")
    patch(hook, "run_hook", "hook.run_hook")
    patch(config, "load", "config.load (cached TOML)")
    patch(files, "read", "files.read (fastjson)")
    patch(hook, "read_container", "hook.read_container")
    patch(oci, "parse_state", "oci.parse_state")
    patch(oci, "parse_spec", "oci.parse_spec")
    patch(hook, "prestart", "hook.prestart")
    patch(hook, "plan_start", "hook.plan_start")
    patch(resolve, "resolve", "resolve.resolve")
    from gpuhook.discover import survey

    patch(survey, "survey", "survey.survey (discovery)")
    patch(inventory, "read", "inventory.read (cached)")
    # Timed where they are called: inventory and survey import these functions by name.
    patch(inventory, "driver_version", "proc.driver_version")
    patch(inventory, "fingerprint", "inventory.fingerprint")
    patch(inventory, "inventory_from_dict", "inventory.inventory_from_dict")
    patch(inventory, "ipc", "driverfiles.ipc")
    patch(select, "select", "select.select")
    patch(survey, "container_facts", "container.container_facts")
    from gpuhook.plan import make as plan_make  # hook.plan_start imports it by name when it runs

    patch(plan_make, "make_plan", "plan.make_plan")
    patch(statefiles, "write_caches", "statefiles.write_caches")
    patch(apply, "run", "apply.run (health, apply, records)")
    patch(apply, "begin", "apply.begin (order the worker, grant)")
    patch(apply.Pending, "finish", "Pending.finish (wait for the worker, commit)")
    patch(apply, "open_container_mntns", "apply.open_container_mntns")
    patch(apply, "read_proc_files", "apply.read_proc_files")
    patch(hierarchy, "placement", "cgroup.hierarchy.placement")
    patch(apply, "_grant", "apply._grant (devices.allow / device program, systemd)")
    from gpuhook.apply import worker

    patch(worker, "start_early", "worker.start_early (fork the namespace worker)")
    fork = worker.start

    def start_marked(*args, **kwargs):
        READY_AT[0] = time.perf_counter_ns()  # the child inherits it: its start-up begins here
        return fork(*args, **kwargs)
    worker.start = start_marked
    patch(worker.Worker, "send_order", "Worker.send_order")
    patch(worker.Worker, "report", "Worker.report (parent waits for the worker)")
    patch(worker.Worker, "commit", "Worker.commit (worker keeps its work, exits)")
    patch(worker, "discard", "worker.discard")
    # The worker imports gpuhook.apply.nsworker itself, after the fork (that is the point of
    # forking early): its phases are patched as that import finishes, in the worker.
    sys.meta_path.insert(0, PatchOnImport("gpuhook.apply.nsworker", patch_worker))
    # Health (only with [health] mode on) is imported where it is used: patched likewise.
    sys.meta_path.insert(0, PatchOnImport("gpuhook.health.hooks", lambda m: (
        patch(m, "begin_start", "health.begin_start (stamps, the daemon asked)"),
        patch(m.StartCheck, "finish", "StartCheck.finish (the daemon's answer or own checks)"),
        patch(m, "register_container", "health.register_container"))))
    sys.meta_path.insert(0, PatchOnImport("gpuhook.apply.grants", lambda m: patch(m, "save", "grants.save (cgroup v1)")))
    sys.meta_path.insert(0, PatchOnImport("gpuhook.health.daemon", lambda m: (
        patch(m, "ask_start", "health.daemon.ask_start"),
        patch(m.Asked, "answer", "health.daemon Asked.answer (waits for the daemon)"))))
    sys.meta_path.insert(0, PatchOnImport("gpuhook.health.store", lambda m: patch(m, "claim_stamp",
                                                                                   "health.store.claim_stamp")))
    patch(journal, "write", "journal.write (decision log)")
    try:
        entry.main(sys.argv[1:])
    finally:
        emit("total in the hook process (after interpreter start-up, before teardown)", 0, T0,
             time.perf_counter_ns())


if FAST_EXIT:
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
main()
