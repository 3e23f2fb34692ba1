"""Stops before starts, across processes: the lock the agent's stops hold while they work.

The agent (gpuhook.agent) answers a stop before carrying it out, so the runtime may start the
next container while an earlier stop still cleans up its GPUs. Each stop's child holds an
exclusive flock on `stops.lock`, beside the agent's socket, while it works; the agent holds a
start back until the stops it knows of are done. A start also waits, briefly, to take that
lock shared (`wait_for_stops`): so it waits as well for stops the agent serving it does not
know of: those of an agent that ended or restarted, and those under way while the agent
declined the start and the Python hook ran it (docs/agent.md, attacker pass 10, B2 and B3).

The native front does not wait for the agent's answer to a stop either: it forks a child that
sends the request and waits, and exits at once. Before the fork it takes `stops.pending`
shared, and the child keeps it until the agent has the stop (or, declined, until the child holds
`stops.lock` itself). A start takes `stops.pending` exclusive first, then lets it go: so it waits
for a stop the runtime has finished with but the agent has not received yet.

Standard library only; fcntl and signal are loaded when a lock file is there.
"""

import os
import time

DEFAULT_SOCKET = "/run/gpuhook/agent.sock"
SOCKET_VARIABLE = "GPUHOOK_AGENT_SOCKET"
LOCK_NAME = "stops.lock"
PENDING_NAME = "stops.pending"  # held shared by each stop on its way to the agent (native/)
STOP_SOCKET_SUFFIX = ".stops"  # the agent's socket for stops: its socket's path and this (native/)
STOP_WAIT = 5.0  # seconds a start waits for the stops that came before it


def stop_socket_path(socket_path: str) -> str:
    """Where the agent listens for stops, beside its socket for starts: it takes a stop from
    there once the runtime that ran its hook is done, not while that runtime's delete is still
    at work (docs/agent.md, "Stops")."""
    return socket_path + STOP_SOCKET_SUFFIX


def lock_path(socket_path: str) -> str:
    return os.path.join(os.path.dirname(socket_path) or ".", LOCK_NAME)


def environ_lock_path(environ=None) -> str:
    """The lock beside the socket a front uses: $GPUHOOK_AGENT_SOCKET's, or the default's."""
    environ = os.environ if environ is None else environ
    return lock_path(environ.get(SOCKET_VARIABLE) or DEFAULT_SOCKET)


def wait_for_stops(path: str, until: float) -> bool:
    """Wait until no stop is on its way to the agent (`stops.pending` beside `path`, an
    exclusive flock taken and let go), then until no stop holds the lock at `path` (a shared
    one), all up to monotonic time `until`. True when neither file was there or both were free
    by then."""
    free = True
    for name, exclusive in ((os.path.join(os.path.dirname(path), PENDING_NAME), True), (path, False)):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # no stop of any agent or front has used it here
        try:
            import fcntl

            free = flock_until(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, until) and free
        finally:
            os.close(fd)
    return free


def flock_until(fd: int, operation: int, until: float) -> bool:
    """flock(fd, operation), waiting up to monotonic time `until`; True when taken. A blocking
    flock bounded by a one-shot timer: a waiter wakes once, when the lock is let go, however
    many wait (polling woke each of them every few ms)."""
    import fcntl
    import signal

    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError:
        return False
    left = until - time.monotonic()
    if left <= 0:
        return False
    waiting = [True]

    def expired(signum, frame):
        if waiting[0]:
            raise TimeoutError
    previous = signal.signal(signal.SIGALRM, expired)
    taken = False
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, left)
            fcntl.flock(fd, operation)
            taken = True
        finally:
            waiting[0] = False
    except (TimeoutError, OSError):
        pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    return taken
