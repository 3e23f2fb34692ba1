"""Check, repair and re-check many GPUs at once, all within one deadline.

One thread per GPU (NVML's calls release the GIL, so a slow GPU does not hold up the
others; 16 GPUs that take 1 s each take about 1 s), coordinated by one more thread that
reads the registry (and asks NVML for the parents of MIG devices). The caller waits for
them only until the deadline: what is unfinished then is reported as cut off, naming the
GPU and the step it was in, and those threads are told to stop before their next action,
so nothing is killed or reset after the deadline. (A thread stuck inside an NVML call cannot be interrupted; it
ends with the call, or with the hook's process.)

Per GPU, under its lock (store.GpuLock), with an NVML session of its own:

    restore persistence mode an interrupted reset left off  (actions.restore_persistence)
    query -> attribute -> evaluate                         (checks.evaluate)
    kill orphans (kill-orphans) -> re-check                (actions.kill)
    reset when a remedy needs it and nobody uses the GPU -> re-check   (actions.reset_gpu)
    write <state-dir>/health/<uuid>.json

NVML is open only while a GPU's work runs, never while a thread waits for a GPU lock: a
reset needs every NVML session on the host closed (gpuhook.discover.nvml, Resets), and a session held
while waiting for the lock of a GPU another gpuhook process is resetting would keep that
reset from ever running. A reset closes the sessions of this process (the other GPUs' threads
wait for it between their NVML calls) and opens them again after.

A GPU is *used* by any process whose owner is alive (a container, another container, the
host) and by any other registered container whose init is alive and that holds it (MIG
instances included: the registry lists their parent GPUs). A used GPU is never reset.

`run` is the machine; `prepare`, `check` and `release` (and gpuhook.health.hooks for the
hook's stages) are the ways in.
"""

import threading
import time
from enum import Enum

from gpuhook import journal
from gpuhook.discover import nvml
from gpuhook.errors import GpuhookError, GpuUnhealthyError, HealthDeadlineError, HostError, NvmlError
from gpuhook.health import actions, checks, owners, registry, store
from gpuhook.health.checks import Check, Outcome, Remedy
from gpuhook.record import record

FORMAT = 1
MIB = 1 << 20


class Status(str, Enum):
    HEALTHY = "healthy"  # nothing was wrong
    REPAIRED = "repaired"  # something was wrong and is fixed
    UNHEALTHY = "unhealthy"  # still wrong (the report says what and why it was not fixed)
    UNCHECKED = "unchecked"  # cut off by the deadline
    SKIPPED = "skipped"  # the hook trusted a fresh stamp from `gpuhook prepare`


OK_STATUSES = frozenset({Status.HEALTHY, Status.REPAIRED, Status.SKIPPED})

# Steps as they appear in timings, in the log and in a cut-off message.
STEPS = {
    "nvml-init": "starting NVML",
    "persistence": "restoring persistence mode an interrupted reset left off",
    "resolve": "finding the parent GPUs of MIG devices",
    "registry": "reading the container registry",
    "lock": "waiting for another check or reset of this GPU",
    "query": "NVML health queries",
    "attribute": "attributing GPU processes",
    "kill": "killing orphaned processes",
    "reset": "resetting the GPU",
    "re-check": "checking again after a repair",
    "report": "writing the health report",
}


class Policy(record("Policy", "repair kill_orphans kill_only reset")):
    """What a run may do. `repair`: any action at all; `kill_orphans`: config; `kill_only`:
    the key (id, init pid, start time: registry.Container.key) of the container whose
    leftovers alone are killed (poststop), None for every orphan;
    `reset`: "needed" (when a remedy needs it), "release" (whenever nobody uses the GPU:
    reset-on-release) or "never"."""

    __slots__ = ()


class CutOff(record("CutOff", "uuid step seconds")):
    __slots__ = ()

    def text(self) -> str:
        return f"{self.uuid} at step {self.step} ({STEPS.get(self.step, self.step)}) after {self.seconds:.2f} s"


