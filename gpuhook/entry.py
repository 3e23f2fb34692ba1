"""The `gpuhook` command: hook stages go to the fast path, everything else to the CLI.

A runtime calls ``gpuhook prestart`` for every container; that must not import click (about
20 ms). Hook invocations with nothing but ``--config`` are served here with the standard
library only; anything else (``--dry-run``, ``--help``, other commands) goes to click.
"""

import sys

HOOK_STAGES = ("prestart", "createRuntime", "poststop")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in HOOK_STAGES:
        from gpuhook import prescan

        check_front(prescan)
        parsed = prescan.split_hook_args(args)
        if parsed is not None:
            sys.exit(run_stage(*parsed))
    from gpuhook.sitepath import enable_site_packages

    enable_site_packages()
    try:
        import click  # noqa: F401
    except ImportError:  # the RHEL 9 RPM bundles click (packaging/vendor/click)
        from gpuhook._vendor import add_bundled_site

        add_bundled_site()
    from gpuhook.cli import main as cli_main

    cli_main(args)


def check_front(prescan) -> None:
    """Exit 4 (a host problem) when a native front of another protocol version ran this hook."""
    import posix

    front = posix.environ.get(prescan.FRONT_VARIABLE.encode())
    if front is not None and front != str(prescan.FRONT_PROTOCOL).encode():
        print("gpuhook: the installed native front does not match this gpuhook version: "
              "reinstall gpuhook (gpuhook install)", file=sys.stderr)
        sys.exit(4)


def run_stage(stage: str, config_path: str | None, state: bytes | None = None) -> int:
    """Read the state from stdin (or take it: the agent, gpuhook.agent, read it from the
    front's memfd); return 0 at once for a container that wants no GPU."""
    from gpuhook import prescan

    if state is None:
        state = sys.stdin.buffer.read(prescan.MAX_STATE_BYTES + 1)
    wants_none, spec = prescan_state(state)
    if wants_none:
        return 0
    return run_checked(stage, config_path, state, spec)


def prescan_state(state: bytes) -> tuple:
    """(True, None) when neither the state nor its bundle's config.json can request a GPU;
    else (False, config.json's bytes, or None where only the full parser can say why)."""
    from gpuhook import prescan

    spec = None
    if len(state) <= prescan.MAX_STATE_BYTES:
        bundle = prescan.bundle_of(state)
        if bundle is not None:
            try:
                spec = prescan.read_regular_file(bundle + "/config.json", prescan.MAX_CONFIG_BYTES + 1)
            except (OSError, ValueError):  # unreadable or an impossible path: the full parser says why
                spec = None
            if spec is not None and len(spec) <= prescan.MAX_CONFIG_BYTES \
                    and not prescan.may_request_gpu(state, spec):
                return True, None
    return False, (spec if spec and len(spec) <= prescan.MAX_CONFIG_BYTES else None)


def run_checked(stage: str, config_path: str | None, state: bytes, spec: bytes | None,
                names: dict | None = None) -> int:
    """The hook for a container the prescan could not rule out (`spec`: its config.json, read
    already, or None)."""
    if stage == "poststop":  # no namespace worker at a stop: it neither plans nor mounts
        from gpuhook.hook import run_hook

        return run_hook(stage, state, config_path, spec, names=names)
    from gpuhook.apply import worker

    # The namespace worker loads its modules on another core while this process plans
    # (gpuhook.apply.worker); a start that needs none ends it unused.
    try:
        worker.start_early()
    except OSError:
        pass  # no fork now (EAGAIN, ENOMEM): apply forks it later, inside the hook's error boundary
    try:
        from gpuhook.hook import run_hook

        return run_hook(stage, state, config_path, spec)
    finally:
        worker.discard()
