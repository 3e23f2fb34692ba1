"""The agent: gpuhook's hook, pre-imported, for a native front that would otherwise start Python.

A GPU start through the Python hook pays for an interpreter and about 13 ms of imports before
it plans anything. The agent (`gpuhook agent`, packaging/systemd/gpuhook-agent.service) is a
single-threaded process that has imported the hook once and listens on a root-only socket.
The native front (native/) connects when it cannot rule a GPU request out, hands over the
state (a memfd) and its own stdout and stderr, and waits. The agent forks one child per
request; the child runs exactly the hook the front would have exec'd (gpuhook.entry), writing
its one error line to the front's stderr, and the agent answers with the child's exit status.
The protocol, and why each check is there: docs/agent.md.

What the front's process was, the child is made to be where it matters: the front's
environment (only the variables the front keeps), its umask, and `gpuhook.kernel.caller`
names the front, so "is this the runtime's own cgroup?" is asked of the runtime's process.
The agent serves only a root peer in its own mount, PID, user and cgroup namespaces (a stop's,
by the namespace fds it sends: its front has exited by then; paths,
pids and cgroups then mean the same to both); anything else gets `run`: the front runs the
Python hook itself. So does every request when the agent is not running: the hook stays
correct without it.

Every request goes to a spare: a child forked ahead of time that waits on a socket pair for
one request (`Spare`), so no request waits for a fork. A stop (the front sends it with the
state, its namespaces and the runtime's pidfd, and does not wait) is answered as soon as its spare holds it, and carried out afterwards, one at a
time, in the order they came: runc's delete waits neither for a fork nor for gpuhook's
cleanup, and a stop the agent answered is lost with nothing but its own process. A start
waits (up to STOP_WAIT) until every stop that came before it is done, so the GPUs a stop
cleans up are clean before the next start checks them, as when the runtime ran each stop to
its end; for a stop still reading its own bundle, only STOP_READ_WAIT.
"""

import array
import collections
import errno
import os
import select
import selectors
import signal
import socket
import stat
import struct
import sys
import time

from gpuhook import entry, prescan, stoporder
from gpuhook.errors import INTERNAL_ERROR, InputError
from gpuhook.kernel import files

PROTOCOL = b"gpuhook-agent/5"
DEFAULT_SOCKET = stoporder.DEFAULT_SOCKET
SOCKET_VARIABLE = stoporder.SOCKET_VARIABLE
MAX_REQUEST = 65536  # bytes of one request datagram (the front's args and environment)
FDS = 3  # a start: the state's memfd, the front's stdout, its stderr
STOP_FDS = 6  # a stop: the state's memfd, the front's mount, PID, user and cgroup namespaces
# (compared with the agent's: the front has exited by the time the agent reads a stop), a pidfd
# of the runtime (the stop's work waits for it to end, RUNTIME_WAIT). Not the front's stdout and
# stderr: nobody reads a stop's output, and the runtime waits for them to close.
STOP_UMASK = 0o022  # a stop's umask (its front is gone; gpuhook's own files get explicit modes)
RUNTIME_WAIT = 0.1  # seconds the agent holds a stop for the runtime that ran its hook to end
STOP_TAKE_DELAY = 0.01  # seconds between a stop's arrival on the stop socket and its reading
# here (unless a start comes first): the runtime that ran its hook is finishing its delete, and
# this loop's work would take the CPU from it
MAX_SOCKET_PATH = 107  # bytes: sun_path holds 108, its NUL included
MAX_CHILDREN = 64  # requests at work at once; beyond, the front runs the hook itself
ACCEPT_BATCH = 32  # connections taken from the socket for starts per turn of the loop
STOP_BATCH = 256  # connections taken from the stop socket at once
ACCEPT_PAUSE = 0.05  # seconds a socket is not watched once the agent is out of fds
UNREAD_MAX = 32  # connections of one socket accepted and not heard from yet; beyond, it waits
UNREAD_EVICT = 0.25  # seconds: past UNREAD_MAX, the oldest silent one is dropped for the next
READ_TIMEOUT = 2.0  # seconds a connection may take to send its request
FINISH_ACCEPT_WAIT = READ_TIMEOUT + 1.0  # seconds an agent that is stopped retries accepting what
# is queued while it is out of fds (by then the connections that sent nothing are dropped)
STOP_WAIT = stoporder.STOP_WAIT  # seconds a start waits for the stops that came before it
STOP_READ_WAIT = 0.25  # of which, for a stop still reading its own bundle
STOP_LOCK_WAIT = 10.0  # seconds a stop waits for the one before it to end
STOP_NICE = 10  # a stop's work yields the CPU to starts and the runtimes: nothing waits on it but a later start
SPARE_DELAY = 0.002  # seconds of nothing to do before the agent forks the next spare
NAMESPACES = ("mnt", "pid", "user", "cgroup")  # the peer must share these with the agent
# The variables the front passes on (native/: the ones it gives the Python hook).
KEPT_VARIABLES = ("PATH", "GPUHOOK_CONFIG", prescan.FRONT_VARIABLE, SOCKET_VARIABLE)


