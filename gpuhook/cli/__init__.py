"""The gpuhook command line (click). Each command parses, makes one library call, renders.

Commands are registered by name and imported only when run, so ``gpuhook --help`` and the
hook's fast path never pay for the heavy ones. Errors are mapped in one place: a
GpuhookError or a usage error becomes one ``gpuhook: ...`` line on stderr and its exit code.
"""

import importlib
import sys

import click

from gpuhook import __version__
from gpuhook import config as cfg
from gpuhook.errors import INTERNAL_ERROR, GpuhookError, exit_code_text, from_os_error

# The --config option of every command that reads gpuhook's configuration.
CONFIG_OPTION = click.option("--config", "config_path", metavar="FILE",
                             help=f"Configuration file (default: ${cfg.ENV_VAR} or {cfg.DEFAULT_PATH}).")

# name -> (module, attribute, one-line help). Modules live in gpuhook.cli.
COMMANDS = {
    "prestart": ("hookcmd", "prestart", "Run the hook for a container being created (OCI state on stdin)."),
    "createRuntime": ("hookcmd", "create_runtime", "Same as prestart, for the createRuntime stage."),
    "poststop": ("hookcmd", "poststop", "Run the hook after a container stopped (OCI state on stdin)."),
    "simulate": ("simcmd", "simulate", "Build a simulated NVIDIA GPU host in a directory."),
    "list": ("hostcmd", "list_gpus", "List the host's GPUs as the hook sees them."),
    "config": ("hostcmd", "show_config", "Show the effective configuration and where it came from."),
    "doctor": ("doctorcmd", "doctor", "Check this host's setup (driver, ldconfig, cgroups, NVML, runtimes) before a start fails."),
    "demo": ("democmd", "demo", "Start a real runc container with simulated GPUs injected by gpuhook."),
    "cgroup": ("cgroupcmd", "cgroup", "Show a container's device rules (cgroup v1 or v2) and whether systemd knows them."),
    "cdi": ("cdicmd", "cdi", "Generate a CDI spec for this host with gpuhook as its hook."),
    "install": ("installcmd", "install_command", "Register gpuhook with podman, CRI-O, containerd, Docker or a runc bundle."),
    "uninstall": ("installcmd", "uninstall_command", "Take back what `gpuhook install` added."),
    "agent": ("agentcmd", "agent_command", "Serve the hook pre-imported for the native front (GPU starts and stops without Python's start-up)."),
    "plugin": ("plugincmd", "plugin", "Run the Kubernetes device plugin (PreStartContainer checks and cleans the GPUs)."),
    "prepare": ("healthcmd", "prepare", "Check and clean GPUs before a container gets them; stamp them for the hook."),
    "check": ("healthcmd", "check", "Run the GPU health checks (no changes unless --repair)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module = importlib.import_module(f"gpuhook.cli.{entry[0]}")
        return getattr(module, entry[1])

    def format_commands(self, ctx, formatter):
        # Help text from the registry: listing commands imports none of them.
        rows = [(name, entry[2]) for name, entry in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: " + exit_code_text())
@click.version_option(__version__, prog_name="gpuhook")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print each decision-log line (what gpuhook decided and why) on stderr: the hook "
                   "(prestart, createRuntime, poststop), check, prepare and plugin write them.")
def cli(verbose):
    """gpuhook: an OCI runtime hook that gives containers their GPUs, checked and clean.

    Runtimes call `gpuhook prestart` (or createRuntime) with the container's OCI state on
    stdin, and `gpuhook poststop` after the container stopped. The other commands are for
    people and services: register the hook with a runtime (install, uninstall) or write a CDI
    spec for it (cdi generate); check and clean GPUs (check, prepare) and run the Kubernetes
    device plugin or the health daemon (plugin); look at the host (list, config, doctor,
    cgroup show) and at a start's plan (prestart --dry-run); try it all without a GPU
    (simulate, demo). Shell completion: eval "$(_GPUHOOK_COMPLETE=bash_source gpuhook)"
    (zsh_source, fish_source).
    """
    if verbose:
        from gpuhook import journal

        journal.ECHO[0] = True


def fail(err: GpuhookError):
    click.echo(f"gpuhook: {err.one_line()}", err=True)
    sys.exit(err.exit_code)


def main(args=None) -> None:
    """Run the CLI; every failure ends as one `gpuhook: ...` line and its exit code."""
    try:
        cli.main(args=args, prog_name="gpuhook", standalone_mode=False)
    except GpuhookError as err:
        fail(err)
    except click.exceptions.Abort:
        click.echo("gpuhook: aborted", err=True)
        sys.exit(1)
    except click.ClickException as err:
        no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())
        if no_args and isinstance(err, no_args):  # click >= 8.2: a bare group asks for its help
            click.echo(err.ctx.get_help())
            sys.exit(0)
        click.echo(f"gpuhook: {' '.join(err.format_message().split())}", err=True)
        sys.exit(err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except OSError as err:  # a file a command needed, named by the OS
        fail(from_os_error(err))
    except Exception as err:  # a bug: one line, not a traceback
        click.echo(f"gpuhook: internal error: {type(err).__name__}: {err}".splitlines()[0], err=True)
        sys.exit(INTERNAL_ERROR)
    sys.exit(0)
