"""Target containerd: a base runtime spec with gpuhook's hooks, and config.toml's CRI runc
runtime pointed at it (config version 1 and 2: containerd 1.x; 3 and 4: containerd 2.x).

The base spec is containerd's own default for the release that runs (gpuhook.install.daemon)
without the settings CRI drops from that default when a runtime has no base spec, plus
gpuhook's hooks: with it, a CRI container gets exactly what it would get without it, and
the hooks (docs/packaging.md, "containerd")."""

import copy
import json
import os

from gpuhook.install import daemon
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
# containerd 2.x (config version 3, and 4 since 2.3) split CRI; its runtimes live in the
# runtime plugin. Version 1 names plugins by their short id (containerd migrates "cri" to
# io.containerd.grpc.v1.cri: cmd/containerd/server/config/config.go, v1Migrate).
CRI_RUNTIME_PLUGIN_V3 = "io.containerd.cri.v1.runtime"
RUNC_TABLE_PATHS = {1: ("plugins", "cri", "containerd", "runtimes", "runc"),
                    2: ("plugins", CRI_PLUGIN, "containerd", "runtimes", "runc"),
                    3: ("plugins", CRI_RUNTIME_PLUGIN_V3, "containerd", "runtimes", "runc"),
                    4: ("plugins", CRI_RUNTIME_PLUGIN_V3, "containerd", "runtimes", "runc")}
RUNC_TABLE_PATH = RUNC_TABLE_PATHS[2]
# What an empty config.toml gets: version 2 for containerd 1.x (which reads a file without
# `version` as version 1), version 3 for 2.x (which still migrates 2, with a warning).
EMPTY_CONFIG_VERSION = {1: 2, 2: 3}


def runc_table_name(version: int = 2) -> str:
    path = RUNC_TABLE_PATHS[version]
    return ".".join(f'"{part}"' if "." in part else part for part in path)


RUNC_TABLE = runc_table_name(2)
RUNC_RUNTIME_TYPE = "io.containerd.runc.v2"
# Marks on the config.toml lines gpuhook adds or changes, so uninstall can take back exactly
# those. A changed line keeps its original after WAS_MARK.
ADDED_MARK = "# added by gpuhook install"
WAS_MARK = "# changed by gpuhook install, was: "
# What containerd's CRI removes from the default spec it generates when the runtime has no
# base_runtime_spec, and keeps from a base spec: WithoutDefaultSecuritySettings
# (internal/cri/opts/spec_opts.go; pkg/cri/opts/spec_linux.go in 1.x), applied only
# `if ociRuntime.BaseRuntimeSpec == ""` (internal/cri/server/container_create.go
# buildLinuxSpec; pkg/cri/server/container_create_linux.go in 1.x). `ctr oci spec` prints the
# generated default, whose RLIMIT_NOFILE 1024/1024 would otherwise cap every pod.
CRI_DROPS = (("process", "rlimits"), ("process", "apparmorProfile"), ("linux", "seccomp"))


# --- containerd -------------------------------------------------------------------------


def without_cri_drops(spec: dict) -> tuple[dict, list]:
    """`spec` (containerd's generated default) without what CRI drops from it when there is
    no base spec, and the dotted names of what was there."""
    new = copy.deepcopy(spec)
    dropped = []
    for section, key in CRI_DROPS:
        table = new.get(section)
        if isinstance(table, dict) and key in table:
            del table[key]
            dropped.append(f"{section}.{key}")
    return new, dropped


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


def configured_base_spec(text: str) -> str | None:
    """The base spec CRI's runc runtime uses, as containerd reads its config.toml: from the
    runc table of the file's config version, so a commented-out line, another runtime's table
    or a trailing comment is never taken for it. None when there is none, or for a file that
    is not valid TOML of a version gpuhook knows (`gpuhook doctor` reads it this way)."""
    try:
        doc = _parse_toml(text, "config.toml")
    except InstallError:
        return None
    version = doc.get("version", 1)
    if type(version) is not int or version not in RUNC_TABLE_PATHS:
        return None
    runc = _runc_table(doc, version)
    path = runc.get("base_runtime_spec") if runc else None
    return path if isinstance(path, str) and path.startswith("/") else None


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
    return (f"add it by hand under [{runc_table_name(version)}] (config version {version}): "
            f"runtime_type = \"{RUNC_RUNTIME_TYPE}\" and base_runtime_spec = {json.dumps(spec_path)}")