class GpuResult(record("GpuResult", "uuid status outcomes problems fixed blocked actions users facts steps seconds")):
    """One GPU's outcome. `problems`: checks.Finding still there; `fixed`: those repaired;
    `blocked`: Remedy -> why it did not (fully) work; `actions`: actions.Action done;
    `users`: who uses the GPU (words); `facts`: checks.facts_summary; `steps`: seconds per step."""

    __slots__ = ()

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def failure(self) -> str:
        """The first remaining problem as "<check> check: <evidence>; <why not repaired>", and
        the other checks that failed by name."""
        if not self.problems:
            return ""
        first = self.problems[0]
        why = self.blocked.get(first.remedy, "")
        others = list(dict.fromkeys(p.check.value for p in self.problems[1:] if p.check != first.check))
        also = f" (also failed: {', '.join(others)})" if others else ""
        return f"{first.check.value} check: {first.evidence}" + (f"; {why}" if why else "") + also

    def as_dict(self) -> dict:
        return {
            "uuid": self.uuid,
            "status": self.status.value,
            "healthy": self.ok,
            "checks": {check.value: outcome.value for check, outcome in self.outcomes.items()},
            "problems": [{"check": f.check.value, "remedy": f.remedy.value, "evidence": f.evidence}
                         for f in self.problems],
            "fixed": [{"check": f.check.value, "remedy": f.remedy.value, "evidence": f.evidence} for f in self.fixed],
            "failure": self.failure() or None,
            "actions": [a.as_dict() for a in self.actions],
            "users": list(self.users),
            "facts": self.facts,
            "steps": {name: round(seconds, 4) for name, seconds in self.steps.items()},
            "seconds": round(self.seconds, 4),
        }


class _Examined(record("_Examined", "facts processes problems outcomes")):
    """One look at a GPU: nvml.Health (None when NVML failed on it), its owners.Attributed
    processes, and checks.evaluate's problems and outcomes."""

    __slots__ = ()


class Report(record("Report", "purpose gpus seconds cut_off budget")):
    """The outcome of one run: `gpus` (GpuResult, in request order), `cut_off` (CutOff of the
    GPUs the deadline stopped), `budget` (the deadline, in seconds from the start)."""

    __slots__ = ()

    @property
    def ok(self) -> bool:
        return not self.cut_off and all(g.ok for g in self.gpus)

    def error(self) -> GpuhookError | None:
        """The error this report means for a start (one line), or None when all is well."""
        if self.cut_off:
            first, *others = self.cut_off
            more = f" (also cut off: {', '.join(c.uuid for c in others)})" if others else ""
            return HealthDeadlineError(f"health checks cut off by their {self.budget:.1f} s deadline: "
                                       f"{first.text()}{more}", first.uuid, first.step, self)
        failing = [g for g in self.gpus if not g.ok]
        if not failing:
            return None
        first = failing[0]
        more = f" (also failing: {', '.join(g.uuid for g in failing[1:])})" if failing[1:] else ""
        problem = first.problems[0] if first.problems else None
        return GpuUnhealthyError(f"{first.uuid} failed its {first.failure()}{more}", first.uuid,
                                 problem.check.value if problem else "", problem.evidence if problem else "",
                                 self)

    def as_dict(self) -> dict:
        return {"purpose": self.purpose, "ok": self.ok, "seconds": round(self.seconds, 4),
                "deadline_seconds": round(self.budget, 3),
                "cut_off": [{"uuid": c.uuid, "step": c.step, "seconds": round(c.seconds, 4)} for c in self.cut_off],
                "gpus": [g.as_dict() for g in self.gpus]}

    def serial_seconds(self) -> float:
        """What the same GPUs would have cost one after the other: the sum of their times."""
        return sum(g.seconds for g in self.gpus)


# Runs whose threads outlived their caller's deadline (see wait_for_stragglers).
_stragglers = set()
_stragglers_lock = threading.Lock()


def wait_for_stragglers(timeout: float) -> bool:
    """Wait until the threads of runs cut off by their deadline have ended (they still hold
    an NVML session and GPU locks until then); True when none is left. A long-lived caller
    (a device plugin, a test) calls this before it exits or switches NVML libraries."""
    end = time.monotonic() + timeout
    while True:
        with _stragglers_lock:
            pending = [r for r in _stragglers if not r.done.is_set()]
            _stragglers.difference_update(r for r in list(_stragglers) if r.done.is_set())
        if not pending:
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        pending[0].done.wait(left)


