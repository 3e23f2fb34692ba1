"""The namespace worker's process, seen from the hook: fork it early, hand it the work, commit.

gpuhook.nsworker does the container-side work in a child process (it must join the
container's mount namespace, which a process can do only for itself). That child is forked
here, and as early as the hook knows it may need one: gpuhook.entry starts it right after
the prescan could not rule out a GPU request, so the child loads its modules (ctypes among
them, about 4 ms) on the second core while this process loads and runs the planning. The
child then waits for its work order on a pipe; a start that ends up needing no worker kills
it unused (`discard`). Forking before anything else also means the worker is never forked
from a process whose health-check threads may be stuck in a driver call.

The exchange, over two pipes (docs/architecture.md, "The namespace worker"):

1. parent -> child: the work order, length-prefixed (gpuhook.actions.encode_order: plain
   data only, the plan's records as tuples, packed with marshal, which is built in).
2. child -> parent: one JSON line, the report: ``{"ok": true, ...}`` once every step is
   done, or ``{"ok": false, "step", "error", "cleanup"}`` after undoing them. Meanwhile the
   child names the step it is on in a shared page (`progress`), so a deadline names it.
3. parent -> child, after an ok report: one byte, COMMIT (keep everything, exit) or ABORT
   (undo everything, answer ``{"undone": [problems]}``, exit). The parent grants the cgroup
   rules and runs the health step while the child works (gpuhook.apply) and aborts when
   either fails, so either the whole start happens or none of it does.

Little beyond os here (mmap, select and time when used): this module is on the GPU path of
every start, ahead of the planning.
"""

import os

from gpuhook import fastjson
from gpuhook.errors import ApplyError, DeadlineError

PROGRESS_BYTES = 4096  # the shared page the worker names its current step in
ORDER_LIMIT = 16 << 20  # an order is a few KiB; a bigger length prefix is a bug
REPORT_LIMIT = 16 << 20
COMMIT = b"c"
ABORT = b"a"
SIGKILL = 9  # as signal.SIGKILL, without importing signal (and enum) on the hook's path

_early = None  # the worker gpuhook.entry forked ahead of the planning, until taken
_exiting: list = []  # committed workers on their way out, reaped by `discard`


class Worker:
    """The parent's handle on one forked worker. Whatever happens, `close` ends it."""

    def __init__(self, pid: int, order_w: int, result_r: int, progress):
        self.pid = pid
        self.order_w = order_w
        self.result_r = result_r
        self.progress = progress
        self.buffer = b""
        self.reaped = False
        self.committed = False

    def send_order(self, order: bytes) -> None:
        try:
            write_all(self.order_w, len(order).to_bytes(8, "little") + order)
        except BrokenPipeError:
            self._reap()
            raise ApplyError("start the namespace worker", "the namespace worker died") from None

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
        self.committed = True
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

    def close(self, kill: bool = True) -> None:
        """Release the pipes and reap the worker; `kill` it first unless it is known to be
        on its way out (an unused worker would wait for an order until the hook exits)."""
        for fd in (self.order_w, self.result_r):
            if fd >= 0:
                os.close(fd)
        self.order_w = self.result_r = -1
        self._reap(kill and not self.committed)
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
            return fastjson.loads(line)
        except ValueError:
            step = self.step()
            self._reap(kill=True)
            raise ApplyError(step, "the namespace worker sent an unreadable report") from None

    def _reap(self, kill: bool = False) -> None:
        if self.reaped:
            return
        if kill:
            try:
                os.kill(self.pid, SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(self.pid, 0)
        self.reaped = True


def start() -> Worker:
    """Fork a worker that loads gpuhook.nsworker and waits for its order."""
    import mmap

    progress = mmap.mmap(-1, PROGRESS_BYTES)
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
            devnull = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):  # never hold the runtime's pipes, from the first moment
                os.dup2(devnull, fd)
            os.close(devnull)
            from gpuhook import nsworker

            code = nsworker.serve(order_r, result_w, progress, parent)
        finally:
            os._exit(code)
    os.close(order_r)
    os.close(result_w)
    return Worker(pid, order_w, result_r, progress)


def start_early() -> None:
    """Fork the worker now, ahead of the planning (gpuhook.entry, for a hook stage that may
    configure GPUs); `take` hands it out, `discard` ends it if nobody did."""
    global _early
    if _early is None:
        _early = start()


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
    while _exiting:
        _exiting.pop().close()


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (a pipe may take it in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
