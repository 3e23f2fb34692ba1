"""`gpuhook install TARGET` and `gpuhook uninstall TARGET`: register gpuhook with a runtime."""

import click

from gpuhook import config as cfg
from gpuhook import install

TARGET = click.argument("target", type=click.Choice(install.TARGETS), metavar="TARGET")
BUNDLE = click.argument("bundle", required=False, metavar="[BUNDLE]")
HOOKS_DIR = click.option("--hooks-dir", metavar="DIR",
                         help=f"podman, crio: the hooks dir [default: podman {install.ADMIN_HOOKS_DIR}, "
                              f"crio {install.PACKAGE_HOOKS_DIR}, the dir each reads by default].")
OUTPUT = click.option("--output", "spec_path", metavar="FILE",
                      help=f"containerd: the base runtime spec to write [default: {install.CONTAINERD_SPEC}].")
CONTAINERD_CONFIG = click.option("--containerd-config", metavar="FILE",
                                 help=f"containerd: its config file [default: {install.CONTAINERD_CONFIG}].")
BIN_DIR = click.option("--bin-dir", metavar="DIR",
                       help=f"docker: where the {install.DOCKER_HOOK_NAME} launcher goes, a dir on dockerd's PATH "
                            f"[default: {install.DEFAULT_BIN_DIR}].")
HOST_ROOT = click.option("--host-root", metavar="DIR", help=(
    "podman, crio, containerd: the node's / is mounted at DIR (a DaemonSet's init container): copy "
    "this gpuhook to DIR/opt/gpuhook/lib and register it at the node's paths, run by the node's "
    "/usr/bin/python3 (3.11+; --python to name another) (docs/kubernetes.md)."))
UNINSTALL_HOST_ROOT = click.option("--host-root", metavar="DIR", help=(
    "podman, crio, containerd: the node's / is mounted at DIR (a DaemonSet's init container): "
    "take back what install --host-root DIR put at the node's paths, and the copy of gpuhook in "
    "DIR/opt/gpuhook/lib unless another runtime there still uses it (docs/kubernetes.md)."))
DRY_RUN = click.option("--dry-run", is_flag=True, help="Print the change as a unified diff; change nothing.")

TARGETS_HELP = (
    "gpuhook is registered for two stages: prestart (give the container its GPUs, checked and "
    "cleaned) and poststop (kill what the stopped container left on them, take back its "
    "device rules from a cgroup v1 it shared). "
    "TARGET is podman or crio (one oci-hooks file per stage in the hooks dir: "
    f"{install.HOOK_FILE_NAME} and {install.POSTSTOP_FILE_NAME}), containerd "
    "(a base runtime spec with gpuhook's hooks, and config.toml's runc runtime pointed at it) or "
    "runc-bundle (gpuhook's hooks in BUNDLE/config.json) or docker (a launcher named "
    f"{install.DOCKER_HOOK_NAME} that Docker's --gpus runs as its prestart hook). "
)


def _render(plan: install.InstallPlan, dry_run: bool) -> None:
    if dry_run:
        click.echo(install.render_diff(plan), nl=False)
        return
    for line in install.apply(plan):
        click.echo(line)
    for note in plan.notes:
        click.echo(note if note.startswith("warning: ") else f"note: {note}")


@click.command(name="install", help=(
    "Register gpuhook with a container runtime, for the gpuhook installation running this "
    "command (its interpreter and gpuhook/launch.py). " + TARGETS_HELP +
    "Re-running changes nothing; a file gpuhook changes for the first time is first copied "
    f"to FILE{install.BACKUP_SUFFIX}; `gpuhook uninstall` takes the change back."
))
@TARGET
@BUNDLE
@HOOKS_DIR
@click.option("--annotated", is_flag=True, help=(
    "podman, crio: run the hook (both stages) only for containers with a CDI annotation naming "
    "a device of an NVIDIA kind or of gpuhook's own (cdi.k8s.io/...: nvidia.com/gpu, "
    "k8s.device-plugin.nvidia.com/gpu, a DRA claim, gpuhook.example/gpu); containers that ask by environment variable or volume mount "
    "get no GPU."))
@OUTPUT
@CONTAINERD_CONFIG
@click.option("--base-spec", metavar="FILE",
              help="containerd: start from this spec, kept as it is, instead of the running containerd's "
                   "default (`ctr oci spec` of the ctr beside it, less what CRI drops without a base spec).")
@click.option("--python", metavar="PATH",
              help="Interpreter the runtime starts (absolute, not a shim) [default: the running one].")
@click.option("--config", "config_path", metavar="FILE",
              help=f"Configuration file the hook reads, passed as --config [default: ${cfg.ENV_VAR}, "
                   f"else the hook reads {cfg.DEFAULT_PATH}].")
@click.option("--front", metavar="PATH", help=(
    f"The native front that runs the hook (native/build.py builds it; the packages install "
    f"{install.PACKAGED_FRONT}): checked with its --protocol, then every registration runs "
    f"`PATH PYTHON -I -S LAUNCHER STAGE` [default: the packaged front for a packaged gpuhook, "
    f"when it is installed and of this version; else the Python command alone]."))
@click.option("--no-front", is_flag=True, help="Register the Python command alone, without the native front.")
@BIN_DIR
@click.option("--data-root", metavar="DIR", help=(
    f"docker: dockerd's data-root, where the hook reads each container's --gpus request "
    f"[default: data-root in {install.DAEMON_JSON}, else {install.DEFAULT_DATA_ROOT}]."))
@HOST_ROOT
@DRY_RUN
def install_command(target, bundle, hooks_dir, annotated, spec_path, containerd_config, base_spec, python,
                    config_path, front, no_front, bin_dir, data_root, host_root, dry_run):
    plan = install.plan_install(target, bundle=bundle, hooks_dir=hooks_dir, spec_path=spec_path,
                                containerd_config=containerd_config, base_spec=base_spec, python=python,
                                config_path=config_path, annotated=annotated, bin_dir=bin_dir, host_root=host_root,
                                data_root=data_root, front=front, no_front=no_front)
    _render(plan, dry_run)


@click.command(name="uninstall", help=(
    "Take back what `gpuhook install TARGET` added: restore a file it replaced from its "
    f"{install.BACKUP_SUFFIX} copy, delete a file it created, remove the lines or hook entries it "
    "added to a shared file. Give the same paths as to install. " + TARGETS_HELP
))
@TARGET
@BUNDLE
@HOOKS_DIR
@OUTPUT
@CONTAINERD_CONFIG
@BIN_DIR
@UNINSTALL_HOST_ROOT
@DRY_RUN
def uninstall_command(target, bundle, hooks_dir, spec_path, containerd_config, bin_dir, host_root, dry_run):
    plan = install.plan_uninstall(target, bundle=bundle, hooks_dir=hooks_dir, spec_path=spec_path,
                                  containerd_config=containerd_config, bin_dir=bin_dir, host_root=host_root)
    _render(plan, dry_run)
