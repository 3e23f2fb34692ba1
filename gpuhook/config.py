"""gpuhook's configuration: one TOML file, every key declared once in `KEYS`.

Where it comes from, first match wins: ``--config FILE``, ``$GPUHOOK_CONFIG``,
``/etc/gpuhook/config.toml``. A missing default file means all defaults; a file named
explicitly must exist. Unknown keys and bad values are errors that name the key and the file,
so a typo never silently turns a policy off.

The table below is the documentation: README's key list and ``gpuhook config`` are checked
against it by tests/unit/test_config.py.
"""

import os
import stat

from gpuhook.kernel import files
from gpuhook.errors import ConfigError
from gpuhook.record import record

DEFAULT_PATH = "/etc/gpuhook/config.toml"
CACHE_DIR = "config-cache"  # under the state-dir the cached config names
ENV_VAR = "GPUHOOK_CONFIG"


class Key(record("Key", "section name kind default doc choices")):
    """One configuration key. `kind` is bool, path, path-or-empty, seconds, int, str or choice."""

    __slots__ = ()

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name


def _key(name, kind, default, doc, section="", choices=()):
    return Key(section, name, kind, default, doc, tuple(choices))


KEYS = (
    _key("driver-root", "path", "/",
         "Root under which the driver's libraries, binaries, firmware and ld cache are found: / on "
         "a normal host, the driver container's root (e.g. /run/nvidia/driver), or a simulated host."),
    _key("driver-bin-dirs", "paths", [],
         "Directories under driver-root that hold the driver's programs (nvidia-smi, nvidia-debugdump, "
         "nvidia-persistenced, the MPS tools), searched in order. Empty means /usr/bin, /usr/sbin, /bin, "
         "/sbin, /usr/local/nvidia/bin (GKE), /home/kubernetes/bin/nvidia/bin (COS), /usr/local/bin. Only ELF "
         "programs are mounted: a shell wrapper of the same name (GKE's /usr/bin/nvidia-smi) is skipped."),
    _key("driver-lib-dirs", "paths", [],
         "Directories under driver-root that hold the driver's libraries (files named <lib>.so.<driver "
         "version>), used instead of the driver root's ld cache. Empty means the ld cache, plus "
         "/usr/local/nvidia/lib64 and /home/kubernetes/bin/nvidia/lib64 (and their lib) for libraries the "
         "cache lacks (docs/driver-layouts.md)."),
    _key("dev-root", "path-or-empty", "",
         "Where the host's NVIDIA device nodes live (their mode and owner are copied); empty means "
         "<driver-root>/dev, falling back to /dev."),
    _key("proc-root", "path", "/proc",
         "Where /proc/devices and /proc/driver/nvidia are read from (a simulated host points it at "
         "its own tree). Container processes are always looked up in the real /proc."),
    _key("sys-root", "path", "/sys",
         "Where sysfs is read from: the device plugin reads each GPU's NUMA node from "
         "<sys-root>/bus/pci/devices/<bus id>/numa_node (a simulated host points it at its own tree)."),
    _key("nvml-library", "path-or-empty", "",
         "The NVML library (libnvidia-ml) gpuhook loads when it needs NVML (brand, CUDA version, "
         "MIG layout, health checks). Empty means the system's libnvidia-ml.so.1: found by the "
         "dynamic linker when driver-root is /, else in the driver root's ld cache. A simulated "
         "host sets its own."),
    _key("accept-env-when-unprivileged", "bool", True,
         "Honour NVIDIA_VISIBLE_DEVICES (and NVIDIA_NVSWITCH, NVIDIA_GDRCOPY) from unprivileged containers "
         "(privileged: CAP_SYS_ADMIN in the bounding set and every device allowed). Unsafe on shared "
         "clusters: any image that sets NVIDIA_VISIBLE_DEVICES=all gets every GPU, bypassing the "
         "scheduler. Set false where the device plugin uses volume mounts or CDI."),
    _key("accept-volume-mounts", "bool", True,
         "Honour bind mounts of /dev/null at /var/run/nvidia-container-devices/<id> (the Kubernetes "
         "device plugin's volume-mounts strategy; only the runtime can add them)."),
    _key("accept-cdi-annotations", "bool", True,
         "Honour CDI annotations (cdi.k8s.io/*) naming devices of any NVIDIA kind (nvidia.com/gpu, "
         "k8s.device-plugin.nvidia.com/gpu, a DRA claim, ...). The kubelet or the runtime sets "
         "them; set false where users can set annotations themselves (podman --annotation, or a "
         "CRI runtime that forwards pod annotations to the container). A request the policy "
         "refuses is never replaced by NVIDIA_VISIBLE_DEVICES."),
    _key("accept-runtime-devices", "bool", True,
         "Take the GPU device nodes the runtime already put in linux.devices (containerd and "
         "CRI-O after resolving CDI) as the grant, as far as the runtime's linux.resources.devices "
         "opens them: NVIDIA_VISIBLE_DEVICES then cannot widen it, and a grant this refuses is not "
         "replaced by it. Privileged containers, whose linux.devices lists every host device, are exempt."),
    _key("cdi-spec-dirs", "paths", ["/etc/cdi", "/var/run/cdi"],
         "Where CDI specs (JSON or YAML) are read to resolve a CDI device whose name does not say "
         "which GPU it is (a DRA claim such as k8s.gpu.nvidia.com/claim=<uid>-gpu-0): the device "
         "nodes the spec injects name the GPUs. Specs must be root-owned and not writable by others."),
    _key("ldconfig", "path-or-empty", "",
         "The HOST's ldconfig, run with an empty environment to update the container's ld cache; it must be "
         "statically linked. Empty means the first static one of /sbin/ldconfig.real, /sbin/ldconfig, "
         "/usr/sbin/ldconfig(.real), /usr/bin/ldconfig, /bin/ldconfig on the host, then in driver-root. A "
         "path whose file is a wrapper script is replaced by its .real sibling (Ubuntu). Never taken from the "
         "image."),
    _key("container-lib-dir", "path-or-empty", "",
         "Library directory in the container; empty picks /usr/lib/x86_64-linux-gnu (or the "
         "machine's multiarch dir) for Debian-family images, else /usr/lib64."),
    _key("deadline-seconds", "seconds", 25.0,
         "Total time the hook may take, below the timeout it is registered with (hooks.d uses 30)."),
    _key("log-file", "path-or-empty", "/var/log/gpuhook.log",
         "JSON-lines log of every decision for containers that request GPUs; empty turns it off. "
         "A broken or full log never fails a container start."),
    _key("log-target", "choice", "file",
         "Where decision log lines go: file (log-file), syslog (the syslog-socket datagram socket, "
         "which journald also reads), or both. Each line is one JSON object of at most 8 KiB, "
         "tagged gpuhook, with the pod's names and UID.",
         choices=("file", "syslog", "both")),
    _key("syslog-socket", "path", "/dev/log",
         "The syslog socket log-target = syslog or both writes to."),
    _key("state-dir", "path", "/run/gpuhook",
         "Runtime state: the parsed config's cache, the host inventory cache, per-GPU locks, health "
         "reports, stamps, the container registry. Everything gpuhook keeps goes here."),
    # [health]: the check-and-reset before a container gets its GPUs (docs/health.md).
    _key("mode", "choice", "fallback",
         "When the hook checks and cleans a container's GPUs before it starts: off never; "
         "fallback unless `gpuhook prepare` (a device plugin's PreStartContainer) left a fresh "
         "stamp for the GPU; always on every start, stamps or not.",
         section="health", choices=("off", "fallback", "always")),
    _key("deadline-seconds", "seconds", 10.0,
         "Time for the checks, kills and resets of all of a start's GPUs together (they run in "
         "parallel); also bounded by the hook's own deadline-seconds. A GPU not done by then "
         "fails the start, naming the GPU and the step that was cut off.",
         section="health"),
    _key("on-failure", "choice", "fail",
         "What a GPU that is still unhealthy after repair does to the start: fail it (one line "
         "naming the GPU, the check and the evidence) or warn (log it and start anyway).",
         section="health", choices=("fail", "warn")),
    _key("leftover-memory-mib", "int", 1024,
         "GPU memory in use beyond what the GPU's listed processes hold (leftovers of a dead "
         "context), in MiB, above which the GPU needs a reset. NVML's used memory includes "
         "the driver's reserve (a few hundred MiB on current GPUs): keep this above it.",
         section="health"),
    _key("reset-command", "str", "nvidia-smi --gpu-reset -i {uuid}",
         "How a GPU is reset; {uuid} is replaced by the GPU's UUID. A program without a slash "
         "is looked up in the driver root's /usr/bin, /usr/sbin, /bin, /sbin, /usr/local/bin, "
         "never in a PATH; an absolute path is used as written. It runs with a minimal "
         "environment, / as working directory and its own timeout.",
         section="health"),
    _key("reset-timeout-seconds", "seconds", 8.0,
         "How long one reset may take before its whole process group is killed (never longer "
         "than what is left of the health deadline).",
         section="health"),
    _key("kill-orphans", "bool", True,
         "SIGKILL GPU processes left behind by a container gpuhook started whose init is gone. "
         "Processes of live containers, of containers gpuhook does not know and of the host "
         "are never killed. Off: such a GPU fails its processes check instead.",
         section="health"),
    _key("stamp-ttl-seconds", "seconds", 60.0,
         "How long a stamp left by `gpuhook prepare` lets the hook skip a GPU (fallback mode); "
         "a stamp serves one start.",
         section="health"),
    _key("reset-on-release", "bool", False,
         "At poststop, also reset each GPU the stopped container was the last user of, so no "
         "memory contents survive into the next container.",
         section="health"),
    _key("daemon-socket", "path-or-empty", "",
         "The health daemon's socket (`gpuhook plugin`, or `gpuhook plugin --standalone` without "
         "kubelet), which the hook asks to check and clean its GPUs before loading NVML itself; "
         "empty means <state-dir>/health.sock. Only a root-owned socket in a root-only directory "
         "is asked.", section="health"),
    _key("resource-name", "str", "nvidia.com/gpu",
         "The extended resource `gpuhook plugin` advertises to kubelet.", section="plugin"),
    _key("strategy", "choice", "volume-mounts",
         "How Allocate names the GPUs for the hook: volume-mounts (a bind of /dev/null per GPU, "
         "which only the runtime can add: the safe default), envvar (NVIDIA_VISIBLE_DEVICES: any "
         "image can set it), cdi-annotations (cdi.k8s.io annotations) or cdi-cri (CDI device "
         "names kubelet passes to the runtime, which must resolve them from a CDI spec).",
         section="plugin", choices=("volume-mounts", "envvar", "cdi-annotations", "cdi-cri")),
    _key("mig-strategy", "choice", "none",
         "none: every GPU is one device, MIG or not; single: a GPU in MIG mode is offered as its "
         "MIG devices (MIG UUIDs) under the same resource.", section="plugin", choices=("none", "single")),
    _key("recheck-seconds", "seconds", 30.0,
         "How often the plugin re-checks every GPU (read-only) and updates ListAndWatch.", section="plugin"),
    _key("prestart-deadline-seconds", "seconds", 25.0,
         "PreStartContainer's deadline for checking and repairing its GPUs, safely below "
         "kubelet's 30 s.", section="plugin"),
)