def config_version(doc: dict, where: str, spec_path: str, empty_version: int = 2) -> int:
    """The config version of a parsed config.toml: its `version` (1 when absent, as containerd
    reads it), or `empty_version` for a file that sets nothing. Raises InstallError, with
    what to add by hand, for a version gpuhook does not know."""
    if not doc:
        return empty_version
    version = doc.get("version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version in RUNC_TABLE_PATHS:
        return version
    known = ", ".join(str(v) for v in RUNC_TABLE_PATHS)
    if isinstance(version, int) and not isinstance(version, bool) and version > max(RUNC_TABLE_PATHS):
        hint = (f"add base_runtime_spec = {json.dumps(spec_path)} by hand to CRI's runc runtime table of config "
                f"version {version} (see `containerd config default`)")
    else:
        hint = "`version` must be a number: containerd reads the file as version 1 otherwise"
    raise InstallError(f"{where}: containerd config version {str(version)[:20]}: gpuhook edits versions {known}",
                       hint)


def set_base_runtime_spec(text: str, spec_path: str, where: str, empty_version: int = 2) -> str:
    """containerd config.toml text with CRI's runc runtime using `spec_path` as base spec, in
    the runc table of the file's config version (an empty file gets `empty_version`).

    Lines are added or changed textually (keeping the user's comments and layout) and marked;
    the result is parsed back and must differ from the original in exactly that setting.
    """
    doc = _parse_toml(text, where)
    version = config_version(doc, where, spec_path, empty_version)
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
        # Empty or comments only: without `version` containerd reads version 1.
        lines.insert(0, f"version = {version}  {ADDED_MARK}\n")
        expected["version"] = version
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
    """What to restart: `config_path` as the node's containerd names it. The system's unit
    reads the default config; a config elsewhere belongs to another daemon (containerd
    --config FILE), which `systemctl restart containerd` would not touch."""
    if config_path == CONTAINERD_CONFIG:
        restart = f"restart containerd to load {config_path} (systemctl restart containerd)"
    else:
        restart = f"restart the containerd that reads {config_path} to load it"
    if installing:
        return (f"{restart}; the base spec applies to containers started through CRI (Kubernetes)",
                "ctr and nerdctl do not use base_runtime_spec: start containers with `ctr run --config SPEC` "
                "or register the hook in their spec")
    return (restart,)


# containerd's CRI reads CDI specs from these dirs unless the config names others (cdi_spec_dirs).
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")


def _cri_table(doc: dict, version: int) -> dict:
    node = doc
    for key in RUNC_TABLE_PATHS[version][:2]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def cdi_specs_running_gpuhook(doc: dict, version: int, node_root: str = "") -> list:
    """CDI spec files in the dirs containerd's CRI reads that register gpuhook as a hook: a
    container given one of their devices runs gpuhook from them too (createRuntime) as well as
    from the base spec (prestart)."""
    from gpuhook.install.common import is_gpuhook_entry

    dirs = _cri_table(doc, version).get("cdi_spec_dirs")
    found = []
    for directory in dirs if isinstance(dirs, list) else CDI_SPEC_DIRS:
        if not isinstance(directory, str):
            continue
        full = os.path.join(node_root, directory.lstrip("/")) if node_root else directory
        try:
            names = sorted(os.listdir(full))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".json", ".yaml", ".yml")):
                continue
            try:
                text = _read_text(os.path.join(full, name))
            except InstallError:
                continue
            if text is None or "gpuhook" not in text:
                continue
            try:
                import yaml  # JSON is YAML too

                spec = yaml.safe_load(text)
            except Exception:  # an unreadable spec is containerd's to report
                continue
            edits = [spec.get("containerEdits")] if isinstance(spec, dict) else []
            edits += [d.get("containerEdits") for d in (spec.get("devices") or []) if isinstance(d, dict)] \
                if isinstance(spec, dict) and isinstance(spec.get("devices"), list) else []
            hooks = [h for e in edits if isinstance(e, dict) for h in (e.get("hooks") or []) if isinstance(h, dict)]
            if any(is_gpuhook_entry({"path": h.get("path"), "args": h.get("args")}) for h in hooks):
                found.append(os.path.join(directory, name))
    return found


