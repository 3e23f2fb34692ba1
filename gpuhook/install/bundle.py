"""Target runc-bundle, and the JSON spec edits containerd's base spec shares with it."""

import json
import os

from gpuhook.install.common import (
    BACKUP_SUFFIX,
    FileChange,
    Hook,
    InstallError,
    InstallPlan,
    _parse_json_object,
    _read_text,
    has_gpuhook,
    render_json,
    with_hook,
    without_hook,
)

# --- JSON specs: runc bundles and containerd's base spec --------------------------------


def _plan_spec_with_hook(path: str, old: str | None, base: dict, style: str | None, entries: dict) -> FileChange:
    new_doc = with_hook(base, entries, path)
    if old is not None and _parse_json_object(old, path) == new_doc:
        return FileChange(path, old, old)
    backup = None
    if old is not None and not has_gpuhook(_parse_json_object(old, path)):
        backup = path + BACKUP_SUFFIX
    return FileChange(path, old, render_json(new_doc, style), backup=backup)


def _plan_spec_without_hook(path: str, old: str, delete_without_backup: bool) -> tuple[FileChange, list]:
    """Remove gpuhook's entries from the spec at `path`; restore the backup's exact bytes
    when the only differences from it were ours."""
    doc = _parse_json_object(old, path)
    backup = path + BACKUP_SUFFIX
    saved = _read_text(backup)
    if saved is None:
        if delete_without_backup:
            return FileChange(path, old, None), []
        return FileChange(path, old, render_json(without_hook(doc), old)), []
    try:
        saved_doc = json.loads(saved)
    except ValueError:
        saved_doc = None
    stripped = without_hook(doc)
    if isinstance(saved_doc, dict) and without_hook(saved_doc) == stripped:
        return FileChange(path, old, saved, drop_backup=backup), []
    note = f"{path} changed since gpuhook install; removed only gpuhook's hook and kept {backup}"
    return FileChange(path, old, render_json(stripped, old)), [note]


def plan_bundle(bundle: str, hook: Hook) -> InstallPlan:
    """Add gpuhook's prestart and poststop hooks to a runc bundle's config.json."""
    path = _bundle_config(bundle)
    old = _read_text(path)
    change = _plan_spec_with_hook(path, old, _parse_json_object(old, path), old, hook.entries())
    return InstallPlan((change,), ("runc reads config.json when the container is created: "
                                   "containers created from now on run gpuhook",))


def plan_bundle_removal(bundle: str) -> InstallPlan:
    """Remove gpuhook's hooks (every stage in `STAGES`) from a runc bundle's config.json."""
    path = _bundle_config(bundle)
    old = _read_text(path)
    if not has_gpuhook(_parse_json_object(old, path)):
        return InstallPlan((), (f"{path} has no gpuhook hook: nothing to remove",))
    change, notes = _plan_spec_without_hook(path, old, delete_without_backup=False)
    return InstallPlan((change,), tuple(notes))


def _bundle_config(bundle: str | None) -> str:
    if not bundle:
        raise InstallError("runc-bundle needs the bundle directory: gpuhook install runc-bundle BUNDLE")
    if not os.path.isdir(bundle):
        raise InstallError(f"bundle {bundle} is not a directory")
    path = os.path.join(os.path.abspath(bundle), "config.json")
    if not os.path.exists(path):
        raise InstallError(f"bundle {bundle} has no config.json", "create it with `runc spec`")
    return path


