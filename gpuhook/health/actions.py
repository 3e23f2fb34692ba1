"""The two things the health checks ever do to a host: kill an orphan, reset a GPU.

Killing: a process is killed only after it is pinned with pidfd_open(2), its start time
is read again and found unchanged (a pid reused since the check is never hit) and, where
the caller says whose it must be, it is found to be that container's again by kernel
identity (gpuhook.health.registry.belongs: cgroups may have changed since the check); the
signal goes through the pidfd (pidfd_send_signal). The wait for its exit is bounded.

Resetting: `reset-command` (default ``nvidia-smi --gpu-reset -i {uuid}``) is split like a
shell would (no shell runs it). A program name without a slash is looked up only in the
driver root's binary directories (gpuhook.discover.BINARY_DIRS), never in a PATH and never
in a container's image; it must be a regular executable file there. It runs through
gpuhook.child: explicit minimal environment, / as working directory, its own process
group, killed whole at its timeout.
"""

import os
import select
import signal
import time

from gpuhook import child, discover
from gpuhook.errors import ConfigError, GpuhookError, HostError
from gpuhook.health import registry
from gpuhook.record import record

KILL_WAIT_SECONDS = 5.0  # a process in the driver's uninterruptible teardown can take a while
REAP_WAIT_SECONDS = 1.0  # its parent (a runtime's shim) reaps it right after
PLACEHOLDER = "{uuid}"


class Action(record("Action", "action target ok detail seconds")):
    """What was done: `action` is "kill" or "reset", `target` a pid or UUID, `ok` whether it
    achieved its purpose, `detail` the outcome in words."""

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
        from gpuhook.safepath import resolve_host  # only when a reset is due

        candidates = []
        top = os.path.realpath(driver_root)
        for directory in discover.BINARY_DIRS:
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
    where = program if "/" in program else f"{program} in {', '.join(discover.BINARY_DIRS)} of driver root {driver_root}"
    raise HostError(f"reset command not found: no executable {where}", "set health.reset-command")


def reset(config, uuid: str, timeout: float) -> Action:
    """Run the reset command for GPU `uuid` with `timeout`; ok when it exits 0."""
    started = time.monotonic()
    try:
        argv = reset_argv(config, uuid)
    except (ConfigError, HostError) as err:
        return Action("reset", uuid, False, err.one_line(), time.monotonic() - started)
    result = child.run(argv, timeout=max(timeout, 0.01), env=dict(child.MINIMAL_ENV))
    name = os.path.basename(argv[0])
    if result.timed_out:
        detail = f"{name} did not finish within {timeout:.1f} s and was killed"
    elif result.status == 0:
        detail = f"{name} exited 0"
    else:
        tail = result.tail()
        detail = f"{name} exited {result.status}" + (f": {tail}" if tail else "")
    return Action("reset", uuid, result.status == 0 and not result.timed_out, detail, time.monotonic() - started)
