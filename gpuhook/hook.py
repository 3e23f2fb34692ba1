"""The hook's GPU path: state -> spec -> request -> survey -> plan -> apply.

Reached only when gpuhook.prescan could not rule a GPU request out (or from the CLI for a
dry run). `plan_start` is everything up to the plan and changes nothing (a dry run is
exactly it); `prestart` then writes gpuhook's caches in one place and hands the plan to
gpuhook.apply.run.run, the only code that changes the system (health step included). The
boundary at the bottom turns every failure into one ``gpuhook: ...`` line on stderr and a
non-zero exit; the runtime then aborts the start and shows that line.

Every step is bounded by the deadline on its own (sizes, waits, children). `Backstop` makes
sure of it whatever happens: a thread that, should the hook still be running a half second
after its deadline, writes the one line (exit 7) and the log line itself and ends the
process, so a start never outlasts its deadline by more than a second (docs/security.md,
"A start that never ends").
"""

import _thread
import os
import sys
import time

from gpuhook import config as cfg
from gpuhook import journal, stoporder
from gpuhook.kernel import caller
from gpuhook.request import oci
from gpuhook.errors import INTERNAL_ERROR, DeadlineError, GpuhookError, InputError, from_os_error, printable

BACKSTOP_GRACE = 0.6  # seconds past the deadline at which the backstop ends the hook itself
FINAL_GRACE = 0.9  # ... and at which it ends it even when the main thread was writing its own line


class Backstop:
    """The hook's last line of defence against its own deadline: a thread (started with the
    built-in _thread, no threading import) that sleeps until `deadline` + BACKSTOP_GRACE.
    If the main thread has not ended the hook by then (`finish`), it stops the namespace
    worker (what that leaves is taken back or recorded: gpuhook.apply.leftovers), prints one
    ``gpuhook:`` line naming the phase, writes the log line and exits 7 (0 at poststop).
    A main thread stuck in a call that holds the GIL delays it, which is why every input is
    bounded in size first."""

    def __init__(self, stage: str, log: dict, deadline: float):
        self.stage = stage
        self.log = log
        self.deadline = deadline
        self.seconds = deadline - time.monotonic()
        self.phase = "reading the container's state and bundle"
        self.log_to = (cfg.default("log-file"), "file", "/dev/log")  # where the log line goes
        self.state_dir = None
        self.code = None
        self.returned = False  # run_hook has returned: nothing is left for the backstop to do
        self.lock = _thread.allocate_lock()  # whoever holds it ends the hook
        try:
            _thread.start_new_thread(self._watch, ())
        except RuntimeError:  # no thread now (EAGAIN): every step is still bounded on its own
            pass

    def configure(self, config, started: float) -> None:
        self.deadline = started + config.deadline_seconds
        self.seconds = config.deadline_seconds
        self.log_to = (config.log_file, config.log_target, config.syslog_socket)
        self.state_dir = config.state_dir

    def finish(self, code: int) -> None:
        """The main thread ends the hook with `code`. When the backstop got there first it
        is writing the line and exiting: wait for that."""
        self.code = code
        if not self.lock.acquire(blocking=False):
            while True:
                time.sleep(1)

    def _watch(self) -> None:
        reason = None
        while True:
            left = self.deadline + BACKSTOP_GRACE - time.monotonic()
            if left <= 0:
                break
            if self._front_ended(min(left, 0.5)):  # the deadline moves once the config is read
                reason = "the runtime ended the hook before it was done (its timeout): gpuhook stopped"
            if self.returned:
                return
            if reason:
                break
        code = 0 if self.stage == "poststop" else DeadlineError.exit_code
        if not self.lock.acquire(blocking=False):  # the main thread is writing its line
            time.sleep(max(0.0, self.deadline + FINAL_GRACE - time.monotonic()))
            if not self.returned:  # still writing it (a log on a stalled filesystem): end it now
                os._exit((code if self.code is None else self.code) & 0xFF)
            return
        try:
            log = dict(self.log)
            try:
                where = self._where()
            except Exception:  # noqa: BLE001 - the line comes first
                where = self.phase
            message = reason or f"hook deadline passed during {where} ({self.seconds:g} s): gpuhook stopped"
            try:
                note = self._stop_workers(log)
            except Exception as err:  # noqa: BLE001 - the line and the record come first
                note = f"stopping the namespace worker failed: {type(err).__name__}"
            if note:
                message += f" ({note})"
            log.update(decision="failed", error=message, backstop=True,
                          seconds=round(self.seconds + BACKSTOP_GRACE, 4))
            if self.stage != "poststop":
                try:
                    os.write(2, (printable(f"gpuhook: {message}")[:1000] + "\n").encode())
                except OSError:
                    pass  # nobody reads it any more: the log line still goes out
            journal.write(self.log_to[0], log, self.log_to[1], self.log_to[2])
        finally:
            os._exit(code)

    @staticmethod
    def _front_ended(seconds: float) -> bool:
        """Sleep `seconds`; True at once when the front the agent serves (caller.FRONT) has
        ended: the runtime killed its hook, past the hook's `timeout`. The hook then ends as at
        its deadline: its worker stopped, what it did taken back (gpuhook.apply.leftovers), one
        log line. The agent, even one that ended meanwhile, has no part in it (attacker pass
        12, A1 and A2)."""
        if caller.FRONT[0] < 0:
            time.sleep(seconds)
            return False
        import select

        try:
            return bool(select.select([caller.FRONT[0]], [], [], seconds)[0])
        except OSError:
            time.sleep(seconds)
            return False

    def _where(self) -> str:
        workers = sys.modules.get("gpuhook.apply.worker")
        for worker in workers.live if workers is not None else ():
            if worker.ordered and not worker.reaped and not worker.settled:
                return f"{self.phase} ({worker.step()})"
        return self.phase

    def _stop_workers(self, log: dict) -> str:
        """Kill a worker still at work; its leftovers are taken back or recorded. One the
        main thread is already settling (gpuhook.apply.run) is left to it, for a moment."""
        workers = sys.modules.get("gpuhook.apply.worker")
        notes = []
        for worker in list(workers.live) if workers is not None else ():
            while worker.settling and time.monotonic() < self.deadline + FINAL_GRACE:
                time.sleep(0.01)
            if worker.reaped or worker.stuck or worker.committed or worker.progress.closed:
                continue
            worker.close()
            if worker.unsettled and worker.context and self.state_dir:
                from gpuhook.apply import leftovers

                notes.append(leftovers.settle(worker, *worker.context, self.state_dir, log))
        return "; ".join(filter(None, notes))


