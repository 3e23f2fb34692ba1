"""Docker's missing poststop: a waiter that runs gpuhook's poststop when the container ends.

dockerd registers only a prestart hook (docs/docker.md), so after a start under Docker the
hook leaves a small waiter: a bare interpreter running this file as a script (no imports
beyond os and select) that waits on a pidfd of the container's init, checked by its start
time, and then execs gpuhook's poststop with the state, as a runtime would. Where the
request under Docker comes from is gpuhook.request.dockerd.
"""

import os


def watch_for_stop(state_bytes: bytes, pid: int, start_time: int, config_path: str | None) -> None:
    """Leave a waiter that runs gpuhook's poststop with `state_bytes` once the init `pid`
    (started at `start_time`) has exited. Detached: its own session, no fd of the runtime's
    (runc waits for the hook's pipes), the state in an unlinked file as its stdin."""
    import subprocess
    import sys
    import tempfile

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gpuhook/
    poststop = [sys.executable, "-I", "-S", os.path.join(package, "launch.py"), "poststop"]
    if config_path:
        poststop += ["--config", os.path.abspath(config_path)]
    with tempfile.TemporaryFile(dir="/tmp") as state:
        state.write(state_bytes)
        state.seek(0)
        subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(pid), str(start_time),
                          *poststop], stdin=state, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         close_fds=True, start_new_session=True, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def _start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rpartition(b")")[2].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _wait_then_exec(argv: list) -> None:
    """The waiter (this file run as a script): PID START POSTSTOP-ARGV..."""
    import select

    pid, start, command = int(argv[0]), int(argv[1]), argv[2:]
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = None  # already gone
    # A pidfd names the process that had the pid when it was opened: it is the init only if
    # the start time still matches (checked after opening, so no reuse can come between).
    if fd is not None and _start_time(pid) == start:
        select.select([fd], [], [])
    os.execv(command[0], command)


if __name__ == "__main__":
    import sys

    _wait_then_exec(sys.argv[1:])