def _spec_source(base_spec: str | None, old_spec: str | None, spec_path: str, config_doc: dict,
                 node_root: str) -> tuple:
    """(spec document, its text for the layout, note) the base spec starts from:
    - `base_spec` (--base-spec): the administrator's spec, as it is;
    - an existing spec that is not gpuhook's own (it has a backup): as it is, hooks added;
    - otherwise containerd's default for the release that runs, without what CRI drops
      from it when there is no base spec (CRI_DROPS); a spec gpuhook wrote earlier is
      written again from it, so re-running install after a containerd upgrade follows it."""
    if base_spec is not None:
        text = _read_text(base_spec)
        if text is None:
            raise InstallError(f"base spec {base_spec} does not exist")
        return _parse_json_object(text, base_spec), text, f"base spec: {base_spec}, as it is"
    if old_spec is not None and (not has_gpuhook(_parse_json_object(old_spec, spec_path))
                                 or os.path.exists(spec_path + BACKUP_SUFFIX)):
        return _parse_json_object(old_spec, spec_path), old_spec, f"base spec: {spec_path}, gpuhook's hooks added"
    found = daemon.default_spec(config_doc, node_root)
    spec, dropped = without_cri_drops(_parse_json_object(found.text, f"{found.ctr} oci spec"))
    note = f"base spec: containerd's default spec (`ctr oci spec`) from {found.source}"
    if dropped:
        note += (f", without what CRI drops from it for containers when there is no base spec "
                 f"({', '.join(dropped)})")
    return spec, found.text, note


def plan_containerd(hook: Hook, spec_path: str = CONTAINERD_SPEC, config_path: str = CONTAINERD_CONFIG,
                    base_spec: str | None = None, node_root: str = "") -> InstallPlan:
    """Write the base spec (containerd's default + our prestart and poststop hooks, see
    `_spec_source`) and point config.toml's runc runtime at it. With `node_root` (install
    --host-root), both files are under it while config.toml names the spec by the node's own
    path, and the node's running containerd gives the default spec."""
    spec_value = os.path.abspath(spec_path)
    spec_path = os.path.join(node_root, spec_value.lstrip("/")) if node_root else spec_value
    node_config = os.path.normpath("/" + config_path.lstrip("/")) if node_root else os.path.abspath(config_path)
    config_path = os.path.abspath(os.path.join(node_root, config_path.lstrip("/")) if node_root else config_path)
    old_config = _read_text(config_path)
    config_doc = _parse_toml(old_config or "", config_path)
    # Before the spec: a config gpuhook cannot edit stops install before anything runs.
    config_version(config_doc, config_path, spec_value)
    old_spec = _read_text(spec_path)
    spec, style, source = _spec_source(base_spec, old_spec, spec_path, config_doc, node_root)
    spec_change = _plan_spec_with_hook(spec_path, old_spec, spec, style, hook.entries())
    empty_version = 2
    if not config_doc:
        try:
            running = daemon.running(daemon.grpc_address(config_doc))
            major = int(daemon.version(node_root, running.binary).lstrip("v").split(".")[0]) if running else 1
            empty_version = EMPTY_CONFIG_VERSION.get(major, 3)
        except (InstallError, ValueError):
            pass
    new_config = set_base_runtime_spec(old_config or "", spec_value, config_path, empty_version)
    backup = None
    if old_config is not None and new_config != old_config and ADDED_MARK not in old_config \
            and WAS_MARK not in old_config:
        backup = config_path + BACKUP_SUFFIX
    version = config_version(_parse_toml(new_config, config_path), config_path, spec_value)
    notes = [source, f"CRI's runc runtime: [{runc_table_name(version)}] (config version {version})"]
    for cdi_spec in cdi_specs_running_gpuhook(config_doc, version, node_root):
        notes.append(f"warning: the CDI spec {cdi_spec} also runs gpuhook: a container given its devices runs it "
                     "twice (prestart from the base spec, createRuntime from the spec); the second run notices the "
                     "first and does nothing, but register gpuhook one way only")
    # The spec first: the config must never point at a file that is not there yet.
    return InstallPlan((spec_change, FileChange(config_path, old_config, new_config, backup=backup)),
                       tuple(notes) + _containerd_notes(node_config, installing=True))


def plan_containerd_removal(spec_path: str = CONTAINERD_SPEC,
                            config_path: str = CONTAINERD_CONFIG, node_config: str | None = None) -> InstallPlan:
    """Take back the config.toml lines and the base spec that plan_containerd added.
    `node_config` is the config's path as the node's containerd names it, where that is not
    `config_path` (uninstall --host-root)."""
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
    return InstallPlan(tuple(changes), tuple(notes) + _containerd_notes(node_config or config_path,
                                                                        installing=False))