def plan_start(state, spec, config) -> tuple:
    """(Plan, survey.Host or None) for one container: resolve the request, survey the host
    once, plan. Changes nothing, not even gpuhook's caches. (Imported here: a poststop plans
    nothing and does not load them.)"""
    from gpuhook.plan.make import empty_plan, make_plan
    from gpuhook.request import resolve as req

    request = req.resolve(spec, state.annotations, config)
    if request.empty:
        return empty_plan(state, spec, request), None
    from gpuhook.discover import survey

    host = survey.survey(request, spec, config)
    return make_plan(state, spec, request, host, config), host


def read_container(state_bytes: bytes, spec_bytes: bytes | None = None, base_dir: str | None = None):
    state = oci.parse_state(state_bytes, base_dir)
    if spec_bytes is None:
        spec_bytes = oci.read_config_bytes(state.bundle)
    return state, oci.parse_spec(spec_bytes, state.bundle)


def prestart(state, spec, config, deadline: float, log: dict | None = None, backstop=None,
             stage: str = "prestart") -> tuple:
    """Plan, write the caches discovery refreshed, apply the whole plan (gpuhook.apply.run.run:
    health, devices, registration). `log` (the log line) receives the decisions;
    `backstop` (Backstop) is told the phase."""
    if state.status and state.status not in oci.STARTING_STATUSES:
        raise InputError(f"state: status {state.status!r}: gpuhook configures containers while they are "
                         f"being created ({' or '.join(oci.STARTING_STATUSES)})")
    if backstop is not None:
        backstop.phase = "planning (the request, discovery, NVML, the image's requirements)"
    plan, host = plan_start(state, spec, config)
    if plan.empty:
        return plan, None
    from gpuhook.apply import leftovers, run as apply, statefiles

    statefiles.write_caches(config, host.cache)
    # What an earlier start on this rootfs could not take back is taken back first; while its
    # worker is still stuck in the kernel, the start is refused (gpuhook.apply.leftovers).
    leftovers.reap(config.state_dir, {} if log is None else log, rootfs=plan.rootfs)
    if backstop is not None:
        backstop.phase = "applying"
    names = _k8s_names(spec, state)
    return plan, apply.run(plan, state, config, deadline, names, {} if log is None else log, stage)