_BY_NAME = {k.dotted: k for k in KEYS}
_SECTIONS = {k.section for k in KEYS if k.section}


def _check(key: Key, value, where: str):
    bad = f"{where}: {key.dotted} "
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(bad + f"must be true or false, not {value!r}")
        return value
    if key.kind in ("path", "path-or-empty"):
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(bad + f"must be a path string, not {value!r}")
        if value == "" and key.kind == "path-or-empty":
            return value
        if not value.startswith("/"):
            raise ConfigError(bad + f"must be an absolute path, not {value!r}")
        return value.rstrip("/") or "/"
    if key.kind == "paths":
        if not isinstance(value, list) or len(value) > 16:
            raise ConfigError(bad + f"must be a list of at most 16 absolute paths, not {value!r}")
        return [_check(Key(key.section, key.name, "path", "", "", ()), item, where) for item in value]
    if key.kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
            raise ConfigError(bad + f"must be a number of seconds in (0, 3600], not {value!r}")
        return float(value)
    if key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(bad + f"must be a whole number >= 0, not {value!r}")
        return value
    if key.kind == "choice":
        if value not in key.choices:
            raise ConfigError(bad + f"must be one of {', '.join(key.choices)}, not {value!r}")
        return value
    if key.kind == "str":
        if not isinstance(value, str):
            raise ConfigError(bad + f"must be a string, not {value!r}")
        return value
    raise AssertionError(key.kind)