def preload() -> list:
    """Import what a GPU start and a stop use, once, before any child is forked. Nothing
    here starts a thread or opens NVML (a fork copies only the thread that calls it)."""
    import importlib
    import pkgutil

    import gpuhook

    names = ["gpuhook.hook", "gpuhook.journal", "gpuhook.config", "gpuhook.driver", "gpuhook.schema"]
    for package in ("request", "discover", "plan", "apply", "kernel", "devrules", "health"):
        module = importlib.import_module(f"gpuhook.{package}")
        names += [f"gpuhook.{package}.{info.name}" for info in pkgutil.walk_packages(module.__path__)]
        names.append(f"gpuhook.{package}")
    skipped = []
    for name in names:
        if name == "gpuhook.health.daemon":  # the health daemon's server: no hook imports it
            continue
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency (the hook imports it lazily, if ever)
            skipped.append(name)
    del gpuhook
    return skipped


class Job:
    """One request: a start (the front waits for its exit status) or a stop (answered once a
    spare holds it)."""

    def __init__(self, seq: int, conn, stage: str, config_path, env: dict, fds: list, peer: int, umask: int):
        self.seq = seq
        self.conn = conn
        self.stage = stage
        self.config_path = config_path
        self.env = env
        self.fds = fds  # [memfd, out, err] (a stop: [memfd]) until handed to a spare
        self.runtime = -1  # a stop: a pidfd of the runtime that ran its hook, until it has ended
        self.peer = peer
        self.umask = umask
        self.state = None
        self.spec = None
        self.queued_at = time.monotonic()
        self.pid = 0
        self.pidfd = -1
        self.ready = -1  # a stop: the agent's end of its spare's channel, which the child closes once it read the bundle
        self.lock = None  # a stop: the lock file that serialises the stops' work
        self.front = -1  # a start: a pidfd of its front, watched until it is answered
        self.request = b""  # the request as the front sent it, for the spare

    @property
    def stop(self) -> bool:
        return self.stage == "poststop"


def _reply(conn, text: bytes) -> None:
    try:
        conn.send(text)
    except OSError:
        pass


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def own_namespaces() -> tuple:
    found = []
    for kind in NAMESPACES:
        st = os.stat(f"/proc/self/ns/{kind}")
        found.append((st.st_dev, st.st_ino))
    return tuple(found)


def _same_namespaces(pid: int, mine: tuple) -> bool:
    try:
        for kind, own in zip(NAMESPACES, mine):
            theirs = os.stat(f"/proc/{pid}/ns/{kind}")
            if own != (theirs.st_dev, theirs.st_ino):
                return False
    except OSError:
        return False
    return True


def _same_namespace_fds(fds, mine: tuple) -> bool:
    """Whether `fds` are the agent's own mount, PID, user and cgroup namespaces, in that order."""
    try:
        return tuple((st.st_dev, st.st_ino) for st in map(os.fstat, fds)) == mine
    except OSError:
        return False


def _is_pidfd(fd: int) -> bool:
    """Whether `fd` is a pidfd (its fdinfo names a pid): a stop's runtime, which the loop
    watches. Another fd there (an epoll chain that epoll_ctl refuses with ELOOP) ended the
    agent, and with it the answers of the starts it held (attacker pass 16, B1)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            return any(line.startswith(b"Pid:") for line in f)
    except OSError:
        return False


def _umask_of(pid: int) -> int | None:
    try:
        return int(files.proc_field(f"/proc/{pid}/status", b"Umask:"), 8)
    except (OSError, ValueError):
        return None


def parse_request(data: bytes):
    """(args, environment) from a request's payload, or None when it is not one."""
    tokens = data.split(b"\0")
    if len(tokens) < 4 or tokens[-1] != b"" or tokens[0] != PROTOCOL:
        return None
    tokens = tokens[1:-1]
    try:
        nargs = int(tokens[0])
        args = tokens[1:1 + nargs]
        nenv = int(tokens[1 + nargs])
        env = tokens[2 + nargs:]
    except (ValueError, IndexError):
        return None
    if nargs < 1 or len(args) != nargs or nenv != len(env) or nenv > 16:
        return None
    try:
        args = [a.decode() for a in args]
        pairs = [e.decode().partition("=") for e in env]
    except UnicodeDecodeError:
        return None
    environment = {}
    for name, eq, value in pairs:
        if not eq or name not in KEPT_VARIABLES or name in environment:
            return None
        environment[name] = value
    return args, environment


class Spare:
    """A child forked ahead of any request; the agent keeps its end of their socket pair (the
    channel), the write end of a pipe the spare waits on (`go`), the pid and a pidfd. A
    request handed over is in the spare's receive queue the moment sendmsg returns: from then
    on it survives the agent. The spare wakes when `go` is closed (by the agent once it has
    answered, or by the agent's end), not on the request itself: woken by sendmsg, a spare on
    the agent's CPU would run before the agent's answer to a stop, holding the runtime up."""

    def __init__(self, pid: int, pidfd: int, channel: socket.socket, go: int):
        self.pid = pid
        self.pidfd = pidfd
        self.channel = channel
        self.go = go

    def wake(self) -> None:
        if self.go >= 0:
            os.close(self.go)
            self.go = -1

    def end(self) -> None:
        """End a spare that holds no request: woken with its channel closed, it exits at once;
        reap it."""
        self.channel.close()
        self.wake()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.pidfd)


