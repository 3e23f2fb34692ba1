"""The namespace worker's process, seen from the hook: fork it early, hand it the work, commit.

gpuhook.apply.nsworker does the container-side work in a child process (it must join the
container's mount namespace, which a process can do only for itself). That child is forked
here, and as early as the hook knows it may need one: gpuhook.entry starts it right after
the prescan could not rule out a GPU request, so the child loads its modules (ctypes among
them, about 4 ms) on the second core while this process loads and runs the planning. The
child then waits for its work order on a pipe; a start that ends up needing no worker kills
it unused (`discard`). Forking before anything else also means the worker is never forked
from a process whose health-check threads may be stuck in a driver call.

The exchange, over two pipes (docs/architecture.md, "The namespace worker"):

1. parent -> child: the work order, length-prefixed (gpuhook.apply.order.encode_order: plain
   data only, the plan's records as tuples, packed with marshal, which is built in).
2. child -> parent: one JSON line, the report: ``{"ok": true, ...}`` once every step is
   done, or ``{"ok": false, "step", "error", "cleanup"}`` after undoing them. Meanwhile the
   child names the step it is on in a shared page (`progress`), so a deadline names it.
3. parent -> child, after an ok report: one byte, COMMIT (keep everything, exit) or ABORT
   (undo everything, answer ``{"undone": [problems]}``, exit). The parent grants the cgroup
   rules and runs the health step while the child works (gpuhook.apply.run) and aborts when
   either fails, so either the whole start happens or none of it does.

Besides the step, the shared memory holds the child's journal (`Journal`): every file,
directory, link and mount it made, as it makes it, and which of them it has undone. A child
that is killed before it undid its work (the deadline), or that is stuck in the kernel where
no signal reaches it (a filesystem that stopped answering), leaves exactly what its journal
says; gpuhook.apply.leftovers takes that back or records it for later. No wait on the child is
unbounded: a child that does not end within REAP_GRACE of its SIGKILL is left to the kernel
(it ends when the call it is stuck in returns) and reported.

Little beyond os here (mmap, select and time when used): this module is on the GPU path of
every start, ahead of the planning.
"""

import os

from gpuhook import fastjson
from gpuhook.apply.order import ABORT, COMMIT, JOURNAL_BYTES, PROGRESS_BYTES, REPORT_LIMIT, Journal, write_all
from gpuhook.errors import ApplyError, DeadlineError

REAP_GRACE = 0.2  # seconds a killed worker gets to be gone before it counts as stuck
SIGKILL = 9  # as signal.SIGKILL, without importing signal (and enum) on the hook's path

_early = None  # the worker gpuhook.entry forked ahead of the planning, until taken
_exiting: list = []  # committed workers on their way out, reaped by `discard`
live: list = []  # every worker this process forked (a hook forks one or two): gpuhook.hook.Backstop stops them


