"""Target containerd: a base runtime spec with gpuhook's hooks, and config.toml's CRI runc
runtime pointed at it (config version 2, containerd 1.5 to 1.7, and 3, containerd 2.x)."""

import copy
import json
import os
import subprocess

from gpuhook.install.bundle import _plan_spec_with_hook, _plan_spec_without_hook
from gpuhook.install.common import (
    BACKUP_SUFFIX,
    CONTAINERD_CONFIG,
    CONTAINERD_SPEC,
    FileChange,
    Hook,
    InstallError,
    InstallPlan,
    _parse_json_object,
    _read_text,
    has_gpuhook,
)

CRI_PLUGIN = "io.containerd.grpc.v1.cri"
# containerd 2.x (config version 3) split CRI; its runtimes live in the runtime plugin.
CRI_RUNTIME_PLUGIN_V3 = "io.containerd.cri.v1.runtime"
RUNC_TABLE_PATHS = {2: ("plugins", CRI_PLUGIN, "containerd", "runtimes", "runc"),
                    3: ("plugins", CRI_RUNTIME_PLUGIN_V3, "containerd", "runtimes", "runc")}
RUNC_TABLE_PATH = RUNC_TABLE_PATHS[2]


def runc_table_name(version: int = 2) -> str:
    path = RUNC_TABLE_PATHS[version]
    return f'plugins."{path[1]}".containerd.runtimes.runc'


RUNC_TABLE = runc_table_name(2)
RUNC_RUNTIME_TYPE = "io.containerd.runc.v2"
# Marks on the config.toml lines gpuhook adds or changes, so uninstall can take back exactly
# those. A changed line keeps its original after WAS_MARK.
ADDED_MARK = "# added by gpuhook install"
WAS_MARK = "# changed by gpuhook install, was: "




# --- containerd -------------------------------------------------------------------------


def default_spec_from_ctr(ctr: str = "ctr") -> str:
    """containerd's default runtime spec, as `ctr oci spec` prints it."""
    try:
        done = subprocess.run([ctr, "oci", "spec"], capture_output=True, timeout=60, cwd="/",
                              stdin=subprocess.DEVNULL, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    except FileNotFoundError:
        raise InstallError(f"{ctr} is not installed", "install containerd, or give a spec with --base-spec") from None
    except (OSError, subprocess.TimeoutExpired) as err:
        raise InstallError(f"{ctr} oci spec did not run: {err}") from err
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise InstallError(f"{ctr} oci spec failed: {tail[0]}")
    return done.stdout.decode()


def _parse_toml(text: str, where: str) -> dict:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InstallError(f"{where}: invalid TOML: {err}") from err


def _runc_table(doc: dict, version: int = 2) -> dict | None:
    node = doc
    for key in RUNC_TABLE_PATHS[version]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node if isinstance(node, dict) else None


def _table_header(line: str) -> tuple | None:
    """The key path of a TOML table header line (`[a."b".c]  # x`), None for other lines."""
    text = line.strip()
    if not text.startswith("[") or text.startswith("[["):
        return None
    import tomllib

    try:
        node = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    path = []
    while isinstance(node, dict) and len(node) == 1:
        key, node = next(iter(node.items()))
        path.append(key)
    return tuple(path)


def _set_in(doc: dict, path: tuple, key: str, value) -> None:
    for part in path:
        doc = doc.setdefault(part, {})
    doc[key] = value


def _manual_hint(spec_path: str, version: int = 2) -> str:
    return (f"add it by hand under [{runc_table_name(version)}]: runtime_type = \"{RUNC_RUNTIME_TYPE}\" "
            f"and base_runtime_spec = {json.dumps(spec_path)}")


def set_base_runtime_spec(text: str, spec_path: str, where: str) -> str:
    """containerd config.toml text with CRI's runc runtime using `spec_path` as base spec.

    Lines are added or changed textually (keeping the user's comments and layout) and marked;
    the result is parsed back and must differ from the original in exactly that setting.
    """
    doc = _parse_toml(text, where)
    version = doc.get("version", 1) if doc else 2
    if isinstance(version, bool) or not isinstance(version, int) or version not in RUNC_TABLE_PATHS:
        raise InstallError(f"{where}: containerd config version {str(version)[:20]}: gpuhook edits version 2 "
                           "(containerd 1.5 to 1.7) and version 3 (containerd 2.x)", _manual_hint(spec_path))
    table_path, table_name = RUNC_TABLE_PATHS[version], runc_table_name(version)
    runc = _runc_table(doc, version)
    current = runc.get("base_runtime_spec") if runc else None
    if current == spec_path:
        return text
    if current:
        raise InstallError(f"{where}: CRI's runc runtime already uses base_runtime_spec = {json.dumps(current)}",
                           f"add gpuhook's hook to that spec instead: gpuhook install containerd --output {current}")
    expected = copy.deepcopy(doc)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    value = f"base_runtime_spec = {json.dumps(spec_path)}"
    if not doc:
        # Empty or comments only: without `version = 2` containerd 1.x reads version 1.
        lines.insert(0, f"version = 2  {ADDED_MARK}\n")
        expected["version"] = 2
    header = next((i for i, line in enumerate(lines) if _table_header(line) == table_path), None)
    if header is not None:
        end = next((i for i in range(header + 1, len(lines)) if _table_header(lines[i]) is not None), len(lines))
        indent = lines[header][: len(lines[header]) - len(lines[header].lstrip())] + "  "
        existing = next((i for i in range(header + 1, end)
                         if lines[i].lstrip().startswith("base_runtime_spec") and "=" in lines[i]), None)
        if existing is not None:
            own = lines[existing][: len(lines[existing]) - len(lines[existing].lstrip())]
            lines[existing] = f"{own}{value}  {WAS_MARK}{lines[existing].strip()}\n"
        else:
            lines.insert(header + 1, f"{indent}{value}  {ADDED_MARK}\n")
    else:
        lines.append(f"# CRI's runc containers start from a spec that runs gpuhook  {ADDED_MARK}\n")
        lines.append(f"[{table_name}]  {ADDED_MARK}\n")
        if not (runc and "runtime_type" in runc):
            # Defining the table replaces containerd's default runc entry, runtime type included.
            lines.append(f"  runtime_type = \"{RUNC_RUNTIME_TYPE}\"  {ADDED_MARK}\n")
            _set_in(expected, table_path, "runtime_type", RUNC_RUNTIME_TYPE)
        lines.append(f"  {value}  {ADDED_MARK}\n")
    _set_in(expected, table_path, "base_runtime_spec", spec_path)
    new = "".join(lines)
    try:
        result = _parse_toml(new, where)
    except InstallError:
        result = None
    if result != expected:
        raise InstallError(f"{where}: cannot add base_runtime_spec safely (the runc runtime is defined in "
                           "a form gpuhook does not edit)", _manual_hint(spec_path, version))
    return new


def unset_base_runtime_spec(text: str) -> str:
    """`text` without the lines gpuhook added, and with the lines it changed restored."""
    out = []
    for line in text.splitlines(keepends=True):
        if WAS_MARK in line:
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + line.split(WAS_MARK, 1)[1].rstrip("\r\n") + "\n")
        elif line.rstrip().endswith(ADDED_MARK):
            continue
        else:
            out.append(line)
    return "".join(out)


