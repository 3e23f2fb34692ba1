"""The two things the health checks ever do to a host: kill an orphan, reset a GPU.

Killing: a process is killed only after it is pinned with pidfd_open(2), its start time
is read again and found unchanged (a pid reused since the check is never hit) and, where
the caller says whose it must be, it is found to be that container's again by kernel
identity (gpuhook.health.registry.belongs: cgroups may have changed since the check); the
signal goes through the pidfd (pidfd_send_signal). The wait for its exit is bounded.

Resetting: `reset-command` (default ``nvidia-smi --gpu-reset -i {uuid}``) is split like a
shell would (no shell runs it). A program name without a slash is looked up only in the
driver root's binary directories (gpuhook.driver.BINARY_DIRS), never in a PATH and never
in a container's image; it must be a regular executable file there. It runs through
gpuhook.kernel.child: explicit minimal environment, / as working directory, its own process
group, killed whole at its timeout.

Around the command (`reset_gpu`, docs/health.md "Resetting"), what NVIDIA's driver requires:

    refuse a GPU in MIG mode          a reset can destroy the GPU and compute instances that MIG
                                      UUIDs in specs and device-plugin ids name
    persistence mode off              it keeps the driver attached ("In use by another client");
                                      recorded first, so a later check restores it whatever
                                      happens in between
    every NVML session closed         this process's (gpuhook.discover.nvml.closed_for_reset), the
                                      health daemon's (gpuhook.health.daemon.nvml_closed) and
                                      other gpuhook processes' (nvml.exclusive)
    the command                       one GPU; a driver that resets it only with its NVLink
                                      peers refuses, and gpuhook says so instead of resetting
                                      GPUs other containers may hold
    persistence mode back on
"""

import os
import re
import select
import signal
import time

from gpuhook import driver
from gpuhook.apply import statefiles
from gpuhook.discover import nvml
from gpuhook.kernel import child
from gpuhook.errors import ConfigError, GpuhookError, HostError, NvmlError
from gpuhook.health import registry, store
from gpuhook.record import record

KILL_WAIT_SECONDS = 5.0  # a process in the driver's uninterruptible teardown can take a while
REAP_WAIT_SECONDS = 1.0  # its parent (a runtime's shim) reaps it right after
PLACEHOLDER = "{uuid}"


class Action(record("Action", "action target ok detail seconds")):
    """What was done: `action` is "kill", "reset" or "persistence", `target` a pid or UUID,
    `ok` whether it achieved its purpose, `detail` the outcome in words."""

    __slots__ = ()

    def as_dict(self) -> dict:
        return {"action": self.action, "target": self.target, "ok": self.ok, "detail": self.detail,
                "seconds": round(self.seconds, 4)}


def kill(pid: int, start_time: int, until: float, proc: str = "/proc", belongs=None) -> Action:
    """SIGKILL process `pid` if it is still the one that started at `start_time` and, with
    `belongs` (a callable taking the pid), still the container's; wait (until monotonic time
    `until`, at most KILL_WAIT_SECONDS) for it to exit and be reaped."""
    started = time.monotonic()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Action("kill", pid, True, "already gone", time.monotonic() - started)
    except OSError:
        pidfd = -1  # kernels before 5.3: signal by pid right after the start-time check
    try:
        stat = registry.read_stat(pid, proc)
        if stat is None:
            return Action("kill", pid, True, "already gone", time.monotonic() - started)
        if stat.start_time != start_time:
            return Action("kill", pid, True, "pid now belongs to another process: not killed",
                          time.monotonic() - started)
        if belongs is not None and not belongs(pid):
            return Action("kill", pid, False, "no longer in the container's cgroups and pid namespace: not killed",
                          time.monotonic() - started)
        try:
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return Action("kill", pid, True, "already gone", time.monotonic() - started)
        except OSError as err:
            return Action("kill", pid, False, f"SIGKILL failed: {err.strerror}", time.monotonic() - started)
        end = min(until, started + KILL_WAIT_SECONDS)
        if not _wait_exit(pid, pidfd, start_time, end, proc):
            return Action("kill", pid, False,
                          f"still running {time.monotonic() - started:.1f} s after SIGKILL", time.monotonic() - started)
        _wait_reaped(pid, start_time, min(until, time.monotonic() + REAP_WAIT_SECONDS), proc)
        return Action("kill", pid, True, "killed", time.monotonic() - started)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _same(pid: int, start_time: int, proc: str):
    stat = registry.read_stat(pid, proc)
    return stat if stat is not None and stat.start_time == start_time else None


