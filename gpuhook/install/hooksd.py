"""Targets podman and crio: one oci-hooks 1.0.0 file per stage in a hooks dir."""

import json
import os

from gpuhook.install.common import (
    ADMIN_HOOKS_DIR,
    BACKUP_SUFFIX,
    HOOKS_D_FILES,
    PACKAGE_HOOKS_DIR,
    FileChange,
    Hook,
    InstallError,
    InstallPlan,
    _read_text,
    hooks_d_document,
    is_gpuhook_entry,
    render_json,
)


def _hooks_d_is_ours(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and is_gpuhook_entry(doc.get("hook"))


def _runtime_notes(target: str, paths: list, package_hooks_dir: str, installing: bool,
                   runtime_dir: str | None = None) -> list:
    """What the runtime does with the hooks.d files at `paths` (all in one dir, which the
    runtime sees as `runtime_dir` when given: install --host-root)."""
    notes = []
    written = os.path.dirname(paths[0])
    directory = runtime_dir or written
    # The runtimes read both default dirs, the admin one overriding by file name.
    if written == ADMIN_HOOKS_DIR:
        for path in paths:
            packaged = os.path.join(package_hooks_dir, os.path.basename(path))
            if os.path.exists(packaged):
                notes.append(f"{path} overrides the packaged {packaged} (same file name)" if installing else
                             f"the packaged {packaged} still registers gpuhook (remove the package to stop it)")
    if target == "crio" and directory != package_hooks_dir:
        notes.append("CRI-O reads hooks only from the dirs in crio.conf's hooks_dir (default "
                     f"{package_hooks_dir}); make sure {directory} is listed, then restart CRI-O")
    elif target == "crio" and installing:
        notes.append(f"CRI-O reads {directory} by default (crio.conf hooks_dir); it watches the dir, nothing "
                     "to restart")
    elif installing and directory not in (ADMIN_HOOKS_DIR, package_hooks_dir):
        notes.append(f"podman reads hooks only from {ADMIN_HOOKS_DIR} and {package_hooks_dir} unless given "
                     f"another dir: run podman with --hooks-dir {directory}, or list {directory} in hooks_dir "
                     "in containers.conf")
    elif installing:
        notes.append("podman reads the hooks dir at every container start; nothing to restart")
    return notes


def hooks_d_paths(hooks_dir: str) -> dict:
    """Stage -> the hooks.d file gpuhook install writes for it in `hooks_dir`."""
    directory = os.path.abspath(hooks_dir)
    return {stage: os.path.join(directory, name) for stage, name in HOOKS_D_FILES.items()}


def plan_hooks_d(target: str, hooks_dir: str, hook: Hook, annotated: bool = False,
                 package_hooks_dir: str = PACKAGE_HOOKS_DIR, runtime_dir: str | None = None) -> InstallPlan:
    """Write <hooks_dir>/gpuhook.json (prestart) and gpuhook-poststop.json (poststop) for
    podman or CRI-O; each file that is not gpuhook's is backed up first. `runtime_dir` is
    the dir as the runtime sees it, where that is not `hooks_dir` (install --host-root)."""
    changes, notes = [], []
    paths = hooks_d_paths(hooks_dir)
    for stage, path in paths.items():
        old = _read_text(path)
        new = render_json(hooks_d_document(hook, annotated, stage))
        backup = path + BACKUP_SUFFIX if old is not None and old != new and not _hooks_d_is_ours(old) else None
        changes.append(FileChange(path, old, new, backup=backup))
        if old is None and os.path.exists(path + BACKUP_SUFFIX):
            notes.append(f"{path + BACKUP_SUFFIX} is left from an earlier install; uninstall will restore it")
    notes = _runtime_notes(target, list(paths.values()), package_hooks_dir, installing=True,
                           runtime_dir=runtime_dir) + notes
    return InstallPlan(tuple(changes), tuple(notes))


def plan_hooks_d_removal(target: str, hooks_dir: str,
                         package_hooks_dir: str = PACKAGE_HOOKS_DIR, runtime_dir: str | None = None) -> InstallPlan:
    """Take back <hooks_dir>/gpuhook.json and gpuhook-poststop.json: restore the file each
    replaced, or delete it. A file of those names that does not run gpuhook stops the whole
    uninstall before anything changes; an absent one (an install older than the poststop
    file) is only noted."""
    changes, notes, present = [], [], []
    for path in hooks_d_paths(hooks_dir).values():
        old = _read_text(path)
        if old is None:
            notes.append(f"{path} does not exist: nothing to remove")
            continue
        if not _hooks_d_is_ours(old):
            raise InstallError(f"{path} does not run gpuhook; leaving it alone")
        backup = path + BACKUP_SUFFIX
        saved = _read_text(backup)
        changes.append(FileChange(path, old, saved, drop_backup=backup if saved is not None else None))
        present.append(path)
    if present:
        notes += _runtime_notes(target, present, package_hooks_dir, installing=False, runtime_dir=runtime_dir)
    return InstallPlan(tuple(changes), tuple(notes))