def _listened_on(path: str) -> bool:
    """Whether a process listens on the socket file `path` (a connection is accepted or queued;
    the agent it reaches drops one that sends nothing, READ_TIMEOUT later)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:  # ECONNREFUSED: nobody listens; anything else: not an agent's socket either
        return False
    finally:
        probe.close()


class Agent:
    def __init__(self, path: str):
        self.path = path
        self.listener = None
        self.stop_path = stoporder.stop_socket_path(path)
        self.stop_listener = None
        self.stops_due = None  # when to take the stops queued on the stop socket (not watched meanwhile)
        self.listen_paused = None  # until when the socket for starts is not watched (out of fds)
        self.watched = set()  # the listeners the selector watches, by role: "listen", "stops"
        self.finishing = None  # when the agent began to finish (no new connection)
        self.accept_retry = None  # when a finishing agent, out of fds, tries its queues again
        self.selector = selectors.DefaultSelector()
        self.unread = {}  # conn -> (accepted at, peer pid, from the stop socket, seq)
        self.full = set()  # the sockets (stop socket: True) not watched for UNREAD_MAX unread
        self.waiting = collections.deque()  # jobs not handed to a spare yet, in arrival order
        self.deferred = []  # stops held until their runtime has ended (RUNTIME_WAIT at most)
        self.running = {}  # pidfd -> job
        self.spare = None
        self.bound = {}  # path -> (st_dev, st_ino) of each socket file it made
        self.hint = None  # (config path, environment) of the last start: a spare loads it ahead
        self.namespaces = own_namespaces()
        self.lock_path = stoporder.lock_path(path)
        self.seq = 0
        self.stopping = False

    # -- the socket ----------------------------------------------------------------------
    def listen(self) -> None:
        if len(os.fsencode(self.stop_path)) > MAX_SOCKET_PATH:  # checked before anything is made
            raise InputError(f"the agent's socket path is longer than {MAX_SOCKET_PATH - len(stoporder.STOP_SOCKET_SUFFIX)}"
                             f" bytes (its stop socket, the path and {stoporder.STOP_SOCKET_SUFFIX!r}, takes"
                             f" {MAX_SOCKET_PATH})")
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise InputError(f"the agent's socket directory {directory} must be a directory owned by root, "
                             "writable by nobody else")
        for path in (self.stop_path, self.path):  # never take a running agent's sockets away
            if _listened_on(path):
                raise InputError(f"another agent listens on {path}: stop it first")
        # The stop socket first: a front that finds the socket for starts finds this one too.
        self.stop_listener = self._bind(self.stop_path)
        self._watch("stops", True)
        self.listener = self._bind(self.path)
        self._watch("listen", True)

    def _watch(self, role: str, on: bool) -> None:
        """Watch the socket for starts ("listen") or the stop socket ("stops"), or not. The one
        place that registers them: a pause and an event in one turn of the loop unregistered the
        stop socket twice, and the agent died (attacker pass 19, A). A finishing agent watches
        neither (it takes what is queued, `_finish_accepting`)."""
        listener = self.listener if role == "listen" else self.stop_listener
        if on and role not in self.watched and listener is not None and self.finishing is None:
            self.selector.register(listener, selectors.EVENT_READ, role)
            self.watched.add(role)
        elif not on and role in self.watched:
            self.selector.unregister(listener)
            self.watched.discard(role)

    def _bind(self, path: str) -> socket.socket:
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # a socket left by an agent that ended (`listen` checked)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        bound = os.lstat(path)
        self.bound[path] = (bound.st_dev, bound.st_ino)
        listener.listen(128)
        listener.setblocking(False)
        return listener

    def _unlink(self) -> None:
        for path, bound in self.bound.items():
            try:  # the socket files this agent made (a socket fd's inode is not the file's)
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) == bound:
                    os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        if self.listener is not None or self.stop_listener is not None:
            self._unlink()
        self._watch("listen", False)
        self._watch("stops", False)
        for listener in (self.listener, self.stop_listener):
            if listener is not None:
                listener.close()
        self.listener = self.stop_listener = None
        self._retire_spare()

    # -- the loop ------------------------------------------------------------------------
    def serve(self, until=None, ready=None) -> None:
        """Serve until SIGTERM or SIGINT (or `until()` is true); then finish what was accepted.
        `ready()` is called once those signals are handled: a SIGTERM right after systemd was
        told READY=1 ended the agent by the default action, its socket file left behind."""
        def stop(signum, frame):
            self.stopping = True
        # Put back when it returns: a process that served (a test) and forks later must not
        # hand its children a SIGTERM that only sets this flag.
        previous = {number: signal.signal(number, stop) for number in (signal.SIGTERM, signal.SIGINT)}
        try:
            if ready is not None:
                ready()
            self._loop(until)
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _loop(self, until) -> None:
        while True:
            if self.finishing is None and (self.stopping or (until is not None and until())):
                # No new connection (the paths are gone: fronts run the Python hook), and those
                # queued already are served, stops first: closing a listener would reset them,
                # and their fronts, whose request went out, would fail the start (attacker pass
                # 11, B1) or run the stop again.
                self._watch("listen", False)
                self._watch("stops", False)
                self.finishing = self.accept_retry = time.monotonic()
                self.listen_paused = self.stops_due = None
                self._unlink()
            if self.finishing is not None:
                if self.accept_retry is not None and time.monotonic() >= self.accept_retry:
                    self._finish_accepting()
                for job in list(self.deferred):  # an agent that ends holds no stop back
                    self._undefer(job)
                if self.accept_retry is None and not (self.waiting or self.running or self.unread):
                    break
            events = self.selector.select(self._timeout())
            if not events and self._spare_due():
                self._make_spare()  # between requests: no request waits for this fork
            for key, _ in events:
                if key.data in ("listen", "stops") and key.data not in self.watched:
                    continue  # not watched since this select (out of fds: `_pause`)
                if key.data == "listen":
                    # The front that connected is about to wait for the answer: let it get
                    # there first.
                    os.sched_yield()
                    self._accept(self.listener)  # each start after the stops queued before it
                elif key.data == "stops":
                    # Not now: the runtime that ran the stop's hook is finishing its delete.
                    # Taken once STOP_TAKE_DELAY has passed, or before a start.
                    self._watch("stops", False)
                    self.stops_due = time.monotonic() + STOP_TAKE_DELAY
                elif key.data == "conn":
                    self._read(key.fileobj)
                elif isinstance(key.data, tuple) and key.data[0] == "front":
                    self._front_gone(key.data[1])
                elif isinstance(key.data, tuple) and key.data[0] == "runtime":
                    self._undefer(key.data[1])
                elif isinstance(key.data, tuple):
                    self._read_done(key.data[1])
                else:
                    self._reap(key.fileobj)
            self._expire_unread()
            now = time.monotonic()
            for stops_only in list(self.full):  # its oldest silent one may be dropped now (`_evict`)
                if now - self._oldest_unread(stops_only)[1] >= UNREAD_EVICT:
                    self._unfull(stops_only)
            if self.stops_due is not None and now >= self.stops_due:
                self._take_stops()
            if self.listen_paused is not None and now >= self.listen_paused:
                self.listen_paused = None
                self._watch("listen", True)
            for job in [job for job in self.deferred if now >= job.queued_at + RUNTIME_WAIT]:
                self._undefer(job)
            self._launch()

    def _timeout(self) -> float:
        now = time.monotonic()
        ends = [at + READ_TIMEOUT for at, _, _, _ in self.unread.values()]
        ends += [job.queued_at + RUNTIME_WAIT for job in self.deferred]
        ends += [at for at in (self.stops_due, self.listen_paused, self.accept_retry) if at is not None]
        ends += [self._oldest_unread(stops_only)[1] + UNREAD_EVICT for stops_only in self.full]
        ends += [end for job in self.waiting if not job.stop
                 for end in (job.queued_at + STOP_READ_WAIT, job.queued_at + STOP_WAIT) if end > now]
        if self._spare_due():
            ends.append(now + SPARE_DELAY)
        return max(0.0, min(ends) - now) if ends else 0.5

    def _spare_due(self) -> bool:
        """Whether to fork the next spare once nothing has happened for SPARE_DELAY: not while
        a start is at work (its child and its namespace worker want the CPU, and a start that
        comes meanwhile forks its own), nor right after an answer (the front and its runtime
        go on then)."""
        return self.spare is None and self.finishing is None and self.listener is not None and not self.waiting \
            and not self.deferred \
            and self.stops_due is None and not any(not job.stop for job in self.running.values())

    def _pause(self, listener) -> None:
        """Stop watching `listener` for ACCEPT_PAUSE: out of fds (a flood of connections that
        send nothing, each held READ_TIMEOUT), its accept fails while it stays readable, and
        the loop spun a CPU (attacker pass 18). A finishing agent retries on its own timer."""
        if self.finishing is not None:
            return
        if listener is self.stop_listener:
            self._watch("stops", False)
            self.stops_due = time.monotonic() + ACCEPT_PAUSE
        else:
            self._watch("listen", False)
            self.listen_paused = time.monotonic() + ACCEPT_PAUSE

    def _take_stops(self) -> bool:
        """Read the stops queued on the stop socket, and watch it again. True when none is
        left there."""
        self.stops_due = None
        if self.stop_listener is None:
            return True
        self._watch("stops", True)
        # Bounded too: a flood on the stop socket must not hold the loop (beyond MAX_CHILDREN
        # they are declined anyway). Past STOP_BATCH queued at once, the start being accepted is
        # declined (`_accept`).
        return self._accept(self.stop_listener, stops_only=True, most=STOP_BATCH)

    def _finish_accepting(self) -> None:
        """A finishing agent takes every connection queued, stops first, then closes its
        sockets. Out of fds, it tries again ACCEPT_PAUSE later (the connections that send
        nothing are dropped after READ_TIMEOUT), up to FINISH_ACCEPT_WAIT: closed at once, it
        reset the starts queued, and their fronts failed them (attacker pass 19, B1)."""
        # Both queues each time: starts accepted while stops are left are declined (`_accept`),
        # not left to be reset (pass 20, B2: with the stop socket flooded, the starts were
        # never tried).
        stops = self._accept(self.stop_listener, stops_only=True, most=None)
        taken = self._accept(self.listener, most=None) and stops
        now = time.monotonic()
        if taken or now - self.finishing >= FINISH_ACCEPT_WAIT:
            self.accept_retry = None
            self.close()
        else:
            self.accept_retry = now + ACCEPT_PAUSE

    def _accept(self, listener, stops_only: bool = False, most: int | None = ACCEPT_BATCH) -> bool:
        """Take up to `most` connections queued on `listener` (all of them with None: the
        loop comes back for the rest, so a flood of connections does not hold it). True when
        none is left in its queue."""
        if listener is None:
            return True
        while most is None or most > 0:
            if most is not None:
                most -= 1
            if self._unread_of(stops_only) >= UNREAD_MAX and not self._evict(stops_only):
                # So many connections of this socket that send nothing (each kept READ_TIMEOUT)
                # took the fds: the other socket then got none, and starts waited 30 to 77 s
                # behind a flood on the stop socket (attacker pass 20, B4). This one waits for
                # one of them to be read or dropped (`_heard`), or to be silent UNREAD_EVICT.
                self.full.add(stops_only)
                if self.finishing is None:
                    self._watch("stops" if stops_only else "listen", False)
                return False
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return True
            except OSError as err:  # EINTR, ECONNABORTED: the loop comes back
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    self._pause(listener)  # readable still: watched, it would spin the loop
                return False
            # Every stop queued before this start connected is in the stop socket's queue now:
            # it comes first. Taken before the accept instead, a stop queued between the two
            # came after a start its runtime ran later (attacker pass 17, B1). Where some are
            # left there (out of fds, or past STOP_BATCH), the start is declined: the Python
            # hook that runs it waits for every stop on its way to the agent (stops.pending,
            # gpuhook.stoporder); numbered here, it came before them (attacker pass 19, C).
            stops_left = not stops_only and not self._take_stops()
            conn.setblocking(False)
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            # Declined (the front runs the hook itself) once its request is read: closing a
            # connection with an unread request would reset it, and the front then fails. The
            # namespaces are checked with the request (`_read`): a stop's front has exited.
            declined = stops_left or uid != 0 or pid <= 0 \
                or len(self.running) + len(self.waiting) + len(self.deferred) >= MAX_CHILDREN
            # Numbered now, after the stops queued before it: a stop accepted before a start
            # holds that start while still unread (`_launch`), not from its read on (attacker
            # pass 18: a stop whose request came a little after its connect was read after a
            # later start, and numbered after it).
            self.seq += 1
            self.unread[conn] = (time.monotonic(), 0 if declined else pid, stops_only, self.seq)
            self.selector.register(conn, selectors.EVENT_READ, "conn")
            self._read(conn)  # the front sends right after connecting: usually there already
        return False

    def _expire_unread(self) -> None:
        now = time.monotonic()
        for conn, (at, _, _, _) in list(self.unread.items()):
            if now - at > READ_TIMEOUT:
                self._give_up(conn)  # one that arrived while this loop was busy is served

    def _unread_of(self, stops_only: bool) -> int:
        """How many of the socket's connections are unread (64 at most over both sockets)."""
        return sum(1 for _, _, role, _ in self.unread.values() if role == stops_only)

    def _oldest_unread(self, stops_only: bool):
        """(connection, accepted at) of the socket's unread connection accepted first."""
        return min(((conn, at) for conn, (at, _, role, _) in self.unread.items() if role == stops_only),
                   key=lambda pair: pair[1], default=(None, 0.0))

    def _evict(self, stops_only: bool) -> bool:
        """Past UNREAD_MAX, drop the socket's oldest unread connection once it has been silent
        UNREAD_EVICT (a front sends right after it connects), to take the next one. Waiting
        READ_TIMEOUT instead, a start queued behind 120 silent connections waited 6 s, and one
        queued when the agent was stopped was reset (attacker pass 21, B1). False when none is
        that old yet."""
        conn, at = self._oldest_unread(stops_only)
        if conn is None or time.monotonic() - at < UNREAD_EVICT:
            return False
        self._give_up(conn)
        return True

    def _give_up(self, conn) -> None:
        """End an unread connection that kept silent too long (`_evict`, READ_TIMEOUT): its
        reading side shut first, then read once more. A request that came before is served; a
        send after fails (EPIPE) and its front runs the hook itself. Read, then closed, a request
        that came between the two was reset, and its front failed the start (attacker pass 22)."""
        try:
            conn.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        self._read(conn)  # an end of file now if nothing came: answered `run`
        if conn in self.unread:
            self._drop(conn)

    def _heard(self, conn) -> None:
        """`conn` is no longer unread (its request came, or it is dropped): its socket is
        watched again if it waited for that (`_accept`, UNREAD_MAX)."""
        _, _, stops_only, _ = self.unread.pop(conn)
        self._unfull(stops_only)

    def _unfull(self, stops_only: bool) -> None:
        """Watch the socket again that waited for room among its unread connections."""
        if stops_only in self.full:
            self.full.discard(stops_only)
            if stops_only and self.stops_due is None:
                self._watch("stops", True)
            elif not stops_only and self.listen_paused is None:
                self._watch("listen", True)

    def _drop(self, conn) -> None:
        if conn in self.unread:
            self._heard(conn)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _read(self, conn) -> None:
        _, peer, stops_only, seq = self.unread[conn]
        fds = array.array("i")
        try:
            data, ancdata, flags, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(max(FDS, STOP_FDS) * fds.itemsize),
                                                   socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        fds = list(fds)
        self._heard(conn)
        self.selector.unregister(conn)
        request = parse_request(data) if not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) else None
        parsed = prescan.split_hook_args(request[0]) if request is not None else None
        stop = parsed is not None and parsed[0] == "poststop"
        umask = None
        if peer and parsed is not None and (stop or not stops_only) and len(fds) == (STOP_FDS if stop else FDS):
            if stop:  # by the namespaces it sent (its front has exited), with a pidfd last
                umask = STOP_UMASK if _same_namespace_fds(fds[1:5], self.namespaces) and _is_pidfd(fds[5]) \
                    else None
            elif _same_namespaces(peer, self.namespaces):
                umask = _umask_of(peer)
        if umask is None or request is None or parsed[0] not in entry.HOOK_STAGES \
                or not stat.S_ISREG(os.fstat(fds[0]).st_mode) \
                or request[1].get(prescan.FRONT_VARIABLE) != str(prescan.FRONT_PROTOCOL):
            # Not one this agent serves as the hook would (another front's protocol: the
            # Python hook refuses it with its own line): the front runs the hook itself.
            _close_fds(fds)
            _reply(conn, b"run")
            conn.close()
            return
        runtime = -1
        if stop:  # the namespaces were for the check
            _close_fds(fds[1:5])
            fds, runtime = [fds[0]], fds[5]
        job = Job(seq, conn, parsed[0], parsed[1], request[1], fds, peer, umask)
        job.request = data
        if job.stop:
            # Handed over and answered once its runtime has ended (RUNTIME_WAIT at most): runc's
            # delete ends right after its poststop hooks, and the stop's work, this loop's
            # hand-over and the next spare took the CPU from those last steps. Starts that came
            # after it wait (`_launch`). Then its child reads the bundle, and the work follows,
            # one stop at a time (`STOP_LOCK`). Nothing of a stop waits in this process longer
            # (if the agent ends, its front's child, waiting for the answer, runs it), and no
            # stop's input slows this loop.
            job.runtime = runtime
            try:
                held = not select.select([runtime], [], [], 0)[0]
                if held:
                    self.selector.register(runtime, selectors.EVENT_READ, ("runtime", job))
            except (OSError, ValueError):  # one this loop cannot watch is not waited for
                held = False
            if held:
                self.deferred.append(job)
            else:
                self._undefer(job)
            return
        try:  # the front, watched: a runtime that gives up on its hook kills it
            job.front = os.pidfd_open(job.peer)
            self.selector.register(job.front, selectors.EVENT_READ, ("front", job))
        except OSError:
            job.front = -1
        self.waiting.append(job)

    def _undefer(self, job: "Job") -> None:
        """A stop whose runtime has ended (or RUNTIME_WAIT has passed): hand it over."""
        if job in self.deferred:
            self.deferred.remove(job)
            self.selector.unregister(job.runtime)
        if job.runtime >= 0:
            os.close(job.runtime)
            job.runtime = -1
        self._hand(job)

    def _launch(self) -> None:
        now = time.monotonic()
        for job in list(self.waiting):
            if any(stop.seq < job.seq for stop in self.deferred):
                continue  # a stop that came before it, held until its runtime ends
            if any(stops_only and seq < job.seq for _, _, stops_only, seq in self.unread.values()):
                continue  # one accepted before it on the stop socket, its request not read yet
                # (READ_TIMEOUT at most: then it is read or dropped)
            # A stop at its work holds the start up to STOP_WAIT. One still reading its bundle
            # (`ready` open) holds it only STOP_READ_WAIT: that read is a few ms, unless its
            # own container's input is huge, which must not hold back others' for long.
            earlier = [j for j in self.running.values() if j.stop and j.seq < job.seq]
            waited = now - job.queued_at
            if any(waited < (STOP_WAIT if j.ready < 0 else STOP_READ_WAIT) for j in earlier):
                continue
            self.waiting.remove(job)
            self._hand(job)

    def _front_gone(self, job: "Job") -> None:
        """A start's front ended before its answer: the runtime killed its hook (its timeout).
        One still waiting here is dropped (attacker pass 11, B3). A child at work watches its
        front itself and ends as at its deadline, its worker's work taken back (the hook's
        backstop, gpuhook.hook): killed from here, its worker died with it and left its
        mounts (attacker pass 12, A1), and an agent that had ended killed nothing (A2)."""
        self._unwatch_front(job)
        if job in self.waiting:
            self.waiting.remove(job)
            self._finish(job, None)

    def _unwatch_front(self, job: "Job") -> None:
        if job.front >= 0:
            self.selector.unregister(job.front)
            os.close(job.front)
            job.front = -1

    def _read_done(self, job: "Job") -> None:
        """A stop's child has read the state and the bundle (or ended): starts may count it."""
        self.selector.unregister(job.ready)
        os.close(job.ready)
        job.ready = -1

    # -- spares ----------------------------------------------------------------------------
    def _make_spare(self) -> "Spare | None":
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        except OSError:
            return None
        try:
            go_r, go_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            ours.close()
            theirs.close()
            return None
        try:
            pid = os.fork()
        except OSError:
            _close_fds((go_r, go_w))
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            code = INTERNAL_ERROR
            try:
                code = _spare(theirs.fileno(), go_r, self.lock_path, self.hint)
            finally:
                os._exit(code & 0xFF)
        theirs.close()
        os.close(go_r)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # cannot happen for a child not reaped yet
            ours.close()
            os.close(go_w)
            os.waitpid(pid, 0)
            return None
        self.spare = Spare(pid, pidfd, ours, go_w)
        return self.spare

    def _retire_spare(self) -> None:
        """An idle spare woken with nothing in its channel ends; reap it (it exits at once)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.end()

    def _hand(self, job: Job) -> None:
        """Give `job` to the spare (forking one if there is none); a stop is answered then."""
        spare, self.spare = self.spare, None
        sent = False
        for _ in range(2):  # a spare that died idle (sendmsg: EPIPE) is replaced once
            if spare is None:
                spare, self.spare = self._make_spare(), None
                if spare is None:
                    break
            header = f"{job.seq} {job.peer} {job.umask} {job.queued_at!r}\n".encode()
            # A start's child gets the front's connection too: it answers the front itself.
            fds = job.fds if job.stop else [*job.fds, job.conn.fileno()]
            try:
                spare.channel.sendmsg([header + job.request],
                                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                sent = True
                break
            except OSError:
                spare.end()
                spare = None
        if not sent:
            self._finish(job, None)
            return
        job.pid, job.pidfd = spare.pid, spare.pidfd
        if not job.stop:  # the next spare loads this start's configuration while it waits
            self.hint = (job.config_path, {k: v for k, v in job.env.items() if k == "GPUHOOK_CONFIG"})
        if job.stop:
            # In the spare's queue now: the runtime goes on, answered before the spare is
            # woken. The spare closes its end of the channel once it read the bundle
            # (`_read_done`).
            _reply(job.conn, b"exit 0")
            job.conn.close()
            job.conn = None
            # The channel itself, not a dup of it: out of fds, the dup failed and ended the
            # agent (attacker pass 20, A1).
            job.ready = spare.channel.detach()
            self.selector.register(job.ready, selectors.EVENT_READ, ("ready", job))
        # Nothing of the front's output stays here: the runtime waits until every copy of its
        # hook's stdout and stderr is closed, and the child closes its own before it answers.
        _close_fds(job.fds)
        job.fds = []
        spare.channel.close()
        spare.wake()
        self.running[job.pidfd] = job
        self.selector.register(job.pidfd, selectors.EVENT_READ, "child")

    def _reap(self, pidfd: int) -> None:
        job = self.running.pop(pidfd)
        if job.ready >= 0:  # ended before it said it read the bundle
            self._read_done(job)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(job.pid, 0)
        # The child answered before it ended (`_child`); this answer counts only where it did
        # not (killed, or failed before it could): the front reads one answer, the first.
        self._finish(job, os.waitstatus_to_exitcode(status))

    def _finish(self, job: Job, code) -> None:
        """Answer the front: `run` (code None: nothing of the hook ran), `exit N`, or
        `signal N` for a child killed by signal N (the front prints the line and exits 70)."""
        self._unwatch_front(job)
        _close_fds(job.fds)
        job.fds = []
        if job.conn is not None:
            _reply(job.conn, _answer(code))
            job.conn.close()
            job.conn = None


def _answer(code) -> bytes:
    if code is None:
        return b"run"
    return f"exit {code}".encode() if code >= 0 else f"signal {-code}".encode()


def _spare(channel: int, go: int, lock_path: str, hint) -> int:
    """In a spare: hold nothing of the agent's (no listener, no other request's fds: a runtime
    waits for its hook's stdout to close), wait to be woken (`go` closed), take the one request
    in the channel, become its hook process; with none there (retired, or the agent ended
    idle), end."""
    import gc

    gc.disable()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    low = 3
    for fd in sorted((channel, go)):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)
    from gpuhook.apply import worker

    # A start's namespace worker, forked now rather than on the request's critical path; a
    # stop discards it (`_child`). It holds nothing of this process's but its own pipes.
    try:
        worker.start_early(close=(channel, go))
    except OSError:
        pass  # the start forks its own (gpuhook.entry)
    if hint is not None:
        # The configuration the last start named, loaded now rather than on the next start's
        # critical path; that start's own load takes it only if the file is unchanged.
        from gpuhook import config
        from gpuhook.discover import inventory

        config.preload(*hint)
        # And the inventory cache that configuration names, parsed; the start still takes
        # the host's fingerprint, and uses this only if that is unchanged.
        inventory.preload(config.preloaded())
    while os.read(go, 1):  # nothing is written: it ends when the agent closes its end
        pass
    os.close(go)
    fds = array.array("i")
    # detach(): a socket object closes its fd when it is freed, and a stop's channel must stay
    # open until the stop has read its bundle (`_child`): the agent counts it as at its work
    # from the channel's end of file (attacker pass 10, B1).
    receiver = socket.socket(fileno=channel)
    try:
        data, ancdata, _, _ = receiver.recvmsg(MAX_REQUEST + 256, socket.CMSG_SPACE(
            (FDS + 1) * fds.itemsize), socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0  # retired idle
    finally:
        receiver.detach()
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:  # the agent retired this spare, or ended
        return 0
    header, _, request = data.partition(b"\n")
    seq, peer, umask, queued_at = header.split()
    args, env = parse_request(request)
    stage, config_path = prescan.split_hook_args(args)
    job = Job(int(seq), None, stage, config_path, env, list(fds), int(peer), int(umask))
    job.queued_at = float(queued_at)
    job.lock = lock_path
    return _child(job)


def _read_state(fd: int) -> bytes:
    chunks, total = [], 0
    while total <= prescan.MAX_STATE_BYTES:
        chunk = os.pread(fd, prescan.MAX_STATE_BYTES + 1 - total, total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _child(job: Job) -> int:
    """In a spare that got its request: become the front's hook process, run the hook, return
    its code."""
    from gpuhook.kernel import caller

    caller.SINCE[0] = job.queued_at  # the hook's deadline counts from the request, wait included
    job.state = _read_state(job.fds[0])
    names = None
    if job.stop:
        wants_none, job.spec = entry.prescan_state(job.state)
        if not wants_none:
            # The pod's names for its log line, while starts count this stop as reading its
            # bundle: parsing a huge config.json under the lock held every later start up to
            # STOP_WAIT (attacker pass 11, B2).
            from gpuhook import hook

            names = hook.stop_names(job.state, job.spec)
            job.spec = None
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(null, 2)
    else:
        os.dup2(job.fds[0], 0)
        os.dup2(job.fds[1], 1)
        os.dup2(job.fds[2], 2)
    # The request's fds and the spare's channel. For a stop, the agent waits for the channel's
    # end of file: what the stop needs of the bundle is read, starts may count it now. A
    # start's namespace worker, forked by the spare, keeps its pipes; a stop needs none. A
    # start keeps the front's connection, to answer it.
    from gpuhook.apply import worker

    if job.stop:
        worker.discard()
    conn = -1 if job.stop else job.fds[3]
    keep = sorted([*worker.early_fds(), *([conn] if conn >= 0 else [])])
    low = 3
    for fd in keep:
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)
    if job.stop:
        if wants_none:
            return 0
        try:
            os.nice(STOP_NICE)
        except OSError:
            pass
        _take_stop_lock(job.lock, job.queued_at + STOP_LOCK_WAIT)
    os.umask(job.umask)
    os.environ.clear()
    os.environ.update(job.env)
    caller.CALLER[0] = job.peer
    if not job.stop:
        try:  # the hook's backstop watches it: a start ends with its front (gpuhook.hook)
            caller.FRONT[0] = os.pidfd_open(job.peer)
        except OSError:
            pass
    if job.stop:  # the prescan ran above (the bundle may be gone by now)
        code = entry.run_checked(job.stage, job.config_path, job.state, job.spec, names)
    else:
        code = entry.run_stage(job.stage, job.config_path, job.state)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    code = 0 if code is None else code
    if conn >= 0:
        _answer_front(conn, code)
        worker.discard()  # a committed worker the hook left to reap after the answer (hook.reap_after_answer)
    return code


def _answer_front(conn: int, code: int) -> None:
    """Answer the front from the child, its output closed first: the runtime goes on once the
    front has exited and every copy of its stdout and stderr is closed, not when this process
    has ended and the agent has reaped it (about 1 ms later). The agent answers again when it
    reaps the child; the front reads only the first answer."""
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    try:
        socket.socket(fileno=conn).send(_answer(code))
    except OSError:
        pass


def _take_stop_lock(path: str, until: float) -> None:
    """One stop at a time (grant records, GPU cleanup): an exclusive flock on the lock file
    beside the socket, held until this child exits; starts wait for it too
    (gpuhook.stoporder). Waits until `until`, then goes on without it (a stop never fails,
    and never waits without bound)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    stoporder.flock_until(fd, fcntl.LOCK_EX, until)


