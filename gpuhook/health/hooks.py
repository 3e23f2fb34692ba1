"""The health checks at the hook's stages: before a start, after it, and after a stop.

gpuhook.apply.run.run calls these only when the plan has a health step ([health] mode is not
off and the plan has GPUs), so a
container without GPUs, and every container with mode = "off", never loads NVML, threads or
this package. Each fills the hook's log line (`log`) with what it decided.
"""

import time

from gpuhook.errors import GpuhookError
from gpuhook.health import registry, store

FALLBACK = "fallback"
WARN = "warn"


def plan_gpus(plan) -> list:
    """UUIDs of the GPUs a plan gives the container, each once: whole GPUs and the parent
    GPUs of its MIG devices (gpuhook.plan.make keeps both in `gpus`)."""
    uuids = []
    for gpu in plan.gpus:
        if gpu.uuid not in uuids:
            uuids.append(gpu.uuid)
    return uuids


def begin_start(plan, state, config, hook_deadline: float, log: dict) -> "StartCheck":
    """Set the plan's health step going (plan.HealthStep): check and repair its GPUs (whole
    GPUs and the parents of its MIG devices) before the container gets them. In fallback
    mode a GPU is skipped when a fresh stamp made for this container's allocation (a token
    the device plugin's Allocate gave it) is claimed, or when the health daemon, asked on
    this start's own connection, answers that it prepared the GPU just now. The daemon is
    asked here and answers while the caller grants the cgroup rules (gpuhook.apply.run);
    `StartCheck.finish` reads its answer and checks the rest in the hook."""
    return StartCheck(plan, state, config, hook_deadline, log)


class StartCheck:
    """A start's health step under way (`begin_start`): the stamps claimed and the daemon
    asked. `finish` raises the report's error unless on-failure = warn; `close` gives up
    on the daemon's answer (the start failed before `finish`)."""

    def __init__(self, plan, state, config, hook_deadline: float, log: dict):
        self.health, self.state, self.config, self.hook_deadline = plan.health, state, config, hook_deadline
        self.info = {"mode": self.health.mode}
        log["health"] = self.info
        self.todo = list(self.health.gpus)
        self.skipped = {}
        self.asked = None
        if self.todo and self.health.mode == FALLBACK:
            # A stamp serves only the start it was made for: without a token this start can
            # have none, and other starts' stamps are never looked at (docs/health.md, "Stamps").
            for uuid in list(self.todo) if self.health.allocations else ():
                claim = store.claim_stamp(config.state_dir, uuid, config.health.stamp_ttl_seconds,
                                          self.health.allocations)
                if claim.fresh:
                    self.skipped[uuid] = claim.why
                    self.todo.remove(uuid)
                elif claim.why != "no stamp":
                    self.info.setdefault("stamps", {})[uuid] = claim.why
            if self.todo:
                # The health daemon (gpuhook plugin) keeps NVML loaded: let it prepare them, so
                # this process loads no NVML. Its answer comes on this start's own connection and
                # leaves no stamp another start could claim. Anything short of "prepared": our
                # own checks.
                from gpuhook.health import daemon

                left = min(time.monotonic() + self.health.deadline_seconds, hook_deadline) - time.monotonic()
                self.asked = daemon.ask_start(config, self.todo, state.id, min(daemon.DAEMON_TIMEOUT, left / 2))

    def close(self) -> None:
        """The start failed before `finish`: the daemon's answer is not read, and the log
        line says it was asked (it may have checked, cleaned or reset the GPUs meanwhile; its
        own log line says what it did: attacker pass 25)."""
        if self.asked is not None:
            if self.asked.sock is not None:
                self.info["daemon"] = ("asked to prepare the GPUs; the start failed before its answer was read "
                                       "(the health daemon's own log line says what it did)")
            self.asked.close()
            self.asked = None

    def finish(self) -> None:
        health, info, todo = self.health, self.info, self.todo
        if self.asked is not None:
            prepared, why = self.asked.answer()
            self.asked = None
            info["daemon"] = why
            for uuid in prepared:
                self.skipped[uuid] = why
                todo.remove(uuid)
        if self.skipped:
            info["skipped"] = self.skipped
        if not todo:
            return
        from gpuhook.health import engine  # NVML and threads: only now that a GPU needs checking

        deadline = min(time.monotonic() + health.deadline_seconds, self.hook_deadline)
        policy = engine.Policy(True, health.kill_orphans, None, "needed")
        started = time.monotonic()
        try:
            report = engine.run(todo, self.config, "prestart", policy, deadline, self.state.id, self.state.pid)
        except GpuhookError as err:
            info["error"] = err.one_line()
            if health.on_failure == WARN:
                info["warning"] = f"GPUs not checked: {err.one_line()}"
                return
            raise
        finally:
            info["nvml"] = _why_loaded(health.mode, info.get("daemon"), self.config, time.monotonic() - started)
        info.update(report.as_dict())
        error = report.error()
        if error is None:
            return
        if health.on_failure == WARN:
            info["warning"] = error.one_line()
            return
        raise error


def _why_loaded(mode: str, daemon_said, config, seconds: float) -> str:
    """Why this start loaded NVML in the hook, where the health daemon would have spared it
    (seconds on a host without persistence mode): the log line says what made it slow."""
    if mode != FALLBACK:
        return f"health.mode = {mode}: checked the GPUs in the hook, loading NVML ({seconds:.2f} s)"
    from gpuhook.health import daemon

    return f"{daemon_said} at {daemon.socket_path(config)}: checked the GPUs in the hook, loading NVML ({seconds:.2f} s)"


