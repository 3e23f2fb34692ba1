"""The hook's GPU path: state -> spec -> request -> survey -> plan -> apply.

Reached only when gpuhook.prescan could not rule a GPU request out (or from the CLI for a
dry run). `plan_start` is everything up to the plan and changes nothing (a dry run is
exactly it); `prestart` then writes gpuhook's caches in one place and hands the plan to
gpuhook.apply.run, the only code that changes the system (health step included). The
boundary at the bottom turns every failure into one ``gpuhook: ...`` line on stderr and a
non-zero exit; the runtime then aborts the start and shows that line.
"""

import os
import sys
import time

from gpuhook import config as cfg
from gpuhook import journal, oci
from gpuhook import request as req
from gpuhook.errors import INTERNAL_ERROR, GpuhookError, InputError, from_os_error
from gpuhook.plan import empty_plan, make_plan


def plan_start(state, spec, config) -> tuple:
    """(Plan, survey.Host or None) for one container: resolve the request, survey the host
    once, plan. Changes nothing, not even gpuhook's caches."""
    request = req.resolve(spec, state.annotations, config)
    if request.empty:
        return empty_plan(state, spec, request), None
    from gpuhook import survey

    host = survey.survey(request, spec, config)
    return make_plan(state, spec, request, host, config), host


def read_container(state_bytes: bytes, spec_bytes: bytes | None = None, base_dir: str | None = None):
    state = oci.parse_state(state_bytes, base_dir)
    if spec_bytes is None:
        spec_bytes = oci.read_config_bytes(state.bundle)
    return state, oci.parse_spec(spec_bytes, state.bundle)


def prestart(state, spec, config, deadline: float, record: dict | None = None) -> tuple:
    """Plan, write the caches discovery refreshed, apply the whole plan (gpuhook.apply.run:
    health, devices, registration). `record` (the log record) receives the decisions."""
    if state.status and state.status not in oci.STARTING_STATUSES:
        raise InputError(f"state: status {state.status!r}: gpuhook configures containers while they are "
                         f"being created ({' or '.join(oci.STARTING_STATUSES)})")
    plan, host = plan_start(state, spec, config)
    if plan.empty:
        return plan, None
    from gpuhook import apply, leftovers, survey

    survey.write_caches(config, host)
    # What an earlier start on this rootfs could not take back is taken back first; while its
    # worker is still stuck in the kernel, the start is refused (gpuhook.leftovers).
    leftovers.reap(config.state_dir, {} if record is None else record, rootfs=plan.rootfs)
    names = journal.k8s_names({**spec.annotations, **state.annotations})
    return plan, apply.run(plan, state, config, deadline, names, {} if record is None else record)


def poststop(state_bytes: bytes, spec_bytes: bytes | None, config, deadline: float, record: dict,
             base_dir: str | None = None) -> None:
    """After a container stopped: clean up what it left on its GPUs (gpuhook.health). Only
    the state's id is needed; a bundle that is already gone costs the log its names only."""
    state = oci.parse_state(state_bytes, base_dir)
    record["container"] = state.id
    try:
        spec = oci.parse_spec(spec_bytes if spec_bytes is not None else oci.read_config_bytes(state.bundle),
                              state.bundle)
        record.update(journal.k8s_names({**spec.annotations, **state.annotations}))
    except GpuhookError:
        record.update(journal.k8s_names(state.annotations))
    from gpuhook import grants, leftovers

    leftovers.reap(config.state_dir, record, container_id=state.id)
    record["grants"] = grants.release(config.state_dir, state.id)
    if config.health.mode == "off":
        record["decision"] = "nothing to do at this stage (health mode off)"
        return
    from gpuhook.health import hooks as health

    health.after_stop(state, config, deadline, record)


def run_hook(stage: str, state_bytes: bytes, config_path: str | None = None,
             spec_bytes: bytes | None = None, base_dir: str | None = None) -> int:
    """Entry for the runtime. Returns the exit code; prints one line on failure. `base_dir`
    lets a state file given by hand name its bundle relatively."""
    started = time.monotonic()
    log_path, log_target, syslog_socket = cfg.default("log-file"), "file", "/dev/log"
    record = {"stage": stage}
    try:
        config = cfg.load(config_path, os.environ)
        log_path, log_target, syslog_socket = config.log_file, config.log_target, config.syslog_socket
        deadline = started + config.deadline_seconds
        if stage == "poststop":
            poststop(state_bytes, spec_bytes, config, deadline, record, base_dir)
            return 0
        state, spec = read_container(state_bytes, spec_bytes, base_dir)
        record.update(container=state.id, **journal.k8s_names({**spec.annotations, **state.annotations}))
        plan, outcome = prestart(state, spec, config, deadline, record)
        record.update(decision="untouched" if plan.empty else "gpus injected", wants=plan.wants,
                      channel=plan.channel, gpus=[g.uuid for g in plan.gpus],
                      capabilities=sorted(plan.capabilities), notes=list(plan.notes))
        if outcome is not None:
            record.update(cgroup=outcome.cgroup_mode, rules_added=[r.v1_line() for r in outcome.rules_added],
                          steps=outcome.steps, notes=list(plan.notes) + outcome.notes)
            if outcome.ldconfig_output:
                record["ldconfig_output"] = outcome.ldconfig_output
        return 0
    except (GpuhookError, OSError) as err:
        if isinstance(err, OSError):  # one a lower layer did not translate: a host problem (exit 4)
            err = from_os_error(err)
        record.update(decision="failed", error=err.one_line())
        if err.detail:
            record["detail"] = err.detail
        if stage == "poststop":  # a stop never fails (docs/health.md): the problem is logged only
            return 0
        print(f"gpuhook: {err.one_line()}", file=sys.stderr)
        return err.exit_code
    except Exception as err:  # a bug: still one line for the runtime, the detail to the log
        import traceback

        record.update(decision="internal error", error=repr(err), traceback=traceback.format_exc())
        if stage == "poststop":
            return 0
        from gpuhook.errors import printable

        print(printable(f"gpuhook: internal error: {type(err).__name__}: {err}".splitlines()[0])[:1000],
              file=sys.stderr)
        return INTERNAL_ERROR
    finally:
        nvml = sys.modules.get("gpuhook.nvml")
        loaded = nvml.INITIALISED[0] if nvml is not None else 0
        record["nvml"] = f"loaded ({loaded} init{'s' if loaded != 1 else ''})" if loaded else "not loaded"
        record["seconds"] = round(time.monotonic() - started, 4)
        journal.write(log_path, record, log_target, syslog_socket)
        workers = sys.modules.get("gpuhook.workerproc")
        if workers is not None:  # reap the committed worker, which exited meanwhile
            workers.discard()