def socket_path(explicit: str | None = None) -> str:
    """Where to listen: --socket, else $GPUHOOK_AGENT_SOCKET, else the default. Absolute: the
    front uses only an absolute path (a relative one would name a file beside each bundle), so
    an agent on a relative one would serve nothing (newcomer run)."""
    variable = os.environ.get(SOCKET_VARIABLE)
    if not explicit and variable == "":  # the fronts it would serve never use an agent
        raise InputError(f"${SOCKET_VARIABLE} is empty, which tells the front never to use an agent: "
                         "give --socket, or unset it")
    path = explicit or variable or DEFAULT_SOCKET
    if not path.startswith("/"):
        raise InputError(f"the agent's socket path must be absolute (the front uses no other): {path}")
    return path


def run(path: str, ready=None) -> None:
    """`gpuhook agent`: preload, listen, tell systemd, serve until SIGTERM."""
    if os.geteuid() != 0:
        raise InputError("the agent serves the hook as root: run it as root")
    preload()
    import gc

    # What the agent imported is frozen: no collection in a child touches (and so copies)
    # those pages. The children collect nothing at all (`_child`, as launch.py).
    gc.collect()
    gc.freeze()
    agent = Agent(path)
    agent.listen()
    try:
        agent.serve(ready=ready)
    finally:
        agent.close()