def _wait_exit(pid: int, pidfd: int, start_time: int, end: float, proc: str) -> bool:
    """True once the process has exited (a pidfd turns readable then)."""
    while True:
        if pidfd >= 0:
            left = end - time.monotonic()
            ready, _, _ = select.select([pidfd], [], [], max(left, 0))
            if ready:
                return True
        else:
            stat = _same(pid, start_time, proc)
            if stat is None or stat.zombie:
                return True
            time.sleep(0.01)
        if time.monotonic() >= end:
            return False


def _wait_reaped(pid: int, start_time: int, end: float, proc: str) -> None:
    # NVML drops a process with its context; a driver that still lists the zombie until its
    # parent reaps it is given a moment.
    while time.monotonic() < end and _same(pid, start_time, proc) is not None:
        time.sleep(0.01)


def reset_argv(config, uuid: str) -> list:
    """The reset command for GPU `uuid` as an argv with an absolute program path."""
    import shlex

    template = config.health.reset_command
    try:
        words = shlex.split(template)
    except ValueError as err:
        raise ConfigError(f"health.reset-command {template!r}: {err}") from None
    if not words:
        raise ConfigError("health.reset-command is empty")
    argv = [word.replace(PLACEHOLDER, uuid) for word in words]
    argv[0] = find_program(words[0], config.driver_root)
    return argv


def find_program(program: str, driver_root: str) -> str:
    """Host path of the reset program (see the module docstring)."""
    if "/" in program:
        if not program.startswith("/"):
            raise ConfigError(f"health.reset-command: {program!r} must be a name or an absolute path")
        candidates = [program]
    else:
        from gpuhook.kernel.paths import resolve_host  # only when a reset is due

        candidates = []
        top = os.path.realpath(driver_root)
        for directory in driver.BINARY_DIRS:
            try:
                # Symlinks are followed inside the driver root only (a driver container's
                # absolute links point into its own tree).
                real = resolve_host(driver_root, f"{directory}/{program}")
            except (OSError, GpuhookError):
                continue
            if top == "/" or real.startswith(top + "/"):
                candidates.append(real)
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_mode & 0o170000) == 0o100000 and st.st_mode & 0o111:
            return path
    where = program if "/" in program else f"{program} in {', '.join(driver.BINARY_DIRS)} of driver root {driver_root}"
    raise HostError(f"reset command not found: no executable {where}", "set health.reset-command")


def reset(config, uuid: str, timeout: float) -> Action:
    """Run the reset command for GPU `uuid` with `timeout`; ok when it exits 0. The caller
    has made sure nothing keeps the GPU attached (`reset_gpu`)."""
    return _run_reset(config, uuid, timeout)[0]


def _run_reset(config, uuid: str, timeout: float) -> tuple:
    """(Action, the command's whole output)."""
    started = time.monotonic()
    try:
        argv = reset_argv(config, uuid)
    except (ConfigError, HostError) as err:
        return Action("reset", uuid, False, err.one_line(), time.monotonic() - started), ""
    result = child.run(argv, timeout=max(timeout, 0.01), env=dict(child.MINIMAL_ENV))
    name = os.path.basename(argv[0])
    if result.timed_out:
        detail = f"{name} did not finish within {timeout:.1f} s and was killed"
    elif result.status == 0:
        detail = f"{name} exited 0"
    else:
        tail = result.tail()
        detail = f"{name} exited {result.status}" + (f": {tail}" if tail else "")
    ok = result.status == 0 and not result.timed_out
    return Action("reset", uuid, ok, detail, time.monotonic() - started), result.output.decode("utf-8", "replace")


# --- a reset as the driver requires it ----------------------------------------------------------

class ResetOutcome(record("ResetOutcome", "actions refused")):
    """What `reset_gpu` did (`actions`, in order) and, when the GPU was not reset, why
    (`refused`, words for a report: "not reset: ..." or "reset failed: ...")."""

    __slots__ = ()


def client_lock(config) -> str:
    """The file every gpuhook NVML session holds shared and a reset exclusively
    (gpuhook.discover.nvml), made when missing. One that cannot be made is left to the
    session: checks run without it, a reset is refused (docs/health.md)."""
    path = f"{store.health_dir(config.state_dir)}/nvml.lock"
    try:
        os.close(statefiles.open_lock(path))
    except OSError:
        pass
    return path


def persistence_record(config, uuid: str) -> str:
    """Where a GPU whose persistence mode gpuhook turned off for a reset is noted until it is on again."""
    return f"{store.health_dir(config.state_dir)}/persistence/{store.checked_uuid(uuid)}.json"


# A PCI bus id as nvidia-smi prints it (00000000:18:00.0, 0000:18:00.0).
_BUS_ID = re.compile(r"\b[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\b")