class Worker:
    """The parent's handle on one forked worker. Whatever happens, `close` ends it (or,
    when the kernel holds it, gives up on it after REAP_GRACE: `stuck`)."""

    def __init__(self, pid: int, order_w: int, result_r: int, progress):
        self.pid = pid
        self.order_w = order_w
        self.result_r = result_r
        self.progress = progress
        self.buffer = b""
        self.reaped = False
        self.committed = False
        self.ordered = False  # it got an order: from then on it may change the container
        self.settled = False  # it said it undid everything, or it was told to keep it
        self.unsettled = False  # it was killed while it may still have had changes made
        self.stuck = False  # it did not end after SIGKILL: a call in the kernel holds it
        self.left: list = []  # what it reported leaving stuck itself (an ldconfig sandbox)
        self.context = None  # (rootfs, container id) of its order, for gpuhook.apply.leftovers
        self.settling = False  # the hook is taking back (or recording) what it left

    def send_order(self, order: bytes) -> None:
        try:
            write_all(self.order_w, len(order).to_bytes(8, "little") + order)
        except BrokenPipeError:
            self._reap()
            raise ApplyError("start the namespace worker", "the namespace worker died") from None
        self.ordered = True

    def report(self, deadline: float) -> dict:
        """The worker's report once it is done. Raises ApplyError, or DeadlineError (after
        killing it), when it failed (it has undone its steps then), died or ran out of time."""
        message = self._message(deadline)
        if not message.get("ok"):
            problems = message.get("cleanup") or []
            err = ApplyError(message.get("step", self.step()), message.get("error", "failed"),
                             ("cleanup: " + "; ".join(problems)) if problems else None)
            err.detail = message.get("ldconfig_output") or None
            raise err
        return message

    def commit(self) -> None:
        """Keep what the worker did (after an ok report); it closes its files and exits by
        itself (`close` then only reaps it: killed, it could leave the set-aside copy of the
        image's ld.so.cache behind)."""
        self.committed = self.settled = True
        try:
            os.write(self.order_w, COMMIT)
        except BrokenPipeError:
            pass  # it is gone already: all it did stays, which is what commit means

    def abort(self, deadline: float) -> list:
        """Have the worker undo everything, whether it is still working or done: returns
        the problems it met undoing (it never raises: it runs while an error unwinds)."""
        try:
            message = self._message(deadline)
            if not message.get("ok"):  # it failed by itself, and has undone its steps
                return list(message.get("cleanup") or [])
            os.write(self.order_w, ABORT)
            return list(self._message(deadline).get("undone", []))
        except (OSError, ApplyError, DeadlineError) as err:
            return [f"namespace worker: {err}"]
        finally:
            self.close(kill=False)

    def step(self) -> str:
        """The step the worker said it was on last."""
        size = int.from_bytes(self.progress[0:2], "little")
        return self.progress[2:2 + size].decode("utf-8", "replace") or "starting"

    def journal(self) -> tuple:
        """What it made and did not undo, as Journal.entries says (read it once the worker
        is gone or stuck)."""
        return Journal(self.progress).entries()

    def close(self, kill: bool = True) -> None:
        """Release the pipes and reap the worker; `kill` it first unless it is known to be
        on its way out (an unused worker would wait for an order until the hook exits). The
        shared memory stays readable until `release`."""
        for fd in (self.order_w, self.result_r):
            if fd >= 0:
                os.close(fd)
        self.order_w = self.result_r = -1
        self._reap(kill and not self.committed)

    def release(self) -> None:
        if not self.progress.closed:
            self.progress.close()

    def _message(self, deadline: float) -> dict:
        """The worker's next JSON line; kills it and raises when it ends without one."""
        import select
        import time

        while b"\n" not in self.buffer:
            # Past the deadline, still take what is already there (a report that came while
            # the health step used up the time), just do not wait for more.
            ready = select.select([self.result_r], [], [], max(0.0, deadline - time.monotonic()))[0]
            data = os.read(self.result_r, 65536) if ready else b""
            if not data or len(self.buffer) > REPORT_LIMIT:
                step = self.step()
                self._reap(kill=True)
                if time.monotonic() >= deadline:
                    raise DeadlineError(f"hook deadline passed during {step}")
                raise ApplyError(step, "the namespace worker died")
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            message = fastjson.loads(line)
        except ValueError:
            step = self.step()
            self._reap(kill=True)
            raise ApplyError(step, "the namespace worker sent an unreadable report") from None
        if not isinstance(message, dict):
            step = self.step()
            self._reap(kill=True)
            raise ApplyError(step, "the namespace worker sent an unreadable report")
        if message.get("ok") is False or "undone" in message:
            self.settled = True  # it has undone its work (what it could not is in the message)
        self.left += [str(x) for x in message.get("left") or ()]
        return message

    def _reap(self, kill: bool = False) -> None:
        """Wait for the worker to end, REAP_GRACE at most after a SIGKILL (`kill`, or when it
        does not end by itself within that time): a process stuck in the kernel cannot be
        waited for without bound. One that does not end is `stuck`."""
        if self.reaped or self.stuck:
            return
        if kill:
            self._kill()
        if not self._wait(REAP_GRACE):
            if not kill:
                self._kill()
                if self._wait(REAP_GRACE):
                    return
            self.stuck = True

    def _kill(self) -> None:
        if self.ordered and not self.settled:
            self.unsettled = True  # killed before it undid its work, or while it did
        try:
            os.kill(self.pid, SIGKILL)
        except ProcessLookupError:
            pass

    def _wait(self, seconds: float) -> bool:
        """Reap the worker if it ends within `seconds`; woken by its pidfd the moment it
        does (short polls on kernels before 5.3)."""
        import select
        import time

        end = time.monotonic() + seconds
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:
            pidfd = -1
        try:
            while True:
                try:
                    done, _ = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    done = self.pid
                if done:
                    self.reaped = True
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                if pidfd >= 0:
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(min(0.005, left))
        finally:
            if pidfd >= 0:
                os.close(pidfd)


def start(close=()) -> Worker:
    """Fork a worker that loads gpuhook.apply.nsworker and waits for its order; `close`: fds
    of this process the worker must not hold (gpuhook.agent's spare: its channel)."""
    import mmap

    progress = mmap.mmap(-1, PROGRESS_BYTES + JOURNAL_BYTES)
    order_r, order_w = os.pipe()
    result_r, result_w = os.pipe()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        for fd in (order_r, order_w, result_r, result_w):
            os.close(fd)
        progress.close()
        raise
    if pid == 0:
        code = 1
        try:
            os.close(order_w)
            os.close(result_r)
            for fd in close:
                os.close(fd)
            devnull = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):  # never hold the runtime's pipes, from the first moment
                os.dup2(devnull, fd)
            os.close(devnull)
            from gpuhook.apply import nsworker

            code = nsworker.serve(order_r, result_w, progress, parent)
        finally:
            os._exit(code)
    os.close(order_r)
    os.close(result_w)
    worker = Worker(pid, order_w, result_r, progress)
    live.append(worker)
    return worker


def start_early(close=()) -> None:
    """Fork the worker now, ahead of the planning (gpuhook.entry, for a hook stage that may
    configure GPUs; gpuhook.agent's spares, ahead of the request); `take` hands it out,
    `discard` ends it if nobody did."""
    global _early
    if _early is None:
        _early = start(close)


def early_fds() -> tuple:
    """The fds this process holds of the worker forked early (to keep when closing others)."""
    return () if _early is None else (_early.order_w, _early.result_r)


def take() -> Worker:
    """The worker forked early, or a new one (the CLI, tests)."""
    global _early
    worker, _early = _early, None
    return worker if worker is not None else start()


def reap_later(worker: Worker) -> None:
    """Leave a committed worker to finish its exit while the hook writes its log line;
    `discard` reaps it."""
    _exiting.append(worker)


def discard() -> None:
    """End a worker forked early that the start did not need, and reap committed ones."""
    global _early
    worker, _early = _early, None
    if worker is not None:
        worker.close()
        worker.release()
    while _exiting:
        done = _exiting.pop()
        done.close()
        done.release()