def _containerd_notes(config_path: str, installing: bool) -> tuple:
    if installing:
        return (f"restart containerd to load {config_path} (systemctl restart containerd); the base spec "
                "applies to containers started through CRI (Kubernetes)",
                "ctr and nerdctl do not use base_runtime_spec: start containers with `ctr run --config SPEC` "
                "or register the hook in their spec")
    return (f"restart containerd to load {config_path} (systemctl restart containerd)",)


def plan_containerd(hook: Hook, spec_path: str = CONTAINERD_SPEC, config_path: str = CONTAINERD_CONFIG,
                    base_spec: str | None = None, ctr: str = "ctr", node_root: str = "") -> InstallPlan:
    """Write the base spec (default spec + our prestart and poststop hooks) and point
    config.toml's runc runtime at it. With `node_root` (install --host-root), both files are
    under it while config.toml names the spec by the node's own path."""
    spec_value = os.path.abspath(spec_path)
    spec_path = os.path.join(node_root, spec_value.lstrip("/")) if node_root else spec_value
    config_path = os.path.abspath(os.path.join(node_root, config_path.lstrip("/")) if node_root else config_path)
    old_spec = _read_text(spec_path)
    if base_spec is not None:
        style = _read_text(base_spec)
        if style is None:
            raise InstallError(f"base spec {base_spec} does not exist")
        where = base_spec
    elif old_spec is not None:
        style, where = old_spec, spec_path  # an existing spec gets our hook added
    else:
        style, where = default_spec_from_ctr(ctr), f"{ctr} oci spec"
    spec_change = _plan_spec_with_hook(spec_path, old_spec, _parse_json_object(style, where), style,
                                       hook.entries())
    old_config = _read_text(config_path)
    new_config = set_base_runtime_spec(old_config or "", spec_value, config_path)
    backup = None
    if old_config is not None and new_config != old_config and ADDED_MARK not in old_config \
            and WAS_MARK not in old_config:
        backup = config_path + BACKUP_SUFFIX
    # The spec first: the config must never point at a file that is not there yet.
    return InstallPlan((spec_change, FileChange(config_path, old_config, new_config, backup=backup)),
                       _containerd_notes(config_path, installing=True))


def plan_containerd_removal(spec_path: str = CONTAINERD_SPEC,
                            config_path: str = CONTAINERD_CONFIG) -> InstallPlan:
    """Take back the config.toml lines and the base spec that plan_containerd added."""
    spec_path = os.path.abspath(spec_path)
    config_path = os.path.abspath(config_path)
    changes, notes = [], []
    old_config = _read_text(config_path)
    if old_config is not None and (ADDED_MARK in old_config or WAS_MARK in old_config):
        new_config = unset_base_runtime_spec(old_config)
        backup = config_path + BACKUP_SUFFIX
        saved = _read_text(backup)
        drop = None
        if saved is not None and new_config.rstrip("\n") == saved.rstrip("\n"):
            new_config, drop = saved, backup
        elif saved is None and not new_config.strip():
            new_config = None  # gpuhook created the file
        elif saved is not None:
            notes.append(f"{config_path} changed since gpuhook install; removed only gpuhook's lines and kept {backup}")
        changes.append(FileChange(config_path, old_config, new_config, drop_backup=drop))
    old_spec = _read_text(spec_path)
    if old_spec is not None and has_gpuhook(_parse_json_object(old_spec, spec_path)):
        change, spec_notes = _plan_spec_without_hook(spec_path, old_spec, delete_without_backup=True)
        changes.append(change)
        notes += spec_notes
    if not changes:
        return InstallPlan((), (f"neither {config_path} nor {spec_path} carries gpuhook: nothing to remove",))
    return InstallPlan(tuple(changes), tuple(notes) + _containerd_notes(config_path, installing=False))


