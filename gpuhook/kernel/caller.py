"""Whose place the hook takes: the process the runtime started as the hook.

Run by the runtime, that is this process. Served by the agent (gpuhook.agent), the work runs
in a child of the agent while the runtime's hook process, the native front, waits for it: the
comparisons that ask "is this the runtime's own cgroup?" (a container without a cgroup of its
own, gpuhook.apply.run; a health registry entry, gpuhook.health.registry) must ask it of the
front, not of the agent's service. The agent sets `CALLER[0]` in the child it forks, from
the connection's SO_PEERCRED, having checked that the front shares its mount, PID, user and
cgroup namespaces (docs/agent.md).
"""

import os

CALLER = [0]  # the front's pid when the agent serves this hook; 0 when the runtime ran this process
SINCE = [0.0]  # when the agent got the request (time.monotonic): the hook's deadline counts from then
FRONT = [-1]  # a pidfd of the front, when the agent serves a start: the hook ends when the front does


def pid() -> int:
    """The pid of the process the runtime started as the hook."""
    return CALLER[0] or os.getpid()