def _k8s_names(spec, state) -> dict:
    """The Kubernetes names of the container for the log and the registry; none from a podman
    spec, whose annotations the image may have written (oci.Spec.from_podman)."""
    if spec.from_podman:
        return {}
    return journal.k8s_names({**spec.annotations, **state.annotations})


def stop_names(state_bytes: bytes, spec_bytes: bytes | None, base_dir: str | None = None) -> dict | None:
    """The pod's names for a stop's log line: from the bundle's config.json, else from the
    state's annotations; None when the state itself does not parse. Never raises."""
    try:
        state = oci.parse_state(state_bytes, base_dir)
    except GpuhookError:
        return None
    try:
        spec = oci.parse_spec(spec_bytes if spec_bytes is not None else oci.read_config_bytes(state.bundle),
                              state.bundle)
        return _k8s_names(spec, state)
    except GpuhookError:
        return journal.k8s_names(state.annotations)


def poststop(state_bytes: bytes, spec_bytes: bytes | None, config, deadline: float, log: dict,
             base_dir: str | None = None, names: dict | None = None) -> None:
    """After a container stopped: clean up what it left on its GPUs (gpuhook.health). Only
    the state's id is needed; a bundle that is already gone costs the log its names only.
    `names`: the pod's names, found already (gpuhook.agent finds them before a stop waits
    for the ones before it: parsing a huge config.json must not hold other stops and
    starts)."""
    state = oci.parse_state(state_bytes, base_dir)
    log["container"] = state.id
    from gpuhook.apply import served

    # A second poststop entry of one start (gpuhook.apply.served) finds the first one's work done.
    stops = served.stop(config.state_dir, state.id, state.pid)
    if stops and all(doc.get("stopped") is True for _, doc in stops):
        log["decision"] = "nothing to do: another poststop hook of this container already cleaned up"
        return
    log.update(names if names is not None else stop_names(state_bytes, spec_bytes, base_dir) or {})
    from gpuhook.apply import grants, leftovers

    leftovers.reap(config.state_dir, log, container_id=state.id)
    log["grants"] = grants.release(config.state_dir, state.id)
    if config.health.mode == "off":
        log["decision"] = "nothing to do at this stage (health mode off)"
    else:
        from gpuhook.health import hooks as health

        health.after_stop(state, config, deadline, log)
    for path, doc in stops:
        served.mark_stopped(path, doc)


STOP_LOCK_FD = 3  # where the native front hands a stop its `stops.lock` (native/prescan.c)


def keep_stop_lock_to_self() -> None:
    """The stop lock the native front hands a stop it runs itself (fd 3, inheritable across its
    exec into Python) stays with this process: no program the stop runs (a reset, systemctl)
    inherits it. One that did, left stuck in the kernel on a wedged GPU, held the lock after the
    stop ended, and every later start waited 5 s (attacker pass 23). Whatever fd 3 is, this
    process keeps it."""
    try:
        os.set_inheritable(STOP_LOCK_FD, False)
    except OSError:  # no fd 3
        pass


def reap_after_answer(code: int, plan) -> bool:
    """Whether the committed worker of this start may be reaped after the front has its
    answer (gpuhook.agent: its child answers the front, then reaps; 0.3-0.4 ms off the start).
    Only for a start served by the agent that succeeded and built no ld cache: as it commits,
    a worker that installed one removes the image's set-aside cache from the rootfs, which
    must be done before the container starts. Run by the runtime itself, the hook's exit is
    its answer: it reaps first."""
    return bool(caller.CALLER[0]) and code == 0 and plan is not None and plan.ldcache is None


