"""Child processes the hook starts: explicit minimal environment, bounded time, no leftovers.

CVE-2025-23266 ran an image's LD_PRELOAD as host root through a hook that passed its
environment on; so nothing here inherits one. Every child gets `MINIMAL_ENV` (or an explicit
env), a working directory outside any rootfs, /dev/null on stdin, its own process group
(killed whole on timeout) and a parent-death signal, so nothing outlives the hook holding
the runtime's pipes (docs/runtime-facts.md §1: runc waits for those pipes).

Plain fork/exec over subprocess: this is on the container-start path and subprocess costs
an import of several milliseconds.
"""

import os
import select
import time

from gpuhook.kernel import linux
from gpuhook.kernel.linux import SIGKILL

MINIMAL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


KILL_GRACE = 0.3  # seconds a killed child gets to end before it counts as stuck in the kernel


class Result:
    def __init__(self, status: int | None, output: bytes, timed_out: bool, seconds: float, pid: int = 0,
                 stuck: bool = False):
        self.status = status  # exit code, or -signal; None if it had to be killed
        self.output = output  # stdout and stderr together, capped
        self.timed_out = timed_out
        self.seconds = seconds
        self.pid = pid
        self.stuck = stuck  # killed, it did not end: a call in the kernel holds it (not waited for)

    def tail(self, limit: int = 300) -> str:
        text = self.output.decode("utf-8", "replace").strip()
        return " ".join(text.splitlines()[-3:])[-limit:]


def kill_group(pid: int, grace: float = KILL_GRACE) -> bool:
    """SIGKILL the child `pid` and its process group, and reap it. A process stuck in the
    kernel (a filesystem that never answers) does not end on SIGKILL: it is waited for
    `grace` seconds at most, never without bound. Returns whether it was reaped."""
    for target in (lambda: os.killpg(pid, SIGKILL), lambda: os.kill(pid, SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    return reap(pid, grace)


def reap(pid: int, seconds: float) -> bool:
    """Reap the child `pid` if it ends within `seconds`: woken by its pidfd the moment it
    does (short polls on kernels before 5.3). Returns whether it was reaped."""
    end = time.monotonic() + seconds
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = -1
    try:
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return True
            except ChildProcessError:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            if pidfd >= 0:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(0.001, left))
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def run(argv: list[str], timeout: float, env: dict | None = None, executable=None,
        cwd: str = "/", pass_fds: tuple = (), output_cap: int = 64 << 10, before_exec=None,
        stdin: int | None = None) -> Result:
    """Run argv with a minimal environment; kill its whole process group after `timeout`.

    `executable` may be an open fd (fexecve): the binary is then the one that was checked,
    whatever happens to its path. `before_exec` runs in the child just before exec. `stdin`
    is an open fd to give it instead of /dev/null (where /dev/null cannot be opened).
    """
    start = time.monotonic()
    env = MINIMAL_ENV if env is None else env
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        try:
            os.setpgid(0, 0)
            linux.prctl_set_pdeathsig(SIGKILL)
            os.dup2(os.open("/dev/null", os.O_RDONLY) if stdin is None else stdin, 0)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            for fd in pass_fds:
                os.set_inheritable(fd, True)
            os.chdir(cwd)
            if before_exec is not None:
                before_exec()
            os.execve(executable if executable is not None else argv[0], argv, env)
        except BaseException as err:  # noqa: BLE001 - report anything, then die
            try:
                os.write(2, f"cannot run {argv[0]}: {err}\n".encode())
            finally:
                os._exit(127)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    return wait_for(pid, read_end, start + timeout, output_cap, start)


def wait_for(pid: int, read_end: int, end: float, output_cap: int = 64 << 10, start: float | None = None) -> Result:
    """Wait for the child `pid` (the leader of its own process group) until `end` (monotonic),
    taking its output from `read_end` (closed here) up to `output_cap`; at `end` kill its
    group (`kill_group`). Whatever it left in its group goes when it has exited."""
    start = time.monotonic() if start is None else start
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd = -1  # kernels before 5.3: poll in short slices instead
    chunks, size = [], 0
    status = None
    reading = True
    try:
        while status is None:
            left = end - time.monotonic()
            if left <= 0:
                break
            watch = ([read_end] if reading else []) + ([pidfd] if pidfd >= 0 else [])
            ready, _, _ = select.select(watch, [], [], left if pidfd >= 0 else min(left, 0.01))
            if reading and read_end in ready:
                data = os.read(read_end, 65536)
                if not data:
                    reading = False
                elif size < output_cap:
                    chunks.append(data[: output_cap - size])
                    size += len(chunks[-1])
            # Seen ended but not reaped (WNOWAIT): while it is a zombie its pid, which is its
            # group's id, cannot be given to another process, so the group is killed now,
            # then it is reaped (attacker pass 13: a kill after the reap could hit a new group).
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                try:  # the leader exited; anything it left in its group goes too
                    os.killpg(pid, SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status is not None and reading:
            # The leader has exited: take what is already in the pipe, never wait for
            # a descendant that still holds it.
            os.set_blocking(read_end, False)
            try:
                while size < output_cap and (data := os.read(read_end, 65536)):
                    chunks.append(data[: output_cap - size])
                    size += len(chunks[-1])
            except BlockingIOError:
                pass
    finally:
        os.close(read_end)
        if pidfd >= 0:
            os.close(pidfd)
    timed_out = status is None
    stuck = not kill_group(pid) if timed_out else False
    return Result(status, b"".join(chunks), timed_out, time.monotonic() - start, pid, stuck)