def nvlink_peers(output: str) -> list | None:
    """The GPUs a failed reset's output says must be reset together with it (bus ids, maybe
    none named), or None when it does not speak of NVLink. nvidia-smi(1), -r: "Any GPUs with
    NVLink connections to a GPU being reset must also be reset in the same command ... [or]
    this command will issue an error identifying the additional GPUs"."""
    at = output.lower().find("nvlink")
    if at < 0:
        return None
    return list(dict.fromkeys(_BUS_ID.findall(output[at:])))


def reset_gpu(config, session, uuid: str, until: float, timeout: float) -> ResetOutcome:
    """Reset GPU `uuid` (nobody uses it: the caller checked) as NVIDIA's driver requires (the
    module docstring), through `session` (an open nvml.Session), before monotonic time `until`
    and within `timeout` for the command itself."""
    try:
        reset_argv(config, uuid)  # a command that cannot run changes nothing, persistence included
    except (ConfigError, HostError) as err:
        return ResetOutcome((Action("reset", uuid, False, err.one_line(), 0.0),), f"reset failed: {err.one_line()}")
    try:
        facts = session.reset_facts(uuid)
    except NvmlError as err:
        return ResetOutcome((), f"not reset: {err.one_line()}")
    if facts.mig_mode:
        # A reset may destroy every GPU and compute instance, and with them the MIG UUIDs that
        # specs and device-plugin ids name. Not proven on hardware either way: refuse.
        return ResetOutcome((), f"not reset: MIG mode is on ({facts.mig_devices} MIG device(s)); a reset may destroy "
                                "the GPU and compute instances that MIG UUIDs name, so gpuhook does not reset a GPU "
                                "in MIG mode")
    done = []
    if facts.persistence:
        turned_off = _persistence(config, session, uuid, False)
        done.append(turned_off)
        if not turned_off.ok:
            return ResetOutcome(tuple(done), f"not reset: persistence mode is on and {turned_off.detail}")
    try:
        action, output = _reset_closed(config, uuid, until, timeout)
        done.append(action)
    finally:
        if facts.persistence:
            done.append(_persistence(config, session, uuid, True))
    if action.ok:
        return ResetOutcome(tuple(done), None)
    peers = nvlink_peers(output)
    if peers is not None:
        named = f" ({', '.join(peers)})" if peers else ""
        return ResetOutcome(tuple(done), f"not reset: the driver resets this GPU only together with its NVLink "
                                         f"peers{named}, and gpuhook never resets other GPUs for one GPU's check")
    return ResetOutcome(tuple(done), f"reset failed: {action.detail}")


def _reset_closed(config, uuid: str, until: float, timeout: float) -> tuple:
    """Run the reset command with every gpuhook NVML session closed: (Action, output)."""
    from gpuhook.health import daemon

    started = time.monotonic()
    try:
        with nvml.closed_for_reset(until), daemon.nvml_closed(config, until), \
                nvml.exclusive(client_lock(config), until):
            return _run_reset(config, uuid, min(timeout, until - time.monotonic()))
    except nvml.NvmlBusy as err:
        return Action("reset", uuid, False, f"not run: NVML could not be closed for it: {err.detail}",
                      time.monotonic() - started), ""


def _persistence(config, session, uuid: str, enabled: bool) -> Action:
    """Turn persistence mode off (noted first in persistence_record) or back on (the note
    removed once it is)."""
    started = time.monotonic()
    path = persistence_record(config, uuid)
    if not enabled:
        try:
            store.write_json(path, {"format": 1, "uuid": uuid, "persistence": True, "pid": os.getpid(),
                                    "boot_id": store.boot_id()})
        except OSError as err:
            return Action("persistence", uuid, False, f"could not be noted for restoring ({err.strerror}): not turned "
                          "off", time.monotonic() - started)
    try:
        session.set_persistence(uuid, enabled)
    except NvmlError as err:
        if not enabled:
            _unlink(path)
        what = "turned back on" if enabled else "turned off"
        later = "; the next check of this GPU tries again" if enabled else ""
        return Action("persistence", uuid, False, f"could not be {what}: {err.one_line()}{later}",
                      time.monotonic() - started)
    if enabled:
        _unlink(path)
    return Action("persistence", uuid, True, "turned back on" if enabled else "turned off for the reset",
                  time.monotonic() - started)


def restore_persistence(config, session, uuid: str):
    """Turn persistence mode back on for a GPU a reset left it off on (a check or hook that
    died between turning it off and on again): an Action, or None when nothing was noted."""
    path = persistence_record(config, uuid)
    note = store.read_json(path)
    if not isinstance(note, dict):
        if os.path.lexists(path):
            _unlink(path)  # damaged: nothing to go by
        return None
    if note.get("boot_id") != store.boot_id():
        _unlink(path)  # persistence mode does not survive a reboot: the boot's own setting stands
        return None
    action = _persistence(config, session, uuid, True)
    return action._replace(detail=f"{action.detail} (left off by an interrupted reset)")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