def run_hook(stage: str, state_bytes: bytes, config_path: str | None = None,
             spec_bytes: bytes | None = None, base_dir: str | None = None, names: dict | None = None) -> int:
    """Entry for the runtime. Returns the exit code; prints one line on failure. `base_dir`
    lets a state file given by hand name its bundle relatively; `names`, a stop's pod names
    found already (`stop_names`)."""
    started = caller.SINCE[0] or time.monotonic()  # served by the agent: since the request came
    log = {"stage": stage}
    if caller.CALLER[0]:  # a child of the agent (gpuhook.agent) serves the native front
        log["agent"] = True
    backstop = Backstop(stage, log, started + cfg.default("deadline-seconds"))
    line, code = None, 0
    plan = None
    try:
        config = cfg.load(config_path, os.environ)
        backstop.configure(config, started)
        deadline = started + config.deadline_seconds
        if stage == "poststop":
            backstop.phase = "cleaning up after the container"
            keep_stop_lock_to_self()
            poststop(state_bytes, spec_bytes, config, deadline, log, base_dir, names)
        else:
            # The stops before this start, at their work, are done first (the GPUs they clean
            # up are clean before this start checks them; gpuhook.stoporder). Under the
            # backstop: a runtime that gives up meanwhile ends this hook (`_front_ended`).
            backstop.phase = "waiting for the stops before it"
            stoporder.wait_for_stops(stoporder.environ_lock_path(), started + stoporder.STOP_WAIT)
            backstop.phase = "reading the container's state and bundle"
            state, spec = read_container(state_bytes, spec_bytes, base_dir)
            log.update(container=state.id, **_k8s_names(spec, state))
            docker_root = os.environ.get("GPUHOOK_DOCKER_DATA_ROOT")  # set by the Docker launcher only
            if docker_root:
                from gpuhook.request import dockerd

                spec = dockerd.daemon_request(spec, state.id, docker_root)
            from gpuhook.apply import served

            # The same start can run gpuhook twice (a base spec's prestart and a CDI spec's
            # createRuntime: gpuhook.apply.served); the first entry did the work.
            earlier = served.served_by(config.state_dir, state.id, state.pid)
            if earlier is not None:
                log["decision"] = f"untouched: gpuhook's {earlier} hook already served this start"
                return 0
            plan, outcome = prestart(state, spec, config, deadline, log, backstop, stage)
            if outcome is not None:
                if docker_root:  # dockerd registers no poststop: leave a waiter that runs it
                    start = served.start_of(state.pid) or 0
                    try:  # the start is committed: a waiter that cannot be left is only logged
                        from gpuhook.apply import dockerwait

                        dockerwait.watch_for_stop(state_bytes, state.pid, start, config_path)
                        log["poststop"] = "a waiter runs it when the container's init exits (Docker)"
                    except (OSError, TypeError) as err:
                        log["poststop"] = f"no waiter: {err}; nothing runs gpuhook's poststop for this container"
            log.update(decision="untouched" if plan.empty else "gpus injected", wants=plan.wants,
                          channel=plan.channel, gpus=[g.uuid for g in plan.gpus],
                          capabilities=sorted(plan.capabilities), notes=list(plan.notes))
            if outcome is not None:
                log.update(cgroup=outcome.cgroup_mode, rules_added=[r.v1_line() for r in outcome.rules_added],
                              steps=outcome.steps, notes=list(plan.notes) + outcome.notes)
                if outcome.ldconfig_output:
                    log["ldconfig_output"] = outcome.ldconfig_output
    except (GpuhookError, OSError) as err:
        if isinstance(err, OSError):  # one a lower layer did not translate: a host problem (exit 4)
            err = from_os_error(err)
        log.update(decision="failed", error=err.one_line())
        if err.detail:
            log["detail"] = err.detail
        if stage != "poststop":  # a stop never fails (docs/health.md): the problem is logged only
            line, code = f"gpuhook: {err.one_line()}", err.exit_code
    except Exception as err:  # a bug: still one line for the runtime, the detail to the log
        import traceback

        log.update(decision="internal error", error=repr(err), traceback=traceback.format_exc())
        if stage != "poststop":
            line = printable(f"gpuhook: internal error: {type(err).__name__}: {err}".splitlines()[0])[:1000]
            code = INTERNAL_ERROR
    finally:
        backstop.finish(code)
        if line is not None:
            print(line, file=sys.stderr)
        nvml = sys.modules.get("gpuhook.discover.nvml")
        loaded = nvml.INITIALISED[0] if nvml is not None else 0
        log["nvml"] = f"loaded ({loaded} init{'s' if loaded != 1 else ''})" if loaded else "not loaded"
        log["seconds"] = round(time.monotonic() - started, 4)
        journal.write(backstop.log_to[0], log, backstop.log_to[1], backstop.log_to[2])
        workers = sys.modules.get("gpuhook.apply.worker")
        if workers is not None and not reap_after_answer(code, plan):  # the committed worker exited meanwhile
            workers.discard()
        backstop.returned = True
    return code
