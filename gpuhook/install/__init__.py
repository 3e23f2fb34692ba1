"""`gpuhook install` / `gpuhook uninstall`: register gpuhook with a container runtime.

One module per target: `hooksd` (podman, crio), `containerd`, `bundle` (runc-bundle),
`docker` (the launcher Docker's --gpus runs);
`common` holds what they share. This module picks the target.

Every target registers two stages (`STAGES`): ``prestart`` (inject and check the GPUs) and
``poststop`` (clean up what a stopped container left on them). Targets (docs/packaging.md has
the operator's view):

- ``podman``, ``crio``: ``<hooks-dir>/gpuhook.json`` (prestart) and
  ``<hooks-dir>/gpuhook-poststop.json`` (poststop), oci-hooks 1.0.0 files. One file per stage
  because oci-hooks passes the same args to every stage a file lists, and our args name the
  stage. The admin dir /etc/containers/oci/hooks.d overrides the packaged
  /usr/share/containers/oci/hooks.d file of the same name, so the two never both run.
- ``containerd``: a base runtime spec (the running containerd's default spec, from the ``ctr``
  beside it, without the defaults CRI drops when there is no base spec, plus our hooks) and an
  edit of containerd's config.toml that points CRI's runc runtime at it. The
  edit goes into config.toml itself, not a conf.d drop-in: containerd 1.6 replaces a whole
  plugin section with the imported one, so a drop-in would silently reset Debian's own CRI
  settings (cni bin_dir) to the built-in defaults (checked with ``containerd config dump``).
- ``runc-bundle``: our hooks appended to a bundle's config.json ``hooks.prestart`` and
  ``hooks.poststop``.

Every operation is computed first as an `InstallPlan` (each file's content before and after,
the backups to make or drop): pure data that ``--dry-run`` renders as a unified diff.
`apply` is the only function here that writes.

Backups and uninstall: the first time gpuhook changes a file that does not already carry
gpuhook, the file is copied to ``FILE.gpuhook-bak``. Uninstall returns every file to that
state: a file gpuhook wrote whole is restored from its backup or, if it had none, deleted; a
shared file (containerd's config.toml, a bundle's config.json) loses exactly the lines or
hook entries gpuhook added, and its backup is restored byte for byte and dropped when nothing
else changed since. Directories gpuhook created stay.
"""

import os

from gpuhook.install.bundle import (  # noqa: F401
    _bundle_config,
    _plan_spec_with_hook,
    _plan_spec_without_hook,
    plan_bundle,
    plan_bundle_removal,
)
from gpuhook.install.common import (  # noqa: F401
    ADMIN_HOOKS_DIR,
    BACKUP_SUFFIX,
    CDI_WHEN,
    CONTAINERD_CONFIG,
    CONTAINERD_SPEC,
    DEBIAN_LAUNCHER,
    HOOK_ENV,
    HOOK_FILE_NAME,
    HOOKS_D_FILES,
    MAX_FILE_BYTES,
    PACKAGE_HOOKS_DIR,
    PACKAGED_FRONT,
    POSTSTOP,
    POSTSTOP_FILE_NAME,
    STAGE,
    STAGES,
    SYSTEM_PYTHON,
    TARGETS,
    TIMEOUT_MARGIN,
    FileChange,
    Hook,
    InstallError,
    InstallPlan,
    _copy_atomic,
    _indent_of,
    _parse_json_object,
    _read_bytes,
    _read_text,
    _replace,
    _write_atomic,
    apply,
    check_front,
    check_interpreter,
    has_gpuhook,
    hook_timeout,
    hooks_d_document,
    is_gpuhook_entry,
    launcher_path,
    packaged_hook,
    pick_front,
    render_diff,
    render_json,
    this_installation,
    with_hook,
    without_hook,
)
from gpuhook.install.containerd import (  # noqa: F401
    ADDED_MARK,
    CRI_DROPS,
    CRI_PLUGIN,
    CRI_RUNTIME_PLUGIN_V3,
    RUNC_RUNTIME_TYPE,
    RUNC_TABLE,
    RUNC_TABLE_PATH,
    RUNC_TABLE_PATHS,
    WAS_MARK,
    _containerd_notes,
    _manual_hint,
    _parse_toml,
    _runc_table,
    _set_in,
    _table_header,
    cdi_specs_running_gpuhook,
    config_version,
    plan_containerd,
    plan_containerd_removal,
    runc_table_name,
    set_base_runtime_spec,
    unset_base_runtime_spec,
    without_cri_drops,
)
from gpuhook.install.docker import (  # noqa: F401
    DAEMON_JSON,
    DEFAULT_BIN_DIR,
    DEFAULT_DATA_ROOT,
    DOCKER_HOOK_NAME,
    launcher_text,
    plan_docker,
    plan_docker_removal,
)
from gpuhook.install import hostroot
from gpuhook.install.hooksd import (  # noqa: F401
    _hooks_d_is_ours,
    _runtime_notes,
    hooks_d_paths,
    plan_hooks_d,
    plan_hooks_d_removal,
)