def register_container(plan, state, config, names: dict, log: dict):
    """Record the container being started (its init, cgroups and GPUs) in the registry, so
    its GPU processes are known as its own while it runs and as orphans once it is gone.
    Returns the entry, for `unregister` should the start fail after all; None when there
    is none. Best effort: a container that cannot be registered is only noted (its
    processes then count as another container's: never killed)."""
    gpus = plan_gpus(plan)
    if not gpus:
        return None
    # The Kubernetes names from the state's and the bundle's annotations (journal.k8s_names).
    kept = {key: names[key] for key in ("pod", "namespace", "container_name") if key in names}
    try:
        entry = registry.from_process(state.id, state.pid, gpus, kept)
        registry.add(config.state_dir, entry)
    except (OSError, LookupError) as err:
        log["registered"] = f"not registered: {err}"
        return None
    log["registered"] = {"pid": entry.pid, "cgroups": entry.cgroups}
    return entry


def unregister(config, entry, log: dict) -> None:
    """Take back `register_container`'s entry of a start that failed after it."""
    if entry is None:
        return
    try:
        registry.forget(config.state_dir, entry)
        log["registered"] = "not registered: the start failed"
    except OSError as err:
        log["registered"] = f"the failed start's entry could not be removed: {err}"


def after_stop(state, config, hook_deadline: float, log: dict) -> None:
    """After the container stopped: kill what it left on its GPUs and, with reset-on-release,
    reset each GPU it was the last user of. Never raises: a stop must not fail; problems are
    in the record (and in the GPUs' reports).

    A stop does only what an enabled action needs: with reset-on-release off and nothing
    left in the container's cgroups (or kill-orphans off), NVML is not loaded at all; when
    NVML is needed and the health daemon runs, the daemon does the work (it keeps NVML
    loaded; docs/health.md, "After a stop")."""
    entries = registry.load_id(config.state_dir, state.id)
    if not entries:
        log["decision"] = "nothing to clean up (container not registered)"
        return
    # The state's id alone proves nothing: another runtime root can have a live container of
    # the same id, and a poststop can be invoked by hand. Only a container whose init is gone
    # is cleaned up; a live one is never touched (docs/security.md).
    gone = [entry for entry in entries if not registry.is_alive(entry)]
    if not gone:
        log["decision"] = (f"nothing cleaned: container {entries[-1].label()} is still running "
                              f"(init pid {entries[-1].pid})")
        return
    deadline = min(time.monotonic() + config.health.deadline_seconds, hook_deadline)
    decisions = []
    for entry in gone:
        left = processes_left(entry)
        if not config.health.reset_on_release and not (config.health.kill_orphans and left):
            if left:
                # Kept: whatever is still in its cgroups is recognised as an orphan later.
                decisions.append("cleanup incomplete (container kept in the registry)")
                log["left"] = f"{len(left)} process(es) in its cgroups; not killed: kill-orphans is off"
            else:
                registry.forget(config.state_dir, entry)
                decisions.append("cleaned up")
            continue
        from gpuhook.health import daemon

        answer, why = daemon.release(config, entry, max(deadline - time.monotonic(), 0.05))
        if answer is not None:
            log["daemon"] = why
            if answer.get("health") is not None:
                log["health"] = answer["health"]
            if answer.get("error"):
                log.update(decision="cleanup failed", error=str(answer["error"])[:300])
                return
            decisions.append(str(answer.get("decision", "cleaned up")))
            continue
        log["daemon"] = why
        try:
            decision, report = cleanup(entry, config, deadline)
        except GpuhookError as err:
            log.update(decision="cleanup failed", error=err.one_line())
            return
        log["health"] = report.as_dict()
        decisions.append(decision)
    log["decision"] = "; ".join(dict.fromkeys(decisions))


def cleanup(entry, config, deadline: float) -> tuple:
    """(decision, engine.Report) for a gone container's entry: its leftovers on its GPUs killed
    (kill-orphans), each GPU nobody else uses reset (reset-on-release), the entry forgotten
    when nothing is left behind. Raises GpuhookError when NVML cannot be used."""
    from gpuhook.health import engine

    report = engine.release(entry, config, deadline)
    leftovers = [process.pid for result in report.gpus for finding in result.problems
                 for process in finding.targets
                 if process.container is not None and process.container == entry]
    if report.cut_off or leftovers:
        # Keep the entry: whatever is still in its cgroups is recognised as an orphan later.
        return "cleanup incomplete (container kept in the registry)", report
    registry.forget(config.state_dir, entry)
    return "cleaned up", report


def processes_left(entry, proc: str = "/proc") -> list:
    """Pids still in the container's own cgroups (one read of each cgroup.procs; an unreadable
    cgroup that still exists counts as holding something)."""
    from gpuhook.kernel import mountinfo

    try:
        mounts = mountinfo.cgroup_mounts_here(proc)
    except OSError:
        return ["?"]
    directories = registry.cgroup_directories(entry.cgroups, mounts)
    if entry.cgroups and not directories:
        return ["?"]  # no mount here shows them: nothing can be concluded
    left = []
    for directory in directories:
        try:
            with open(f"{directory}/cgroup.procs", "rb") as f:
                left += [int(p) for p in f.read(1 << 20).split() if int(p) not in left]
        except FileNotFoundError:
            continue  # removed with the container
        except (OSError, ValueError):
            left.append("?")
    return left