class _Table:
    """Validated settings of one TOML table: each key is an attribute, its name in snake_case.
    The attributes are declared in the subclasses, so `grep state_dir` finds its definition;
    tests/unit/test_config.py checks the declarations against KEYS."""

    def __init__(self, values: dict, source: str | None):
        self._values = values
        self.source = source
        for name, value in values.items():
            setattr(self, name.replace("-", "_"), value)

    def as_dict(self) -> dict:
        return {k: (v.as_dict() if isinstance(v, _Table) else v) for k, v in self._values.items()}


class HealthConfig(_Table):
    """[health]: the check-and-reset before a container gets its GPUs (docs/health.md)."""

    mode: str
    deadline_seconds: float
    on_failure: str
    leftover_memory_mib: int
    reset_command: str
    reset_timeout_seconds: float
    kill_orphans: bool
    stamp_ttl_seconds: float
    reset_on_release: bool
    daemon_socket: str


class PluginConfig(_Table):
    """[plugin]: the Kubernetes device plugin (docs/device-plugin.md)."""

    resource_name: str
    strategy: str
    mig_strategy: str
    recheck_seconds: float
    prestart_deadline_seconds: float


class Config(_Table):
    """Validated settings: the top-level keys, and the sections as `health` and `plugin`."""

    driver_root: str
    driver_bin_dirs: list
    driver_lib_dirs: list
    dev_root: str
    proc_root: str
    sys_root: str
    nvml_library: str
    accept_env_when_unprivileged: bool
    accept_volume_mounts: bool
    accept_cdi_annotations: bool
    accept_runtime_devices: bool
    cdi_spec_dirs: list
    ldconfig: str
    container_lib_dir: str
    deadline_seconds: float
    log_file: str
    log_target: str
    syslog_socket: str
    state_dir: str
    health: HealthConfig
    plugin: PluginConfig

    def __init__(self, values: dict, source: str | None):
        super().__init__(values, source)
        # (path, document) of the parsed file's cache entry when `load` parsed it: written
        # by a start that applies (gpuhook.apply.statefiles.write_caches), never by `load`.
        self.cache_entry: tuple | None = None

    @property
    def device_root(self) -> str:
        """Where host device nodes are: dev-root, else <driver-root>/dev."""
        if self.dev_root:
            return self.dev_root
        return "/dev" if self.driver_root == "/" else self.driver_root + "/dev"