# --- entry points -----------------------------------------------------------------------

# Options that only make sense for some targets, so a misplaced one is an error, not ignored.
_OPTION_TARGETS = {
    "hooks_dir": ("--hooks-dir", ("podman", "crio")),
    "annotated": ("--annotated", ("podman", "crio")),
    "spec_path": ("--output", ("containerd",)),
    "containerd_config": ("--containerd-config", ("containerd",)),
    "base_spec": ("--base-spec", ("containerd",)),
    "bundle": ("BUNDLE", ("runc-bundle",)),
    "bin_dir": ("--bin-dir", ("docker",)),
    "data_root": ("--data-root", ("docker",)),
    "host_root": ("--host-root", ("podman", "crio", "containerd")),
}


def _plan_on_node(target: str, root: str, hooks_dir, spec_path, containerd_config, base_spec, python, config_path,
                  annotated) -> InstallPlan:
    """install --host-root: the package copied to the node, then the runtime's registration
    at the node's paths under `root` (gpuhook.install.hostroot)."""
    hook = hostroot.node_hook(root, config_path, python)
    if target in ("podman", "crio"):
        given = hooks_dir or default_hooks_dir(target)
        plan = plan_hooks_d(target, hostroot.host_path(root, given), hook, annotated,
                            runtime_dir=os.path.normpath("/" + given.lstrip("/")))
    else:
        plan = plan_containerd(hook, spec_path or CONTAINERD_SPEC, containerd_config or CONTAINERD_CONFIG, base_spec,
                               node_root=root)
    # The package first: a registration must never name a launcher that is not there yet.
    return InstallPlan(tuple(hostroot.copy_changes(root)) + plan.changes, plan.notes)


def default_hooks_dir(target: str) -> str:
    """Where `install podman`/`crio` write without --hooks-dir: a dir the runtime reads by
    default. podman reads the admin dir (which overrides the packaged one); CRI-O reads only
    crio.conf's hooks_dir, whose default is the packaged dir."""
    return PACKAGE_HOOKS_DIR if target == "crio" else ADMIN_HOOKS_DIR


def _check_options(target: str, given: dict) -> None:
    if target not in TARGETS:
        raise InstallError(f"unknown target {target!r} (one of {', '.join(TARGETS)})")
    for name, value in given.items():
        if value in (None, False):
            continue
        option, targets = _OPTION_TARGETS[name]
        if target not in targets:
            raise InstallError(f"{option} does not apply to {target} (only to {', '.join(targets)})")