def run(uuids, config, purpose: str, policy: Policy, deadline: float, container_id: str | None = None,
        container_pid: int = 0) -> Report:
    """Check (and, per `policy`, repair) the GPUs `uuids` (GPU or MIG UUIDs; a MIG device is
    checked as its parent GPU) until monotonic time `deadline`. Writes a report per GPU.
    `container_id` and `container_pid` name the container being started (its own registry
    entry, should the hook run twice, is nobody's). Raises HostError when NVML cannot be
    used at all; GPU problems are in the Report."""
    started = time.monotonic()
    wanted = []
    for uuid in uuids:
        store.checked_uuid(uuid)
        if uuid not in wanted:
            wanted.append(uuid)
    job = _Run(wanted, config, purpose, policy, deadline, container_id, container_pid)
    thread = threading.Thread(target=job.main, name="gpuhook-health", daemon=True)
    thread.start()
    job.done.wait(max(deadline - time.monotonic(), 0))
    if not job.done.is_set():
        job.cancel()
        with _stragglers_lock:
            _stragglers.add(job)
    elif job.error is not None:
        raise job.error
    return job.report(started)


class _Run:
    """One run's coordinator: opens NVML, starts a _GpuCheck per GPU, closes NVML."""

    def __init__(self, uuids, config, purpose, policy, deadline, container_id, container_pid=0):
        self.uuids = uuids
        self.config = config
        self.purpose = purpose
        self.policy = policy
        self.deadline = deadline
        self.container_id = container_id
        # A starting container's own entry (a hook run twice) owns nothing yet: it is known by
        # its id AND init, never by the id alone (another runtime root may use the same id).
        self.starting = (container_id, container_pid) if container_id and policy.kill_only is None else None
        self.done = threading.Event()
        self.cancelled = threading.Event()
        self.error = None
        self.step = "nvml-init"
        self.started = time.monotonic()
        self.checks = []

    def main(self) -> None:
        try:
            self._check_all()
        except Exception as err:  # no NVML, no host pid namespace, or a bug: raised in the caller
            self.error = err
        finally:
            self.done.set()

    def session(self):
        """A new (unopened) NVML session of this run's library, holding the client lock."""
        return nvml.Session(nvml.library_path(self.config), client_lock=actions.client_lock(self.config))

    def _check_all(self) -> None:
        proc = "/proc"
        if not owners.in_host_pid_namespace(proc):
            raise HostError("gpuhook health checks must run in the host's PID namespace: NVML reports host pids",
                            "run the device plugin with hostPID: true")
        targets = self.uuids
        # Opened here so that NVML starts once (seconds without persistence mode), not once
        # per GPU thread whose session happens not to overlap another's; closed as soon as
        # each thread has its own session or waits for its GPU's lock (module docstring).
        self.step = "nvml-init"
        warm = self.session()
        warm.open()
        try:
            if any(u.startswith("MIG-") for u in targets):
                self.step = "resolve"
                targets = _parents(warm, targets)
            self.step = "registry"
            containers = registry.load_all(self.config.state_dir, proc)
            # A stopped container's entry (poststop) is exactly what makes its leftovers orphans.
            attributor = owners.Attributor(containers, proc, starting=self.starting)
            self.checks = [_GpuCheck(self, attributor, containers, uuid) for uuid in targets]
            threads = [threading.Thread(target=c.main, name=f"gpuhook-health-{c.uuid}", daemon=True)
                       for c in self.checks]
            for thread in threads:
                thread.start()
            for check in self.checks:
                check.settled.wait(max(self.deadline - time.monotonic(), 0))
        finally:
            warm.close()
        for thread in threads:
            thread.join()
        failed = [c.error for c in self.checks if c.error is not None]
        if failed:
            raise failed[0]

    def cancel(self) -> None:
        self.cancelled.set()

    def report(self, started: float) -> Report:
        now = time.monotonic()
        results, cut = [], []
        if not self.checks:  # cut off before the per-GPU work began
            cut = [CutOff(uuid, self.step, now - self.started) for uuid in self.uuids]
        for check in self.checks:
            if check.result is not None:
                results.append(check.result)
            else:
                step, _ = check.progress()
                cut.append(CutOff(check.uuid, step, now - check.started))
        for item in cut:
            results.append(_unchecked(item))
            _write_report(self.config, self.purpose, self.container_id, results[-1])
        return Report(self.purpose, tuple(results), now - started, tuple(cut), self.deadline - started)


def _parents(session, uuids) -> list:
    """GPU UUIDs with MIG UUIDs replaced by their parent GPU's."""
    parent_of = {}
    for gpu in session.inventory().gpus:
        for device in gpu.mig_devices:
            parent_of[device.uuid] = gpu.uuid
    found = []
    for uuid in uuids:
        if uuid.startswith("MIG-"):
            if uuid not in parent_of:
                raise HostError(f"NVML knows no MIG device {uuid}")
            uuid = parent_of[uuid]
        if uuid not in found:
            found.append(uuid)
    return found