TABLES = {"": Config, "health": HealthConfig, "plugin": PluginConfig}


def from_mapping(data: dict, where: str = "config") -> Config:
    """Validate a parsed TOML document (or any mapping) into a Config."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table of keys")
    values: dict = {}
    sections: dict = {s: {} for s in _SECTIONS}
    for name, value in data.items():
        if name in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [{name}] must be a table")
            for sub, subvalue in value.items():
                key = _BY_NAME.get(f"{name}.{sub}")
                if key is None:
                    raise ConfigError(f"{where}: unknown key {name}.{sub} ({_known(name)})")
                sections[name][sub] = _check(key, subvalue, where)
            continue
        key = _BY_NAME.get(name)
        if key is None or key.section:
            raise ConfigError(f"{where}: unknown key {name!r} ({_known('')})")
        values[name] = _check(key, value, where)
    for key in KEYS:
        target = sections[key.section] if key.section else values
        target.setdefault(key.name, key.default)
    for section, section_values in sections.items():
        values[section] = TABLES[section](section_values, where)
    return Config(values, where)


def _known(section: str) -> str:
    names = [k.name for k in KEYS if k.section == section]
    if not section:  # the top level also holds the tables
        names += [f"[{name}]" for name in sorted(_SECTIONS)]
    return "known keys: " + ", ".join(names)


def default(dotted: str):
    return _BY_NAME[dotted].default


def defaults() -> Config:
    return from_mapping({}, "defaults")


# A Config loaded ahead of a request, by the agent's spare that will serve it (`preload`):
# config file path -> (that file's identity then, the Config). `load` returns it while the
# file is the same; anything else about the file reloads it.
_PRELOADED: dict = {}


def preload(path: str | None, environ: dict | None) -> None:
    """Load the configuration now, for a `load` of the same file later (gpuhook.agent: a spare
    loads the file the last start named while it waits). Never raises, prints nothing."""
    try:
        load(path, environ, remember=True)
    except Exception:  # noqa: BLE001 - the request's own load says what is wrong
        _PRELOADED.clear()


def preloaded():
    """The Config `preload` loaded, or None."""
    return next(iter(_PRELOADED.values()))[1] if _PRELOADED else None


def load(path: str | None = None, environ: dict | None = None, use_cache: bool = True,
         remember: bool = False) -> Config:
    """Load the configuration from `path`, $GPUHOOK_CONFIG or the default file. Reads only.

    The parsed TOML is cached in <state-dir>/config-cache, keyed by the file's identity and
    timestamps: parsing TOML costs the hook more than the rest of its decision. The cache is
    looked for under the state-dir the file's own top-level `state-dir` line names
    (`_state_dir_line`, no TOML parser), and an entry counts only when it is trusted (root's,
    writable by nobody else), was written for this very file, and was parsed from a file
    naming that same state-dir: nothing but the trusted config file decides where its cache
    is (docs/security.md). When the file had to be parsed, the entry to cache is left in the
    Config's `cache_entry`; a start that goes on to apply writes it
    (gpuhook.apply.statefiles.write_caches), a dry run or a command never does. `use_cache`
    False neither reads the cache nor leaves an entry. A Config `preload` loaded from the
    same file, unchanged since (its identity: device, inode, size, mtime and ctime), is
    returned as it is.
    """
    explicit = path
    if explicit is None and environ is not None:
        explicit = environ.get(ENV_VAR) or None
    target = explicit or DEFAULT_PATH
    try:
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        if explicit is None:
            return defaults()
        raise ConfigError(f"config file {target} does not exist") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {target}: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"config file {target} is not a regular file")
        identity = files.file_identity(st)
        early = _PRELOADED.get(target)
        if early is not None and early[0] == identity and use_cache:
            return early[1]
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1 << 20)
    except OSError as err:
        raise ConfigError(f"cannot read config file {target}: {err.strerror}") from err
    finally:
        os.close(fd)
    config = _load_bytes(raw, target, identity, use_cache)
    if remember:
        _PRELOADED.clear()
        _PRELOADED[target] = (identity, config)
    return config


def _load_bytes(raw: bytes, target: str, identity: list, use_cache: bool) -> Config:
    guess = _state_dir_line(raw) if use_cache else None
    if guess is not None:
        cached = files.read(cache_path(guess, target))
        if isinstance(cached, dict) and cached.get("identity") == identity and isinstance(cached.get("data"), dict):
            config = from_mapping(cached["data"], target)
            if config.state_dir == guess:
                return config
    data = _parse_toml(raw, target)
    config = from_mapping(data, target)  # validate before caching: only good files are cached
    if use_cache:
        config.cache_entry = (cache_path(config.state_dir, target),
                              {"identity": identity, "source": os.path.abspath(target), "data": data})
    return config


def cache_path(state_dir: str, config_path: str) -> str:
    """Where the parsed `config_path`, which names `state_dir`, is cached."""
    name = os.path.abspath(config_path).replace("%", "%25").replace("/", "%")
    return f"{state_dir}/{CACHE_DIR}/{name}.json"


def _state_dir_line(raw: bytes) -> str | None:
    """The state-dir a config file's bytes name, read without a TOML parser: the value of a
    plain `state-dir = "..."` (or '...') line before the first table header (state-dir is a
    top-level key, so it can be nowhere else), the default when there is none, None when the
    line is spelled otherwise (escapes, a multi-line string): the cache is then not used.
    A wrong answer can only miss the cache: `load` checks the entry's own state-dir."""
    found = None
    for line in raw.split(b"\n"):
        text = line.strip()
        if not text or text.startswith(b"#"):
            continue
        if text.startswith(b"["):
            break
        key, sep, value = text.partition(b"=")
        if key.strip() not in (b"state-dir", b'"state-dir"', b"'state-dir'"):
            continue
        if found is not None or not sep:
            return None
        value = value.strip()
        quote = value[:1]
        end = value.find(quote, 1) if quote in (b'"', b"'") else -1
        rest = value[end + 1:].strip() if end > 0 else b"x"
        body = value[1:end]
        if end <= 0 or (rest and not rest.startswith(b"#")) or (quote == b'"' and b"\\" in body) \
                or value.startswith((b'"""', b"'''")):
            return None
        try:
            found = body.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not found.startswith("/"):
            return None
    return default("state-dir") if found is None else found


def _parse_toml(raw: bytes, target: str) -> dict:
    import tomllib

    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{target}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{target}: invalid TOML: {err}") from err