def plan_install(target: str, bundle: str | None = None, hooks_dir: str | None = None,
                 spec_path: str | None = None, containerd_config: str | None = None,
                 base_spec: str | None = None, python: str | None = None, config_path: str | None = None,
                 annotated: bool = False, environ: dict | None = None, bin_dir: str | None = None,
                 host_root: str | None = None, data_root: str | None = None, front: str | None = None,
                 no_front: bool = False) -> InstallPlan:
    """What `gpuhook install TARGET` would change, for the gpuhook running this code (or,
    with `host_root`, for a copy of it on the node whose / is mounted there)."""
    _check_options(target, {"bundle": bundle, "hooks_dir": hooks_dir, "spec_path": spec_path,
                            "containerd_config": containerd_config, "base_spec": base_spec,
                            "annotated": annotated, "bin_dir": bin_dir, "host_root": host_root,
                            "data_root": data_root})
    if target == "runc-bundle":
        _bundle_config(bundle)  # a usage error comes before any other check
    if host_root:
        if front:
            raise InstallError("--front does not apply with --host-root (the node's copy runs on its Python)")
        return _plan_on_node(target, os.path.abspath(host_root), hooks_dir, spec_path, containerd_config, base_spec,
                             python, config_path, annotated)
    hook = this_installation(python, config_path, environ, front, no_front)
    if target in ("podman", "crio"):
        return plan_hooks_d(target, hooks_dir or default_hooks_dir(target), hook, annotated)
    if target == "containerd":
        return plan_containerd(hook, spec_path or CONTAINERD_SPEC, containerd_config or CONTAINERD_CONFIG,
                               base_spec)
    if target == "docker":
        return plan_docker(hook, bin_dir or DEFAULT_BIN_DIR, data_root)
    return plan_bundle(bundle, hook)


def _node_registrations(root: str) -> list:
    """The node paths where `install --host-root` registers the copied package: the hooks.d
    files of podman and CRI-O and containerd's base spec."""
    found = [CONTAINERD_SPEC]
    for directory in (ADMIN_HOOKS_DIR, PACKAGE_HOOKS_DIR):
        try:
            names = sorted(os.listdir(hostroot.host_path(root, directory)))
        except OSError:
            continue
        found += [f"{directory}/{name}" for name in names if name.endswith(".json")]
    return found


def plan_uninstall(target: str, bundle: str | None = None, hooks_dir: str | None = None,
                   spec_path: str | None = None, containerd_config: str | None = None,
                   bin_dir: str | None = None, host_root: str | None = None) -> InstallPlan:
    """What `gpuhook uninstall TARGET` would change."""
    _check_options(target, {"bundle": bundle, "hooks_dir": hooks_dir, "spec_path": spec_path,
                            "containerd_config": containerd_config, "bin_dir": bin_dir, "host_root": host_root})
    if host_root:
        root = os.path.abspath(host_root)
        if target in ("podman", "crio"):
            given = hooks_dir or default_hooks_dir(target)
            plan = plan_hooks_d_removal(target, hostroot.host_path(root, given),
                                        runtime_dir=os.path.normpath("/" + given.lstrip("/")))
        else:
            node_config = containerd_config or CONTAINERD_CONFIG
            plan = plan_containerd_removal(hostroot.host_path(root, spec_path or CONTAINERD_SPEC),
                                           hostroot.host_path(root, node_config),
                                           node_config=os.path.normpath("/" + node_config.lstrip("/")))
        users = hostroot.lib_users(root, _node_registrations(root), plan.changes)
        if users:
            return InstallPlan(plan.changes, plan.notes + (
                f"{hostroot.HOST_LIB} kept: still used by {', '.join(users)} (uninstall that too to remove it)",))
        return InstallPlan(plan.changes + tuple(hostroot.removal_changes(root)), plan.notes)
    if target in ("podman", "crio"):
        return plan_hooks_d_removal(target, hooks_dir or default_hooks_dir(target))
    if target == "containerd":
        return plan_containerd_removal(spec_path or CONTAINERD_SPEC, containerd_config or CONTAINERD_CONFIG)
    if target == "docker":
        return plan_docker_removal(bin_dir or DEFAULT_BIN_DIR)
    return plan_bundle_removal(bundle)


