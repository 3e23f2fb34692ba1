"""`gpuhook agent`: the resident agent that serves the native front's hook requests."""

import os

import click

from gpuhook import agent


@click.command("agent")
@click.option("--socket", "socket_path", metavar="PATH",
              help=f"Where to listen for starts, an absolute path (default: ${agent.SOCKET_VARIABLE} or {agent.DEFAULT_SOCKET}; "
                   f"stops: the same path with {agent.stoporder.STOP_SOCKET_SUFFIX} appended). The "
                   "directory must be root's and writable by nobody else.")
def agent_command(socket_path):
    """Serve the hook for the native front, pre-imported (docs/agent.md).

    Runs as root, in the host's mount, PID, user and cgroup namespaces (the runtime's):
    packaging/systemd/gpuhook-agent.service starts it. The front uses it when it is there
    and runs the Python hook itself when it is not; a start is correct either way, only
    faster with it. With it, the runtime does not wait for a stop, which is carried out in
    order once the runtime has ended (10 to 100 ms later, or before the next start); without it the front runs each stop in
    the foreground. A start waits for the stops that came before it, up to 5 s. The front finds
    the agent at $GPUHOOK_AGENT_SOCKET in the hook's own environment, else at the default path. SIGTERM finishes what was accepted, then exits.
    """
    path = agent.socket_path(socket_path)

    def ready():
        from gpuhook.cli.plugincmd import sd_notify

        target = os.environ.pop("NOTIFY_SOCKET", "")
        if target:
            sd_notify(target, b"READY=1")
        click.echo(f"gpuhook agent: listening on {path} (stops: {agent.stoporder.stop_socket_path(path)})", err=True)

    agent.run(path, ready)
