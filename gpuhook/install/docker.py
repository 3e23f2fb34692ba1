"""Target docker: gpuhook behind Docker's `--gpus` flag.

dockerd implements `--gpus` itself: at start-up it looks up `nvidia-container-runtime-hook`
on its PATH and, only if found, accepts `--gpus`; for such a container it appends
NVIDIA_VISIBLE_DEVICES (and NVIDIA_DRIVER_CAPABILITIES) from the flag to the container's
environment, after the image's, and registers `<that path> prestart` as a prestart hook with
no environment at all (docs/docker.md). So `gpuhook install docker` writes a small launcher
under that name into a directory on dockerd's PATH: it gives the hook a clean environment and
gpuhook's own interpreter flags and `--config`. Without `--gpus` Docker registers no hook,
so an image's own NVIDIA_VISIBLE_DEVICES=all gets nothing.
"""

import os

from gpuhook.install.common import BACKUP_SUFFIX, HOOK_ENV, FileChange, Hook, InstallError, InstallPlan, _read_text

DOCKER_HOOK_NAME = "nvidia-container-runtime-hook"
DEFAULT_BIN_DIR = "/usr/local/bin"  # on systemd's default PATH, before /usr/bin (the toolkit's)
DAEMON_JSON = "/etc/docker/daemon.json"
DEFAULT_DATA_ROOT = "/var/lib/docker"
LAUNCHER_MARK = "# gpuhook install docker:"


def launcher_path(bin_dir: str) -> str:
    return os.path.join(bin_dir, DOCKER_HOOK_NAME)


def data_root(daemon_json: str = DAEMON_JSON) -> str:
    """dockerd's data-root: daemon.json's `data-root` (or the older `graph`), else Docker's
    default. A flag on dockerd's command line is not seen: pass --data-root then."""
    import json

    text = _read_text(daemon_json)
    if text is None:
        return DEFAULT_DATA_ROOT
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise InstallError(f"{daemon_json}: not valid JSON: {err}", "give dockerd's data root with --data-root DIR") \
            from None
    value = doc.get("data-root") or doc.get("graph") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value.startswith("/") else DEFAULT_DATA_ROOT


def launcher_text(hook: Hook, docker_root: str = DEFAULT_DATA_ROOT) -> str:
    """The launcher: a POSIX shell script (dockerd execs the file by path)."""
    config = f" --config '{hook.config}'" if hook.config else ""
    front = f"'{hook.front}' " if hook.front else ""  # the native front execs the Python command
    for part in (hook.python, hook.launcher, hook.config or "", docker_root, hook.front or ""):
        if "'" in part:
            raise InstallError(f"{part[:120]!r}: a path with a quote cannot go into the launcher")
    env = " ".join(HOOK_ENV)
    return f"""#!/bin/sh
{LAUNCHER_MARK} gpuhook as the hook Docker runs for --gpus (docs/docker.md).
# dockerd runs it as `{DOCKER_HOOK_NAME} prestart`, with the OCI state on stdin and its own
# environment; gpuhook gets a clean one, plus dockerd's data root, where it reads the
# container's --gpus request (the image's NVIDIA_VISIBLE_DEVICES never counts).
case "$1" in
  prestart|createRuntime|poststop) ;;
  *) echo "gpuhook: {DOCKER_HOOK_NAME}: unknown stage '$1' (prestart, createRuntime or poststop)" >&2; exit 2 ;;
esac
exec /usr/bin/env -i {env} GPUHOOK_DOCKER_DATA_ROOT='{docker_root}' {front}'{hook.python}' -I -S '{hook.launcher}' "$1"{config}
"""


def is_ours(text: str | None) -> bool:
    return text is not None and LAUNCHER_MARK in text


def plan_docker(hook: Hook, bin_dir: str = DEFAULT_BIN_DIR, docker_root: str | None = None) -> InstallPlan:
    path = launcher_path(os.path.abspath(bin_dir))
    old = _read_text(path)
    if docker_root is not None and not os.path.isabs(docker_root):
        raise InstallError(f"--data-root {docker_root[:120]}: give an absolute path")
    docker_root = os.path.normpath(docker_root) if docker_root else data_root()
    new = launcher_text(hook, docker_root)
    backup = path + BACKUP_SUFFIX if old is not None and old != new and not is_ours(old) else None
    notes = (f"restart dockerd (systemctl restart docker): it looks {DOCKER_HOOK_NAME} up on its PATH once, at "
             f"start; {os.path.dirname(path)} must be on that PATH ahead of /usr/bin",
             "docker run --gpus all | --gpus device=1,2 | --gpus '\"device=GPU-...\"' then gives those GPUs, "
             "checked and cleaned; Docker grants through NVIDIA_VISIBLE_DEVICES, so keep "
             "accept-env-when-unprivileged = true in the config the launcher names",
             f"the hook reads each container's --gpus request from dockerd's data root {docker_root} "
             "(containers/ID/hostconfig.json); if dockerd runs with another --data-root, install again with "
             "--data-root DIR",
             "dockerd registers no poststop hook: after each GPU start gpuhook leaves a waiter that runs its "
             "poststop when the container's init exits")
    if backup:
        notes += (f"{path} is not gpuhook's (NVIDIA's toolkit?): it is backed up to {backup} and restored on "
                  "uninstall",)
    return InstallPlan((FileChange(path, old, new, backup=backup, mode=0o755),), notes)


def plan_docker_removal(bin_dir: str = DEFAULT_BIN_DIR) -> InstallPlan:
    path = launcher_path(os.path.abspath(bin_dir))
    old = _read_text(path)
    if old is None:
        return InstallPlan((), (f"{path} does not exist: nothing to remove",))
    if not is_ours(old):
        raise InstallError(f"{path} is not gpuhook's launcher; leaving it alone")
    backup = path + BACKUP_SUFFIX
    saved = _read_text(backup)
    return InstallPlan((FileChange(path, old, saved, drop_backup=backup if saved is not None else None),),
                       ("restart dockerd (systemctl restart docker) so it forgets the hook",))