class _GpuCheck:
    """The work on one GPU (see the module docstring); `result` is set when it finished."""

    def __init__(self, run: _Run, attributor, containers, uuid: str):
        self.run = run
        self.session = None
        self.attributor = attributor
        self.containers = containers
        self.uuid = uuid
        self.config = run.config
        self.policy = run.policy
        self.result = None
        self.error = None  # an exception the work raised (a bug, or a state dir gone bad)
        self.started = time.monotonic()
        self.steps = {}
        self.settled = threading.Event()  # has its own NVML session, waits for its lock, or ended
        self._step = "lock"
        self._since = self.started
        self._lock = threading.Lock()

    # -- bookkeeping ------------------------------------------------------------------------

    def enter(self, step: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.steps[self._step] = self.steps.get(self._step, 0.0) + (now - self._since)
            self._step, self._since = step, now

    def progress(self):
        with self._lock:
            return self._step, self._since

    def stopped(self) -> bool:
        return self.run.cancelled.is_set() or time.monotonic() >= self.run.deadline

    # -- the work ---------------------------------------------------------------------------

    def main(self) -> None:
        try:
            self._main()
        finally:
            self.settled.set()

    def _waiting(self) -> bool:
        """GpuLock's cancel test while the lock is busy: this thread holds no NVML meanwhile."""
        self.settled.set()
        return self.stopped()

    def _main(self) -> None:
        lock = store.GpuLock(self.config.state_dir, self.uuid)
        no_lock = ""
        try:
            if not lock.acquire(self.run.deadline, self._waiting):
                return  # cut off while waiting: the coordinator reports it
        except OSError as err:
            # An unwritable state dir must not stop healthy GPUs from starting; without the
            # lock, though, nothing is repaired (two resets could overlap).
            no_lock = f"not repaired: cannot lock the GPU ({lock.path}: {err.strerror})"
        try:
            self.enter("nvml-init")
            self.session = self.run.session()
            self.session.open()
            self.settled.set()
            try:
                result = self._work(no_lock)
            finally:
                self.session.close()
            if result is None or self.run.cancelled.is_set():
                return  # cut off: the coordinator reports it
            self.enter("report")
            _write_report(self.config, self.run.purpose, self.run.container_id, result._replace(steps=dict(self.steps)))
            self.enter("done")
            self.result = result._replace(steps=dict(self.steps))
        except Exception as err:  # raised again in the caller's thread, traceback and all
            self.error = err
        finally:
            lock.release()

    def _examine(self, step: str) -> "_Examined":
        self.enter(step)
        try:
            facts = self.session.health(self.uuid)
        except NvmlError as err:
            unreachable = checks.Finding(Check.REACHABLE, Remedy.NONE, err.one_line(), ())
            outcomes = {check: Outcome.NOT_RUN for check in Check}
            outcomes[Check.REACHABLE] = Outcome.FAILED
            return _Examined(None, (), (unreachable,), outcomes)
        self.enter("attribute")
        processes = self.attributor.attribute(facts.processes) if not facts.lost else ()
        problems, outcomes = checks.evaluate(facts, processes, checks.Thresholds.from_config(self.config))
        return _Examined(facts, processes, problems, outcomes)

    def _work(self, no_lock: str):
        """Examine, repair as the policy allows, examine again: the GpuResult, or None when
        the deadline stopped the work before an action."""
        blocked, done = {}, []
        if self.policy.repair and not no_lock:  # a check without repair changes nothing
            self.enter("persistence")
            restored = actions.restore_persistence(self.config, self.session, self.uuid)
            if restored is not None:
                done.append(restored)
        now = first = self._examine("query")
        if now.problems and not self.policy.repair:
            blocked = dict.fromkeys((Remedy.KILL, Remedy.RESET), "not repaired (check only)")
        elif no_lock and (now.problems or self.policy.reset == "release"):
            blocked = dict.fromkeys((Remedy.KILL, Remedy.RESET), no_lock)
        elif self.policy.repair:
            now = self._kill_orphans(now, blocked, done)
            if now is not None:
                now = self._reset(now, blocked, done)
            if now is None:
                return None
        fixed = tuple(f for f in first.problems
                      if not any(p.check is f.check and p.remedy is f.remedy for p in now.problems))
        outcomes = dict(now.outcomes)
        for finding in fixed:
            if outcomes.get(finding.check) is Outcome.OK:
                outcomes[finding.check] = Outcome.REPAIRED
        if now.problems:
            status = Status.UNHEALTHY
        else:
            status = Status.REPAIRED if first.problems else Status.HEALTHY
        reachable = now.facts is not None
        return GpuResult(self.uuid, status, outcomes, now.problems, fixed, blocked, tuple(done),
                         tuple(self._users(now.processes)) if reachable else (),
                         checks.facts_summary(now.facts, now.processes) if reachable else {},
                         {}, time.monotonic() - self.started)

    def _kill_orphans(self, now: "_Examined", blocked: dict, done: list):
        """Kill what a KILL remedy names (kill-orphans permitting) and examine again."""
        targets = self._kill_targets(now.problems)
        if not targets:
            return now
        if not self.policy.kill_orphans:
            blocked[Remedy.KILL] = "not killed: kill-orphans is off"
            return now
        if self.stopped():
            return None
        self.enter("kill")
        # Whose it is, is asked again after the process is pinned (actions.kill): its cgroups
        # may have changed since the check.
        kills = [actions.kill(pid, start_time, self.run.deadline,
                              belongs=lambda p, c=container: self.attributor.belongs(c, p))
                 for pid, start_time, container in targets]
        done += kills
        targets = [(pid, start_time) for pid, start_time, _ in targets]
        # What was killed, and the zombies whose parent that was, may still show as zombies
        # until their parent (or init) reaps them: the re-check must not count them as users.
        ended = {pair for pair, action in zip(targets, kills) if action.ok}
        for finding in now.problems:
            for process in finding.targets:
                reaper = process.reaper
                if reaper is not None and (reaper.pid, reaper.start_time) in ended:
                    self.attributor.killed(process.pid, process.start_time)
        for pid, start_time in ended:
            self.attributor.killed(pid, start_time)
        failed = [a for a in kills if not a.ok]
        if failed:
            blocked[Remedy.KILL] = "; ".join(f"pid {a.target}: {a.detail}" for a in failed)
        return self._examine("re-check")

    def _reset(self, now: "_Examined", blocked: dict, done: list):
        """Reset the GPU if the policy wants it and nobody uses the GPU; examine again."""
        if self.policy.reset == "needed":
            wanted = any(f.remedy is Remedy.RESET for f in now.problems)
        else:  # "release": whenever nobody uses it; "never"
            wanted = self.policy.reset == "release" and now.facts is not None and not now.facts.lost
        if not wanted:
            return now
        users = self._users(now.processes)
        if users:
            blocked[Remedy.RESET] = f"not reset: the GPU is in use by {', '.join(users)}"
            return now
        if self.stopped():
            return None
        self.enter("reset")
        timeout = min(self.config.health.reset_timeout_seconds, self.run.deadline - time.monotonic())
        outcome = actions.reset_gpu(self.config, self.session, self.uuid, self.run.deadline, timeout)
        done += outcome.actions
        if not any(a.action == "reset" for a in outcome.actions):
            blocked[Remedy.RESET] = outcome.refused  # refused before the command: nothing changed
            return now
        if self.stopped():
            return None
        now = self._examine("re-check")
        if outcome.refused:
            blocked[Remedy.RESET] = outcome.refused
        elif now.problems:
            reset = next(a for a in outcome.actions if a.action == "reset")
            blocked[Remedy.RESET] = f"still there after a reset ({reset.detail})"
        return now

    def _kill_targets(self, problems) -> list:
        """(pid, start time, registry entry) of each process a KILL remedy names, within the
        policy's scope."""
        targets = []
        for finding in problems:
            if finding.remedy is not Remedy.KILL:
                continue
            for process in finding.targets:
                container = process.container
                if container is None:
                    continue  # only a registered container's leftovers are ever killed
                if self.policy.kill_only is not None and container.key != self.policy.kill_only:
                    continue
                if process.reaper is not None:
                    target = (process.reaper.pid, process.reaper.start_time, container)
                else:
                    target = (process.pid, process.start_time, container)
                if target[:2] not in [t[:2] for t in targets]:
                    targets.append(target)
        return targets

    def _users(self, processes) -> list:
        """Who keeps this GPU from being reset, in words: live owners of its processes,
        processes that could not be removed, and other live registered containers holding it."""
        users, seen = [], set()
        for process in processes:
            if process.live:
                users.append(f"{process.detail} (pid {process.pid})")
                if process.container is not None:
                    seen.add(process.container.key)
            elif process.owner is owners.Owner.ORPHAN:
                users.append(f"orphan pid {process.pid}, still running")
            elif process.owner is owners.Owner.ZOMBIE:
                users.append(f"zombie pid {process.pid}, not reaped")
        for container in self.containers:
            # The containers this run is for are skipped by their whole identity: a live
            # container that only shares their id (another runtime root) still holds the GPU.
            if container.key in seen or container.key == self.policy.kill_only \
                    or (container.id, container.pid) == self.run.starting:
                continue
            if self.uuid in container.gpus and self.attributor.alive(container):
                users.append(f"container {container.label()} (init pid {container.pid})")
        return users


def _unchecked(cut: CutOff) -> GpuResult:
    outcomes = {check: Outcome.NOT_RUN for check in Check}
    return GpuResult(cut.uuid, Status.UNCHECKED, outcomes, (), (), {}, (), (), {}, {cut.step: cut.seconds},
                     cut.seconds)


def _write_report(config, purpose: str, container_id, result: GpuResult) -> None:
    """Replace the GPU's report; best effort (a report that cannot be written never changes
    the decision, and the decision is in the log)."""
    document = {"format": FORMAT, **result.as_dict(), "by": purpose, "container": container_id,
                "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "boot_id": store.boot_id(),
                "boottime": round(store.boottime(), 3)}
    if result.status is Status.UNCHECKED:
        step, seconds = next(iter(result.steps.items()))
        document["failure"] = f"cut off at step {step} ({STEPS.get(step, step)}) after {seconds:.2f} s"
    try:
        store.write_report(config.state_dir, document)
    except OSError:
        pass


# --- the ways in ------------------------------------------------------------------------------

def _deadline(config, deadline_seconds) -> float:
    seconds = config.health.deadline_seconds if deadline_seconds is None else deadline_seconds
    return time.monotonic() + seconds


def _log(config, stage: str, report: Report | None, **extra) -> None:
    log = {"stage": stage, **extra}
    if report is not None:
        log["health"] = report.as_dict()
    journal.write(config.log_file, log, config.log_target, config.syslog_socket)


def check(uuids, config, repair: bool = False, deadline_seconds: float | None = None) -> Report:
    """Run the checks on GPUs `uuids`; with `repair`, kill orphans and reset as `prepare` does
    (but leave no stamps). Unhealthy GPUs are in the report, not raised."""
    policy = Policy(repair, config.health.kill_orphans, None, "needed" if repair else "never")
    report = run(uuids, config, "check", policy, _deadline(config, deadline_seconds))
    _log(config, "check", report, repair=repair)
    return report


def prepare(uuids, config, deadline_seconds: float | None = None, allocation: str | None = None) -> Report:
    """The device plugin's hand-off (PreStartContainer): check and repair GPUs `uuids` exactly
    as the hook would. With `allocation` (the token the plugin's Allocate gave the
    container), leave a stamp for each GPU that is fine, so the start carrying that token
    (fallback mode) skips it; without, leave none: a stamp serves only the start it was made
    for (docs/health.md). Raises GpuUnhealthyError or HealthDeadlineError (with `.report`)
    when a GPU is not fine; the healthy ones are stamped all the same."""
    if allocation is not None:
        store.checked_token(allocation)
    policy = Policy(True, config.health.kill_orphans, None, "needed")
    report = run(uuids, config, "prepare", policy, _deadline(config, deadline_seconds))
    stamped = []
    for result in report.gpus:
        if result.ok and allocation is not None:
            try:
                store.write_stamp(config.state_dir, result.uuid, result.status.value, allocation,
                                  ttl=config.health.stamp_ttl_seconds)
                stamped.append(result.uuid)
            except OSError:
                pass
    _log(config, "prepare", report, stamped=stamped)
    error = report.error()
    if error is not None:
        raise error
    return report


def release(container: "registry.Container", config, deadline: float) -> Report:
    """After `container` stopped: kill what it left on its GPUs and, with reset-on-release,
    reset each GPU nobody else uses. Problems stay in the report; nothing is raised for them."""
    policy = Policy(True, config.health.kill_orphans, container.key,
                    "release" if config.health.reset_on_release else "never")
    return run(container.gpus, config, "poststop", policy, deadline, container.id)
