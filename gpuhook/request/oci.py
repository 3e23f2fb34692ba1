"""Reading what the runtime hands the hook: the OCI state (stdin) and the bundle's config.json.

Real runtimes deviate from runtime-spec (docs/runtime-facts.md §1: runc says status "creating",
crun "created" with an extra "root" and pid 0 at createContainer, podman puts the bundle
under its storage dir). We accept every shape a real runtime produces and reject what is
unusable with a message that names the field and what was wrong with it.
"""

import errno

from gpuhook import fastjson
from gpuhook.devrules.policy import RuntimeRules
from gpuhook.errors import InputError
from gpuhook.kernel.files import read_regular_file
from gpuhook.prescan import MAX_CONFIG_BYTES, MAX_STATE_BYTES  # the fast path's limits, one each
                                                                                   # for the fast and the full path
from gpuhook.record import record


# Statuses a container can have while its prestart/createRuntime hooks run.
STARTING_STATUSES = ("creating", "created")


class State(record("State", "oci_version id status pid bundle annotations")):
    """The OCI state document: `pid` is 0 when the runtime gave none."""

    __slots__ = ()


class Spec(record("Spec", "rootfs env mounts annotations bounding_caps namespaces readonly devices device_rules",
                  defaults=((), ()))):
    """What gpuhook needs from a bundle's config.json.

    `rootfs` is absolute; `env` maps names to values (the last entry wins, as in the NVIDIA
    toolkit); `mounts` is a tuple of Mount; `namespaces` maps type to path ('' when new);
    `devices` are the character device nodes the runtime puts in the container
    (linux.devices), each a Device; `device_rules` the runtime's device cgroup rules
    (linux.resources.devices, in order), each a CgroupRule.
    """

    __slots__ = ()

    @property
    def privileged(self) -> bool:
        """A privileged container as runc's runtimes make one (docker and podman --privileged):
        CAP_SYS_ADMIN in the bounding set (NVIDIA's whole definition) AND device rules that
        allow every device (gpuhook.devrules.policy.RuntimeRules.allows_everything). A container
        that was only given CAP_SYS_ADMIN (--cap-add SYS_ADMIN) keeps the runtime's device
        policy, so it gets none of the exemptions (docs/requests.md)."""
        if "CAP_SYS_ADMIN" not in self.bounding_caps:
            return False
        return RuntimeRules(self.device_rules).allows_everything()


    @property
    def from_podman(self) -> bool:
        """Whether podman made this spec. podman (4.3 on Debian 12, up to 4.5.0) copies the
        image's manifest annotations into the spec, so there any annotation is as hostile as
        the image's environment: an image can add `cdi.k8s.io/...` or `io.kubernetes.pod.name`
        and even replace `io.container.manager`. What it cannot do is remove podman's own marks:
        the `io.podman.annotations.*` keys and the `/run/.containerenv` bind mount
        (docs/requests.md, docs/runtime-facts.md). No other runtime writes either."""
        if self.annotations.get("io.container.manager") == "libpod":
            return True
        if any(key.startswith("io.podman.annotations.") for key in self.annotations):
            return True
        return any(m.destination.rstrip("/") == "/run/.containerenv" for m in self.mounts)

    def runtime_annotations(self) -> dict:
        """The annotations only the runtime or the orchestrator can have written: all of them,
        except in a podman spec, where the image may have written any (from_podman)."""
        return {} if self.from_podman else self.annotations


class Mount(record("Mount", "destination source type options")):
    __slots__ = ()


class Device(record("Device", "path major minor")):
    """A character device node from linux.devices."""

    __slots__ = ()


class CgroupRule(record("CgroupRule", "allow type major minor access")):
    """One linux.resources.devices entry as written: `type` and `access` are the spec's
    strings ("a" and "" when absent), `major`/`minor` -1 when absent (a wildcard). What it
    means is gpuhook.devrules.policy's business, which also judges values runc refuses."""

    __slots__ = ()


MAX_DEVICES = 4096  # linux.devices (and linux.resources.devices) entries; far above any real container


# Every member name gpuhook reads from the state or config.json, by its Go-folded spelling.
# runc parses with Go's encoding/json, which matches a member name to a field case-
# insensitively under Unicode simple folding ("Linux", "DEVICES", "\u017ftatus" with a long s,
# "\u212aind" with a Kelvin sign all select the field) and lets the last duplicate win; crun's
# parser (libocispec, yajl) matches names exactly; Python's json reads only the exact name. So
# {"root":…,"Root":…} meant one rootfs to runc and another to gpuhook, and a lone "Linux"
# carried devices and device rules runc applied while gpuhook (and crun) saw none. No runtime
# or orchestrator writes another spelling: any member whose name folds to one of these without
# being it, and any name twice, is refused (docs/security.md, "parser differentials").
_SPELLINGS = (
    "ociVersion", "id", "status", "pid", "bundle", "annotations", "root", "path", "readonly", "process",
    "env", "capabilities", "bounding", "mounts", "destination", "source", "type", "options", "linux",
    "namespaces", "devices", "major", "minor", "resources", "cgroupsPath", "uidMappings", "gidMappings", "hooks",
    "allow", "access",
)
# The only non-ASCII characters that Unicode simple folding maps onto ASCII letters.
_GO_FOLD_SPECIAL = {0x17F: "s", 0x212A: "k"}


def go_fold(name: str) -> str:
    """`name` as Go's encoding/json compares member names to field names (bytes.EqualFold):
    ASCII case ignored, U+017F (long s) as s and U+212A (Kelvin sign) as k. Other non-ASCII
    characters fold to nothing ASCII, so such a name is returned unchanged (never a field's)."""
    if name.isascii():
        return name.lower()
    folded = name.translate(_GO_FOLD_SPECIAL)
    return folded.lower() if folded.isascii() else name


_FIELDS = {go_fold(name): name for name in _SPELLINGS}


class _Differential(ValueError):
    """A member name runtimes and gpuhook could read differently."""


def _unambiguous_object(pairs: list) -> dict:
    doc = {}
    fields = set()  # the Go-folded names of the fields met in this object
    for key, value in pairs:
        if key in doc:
            raise _Differential(f"member {key[:64]!r} appears twice")
        fold = go_fold(key)
        exact = _FIELDS.get(fold)
        if exact is not None:
            if fold in fields:
                raise _Differential(f"member {key[:64]!r} appears twice (names are matched case-insensitively "
                                    f"by the runtime)")
            if key != exact:
                raise _Differential(f"member {key[:64]!r} is not runtime-spec's {exact!r}; runtimes disagree on "
                                    f"such a name (runc reads it as {exact!r}, crun ignores it)")
            fields.add(fold)
        doc[key] = value
    return doc


def _decode(raw: bytes, what: str):
    if not raw.strip():
        raise InputError(f"{what} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{what} is not UTF-8 (byte {err.start})") from err
    try:
        return fastjson.loads(text, object_pairs_hook=_unambiguous_object)
    except RecursionError as err:
        raise InputError(f"{what} is nested too deeply") from err
    except _Differential as err:
        raise InputError(f"{what}: {err}") from None
    except ValueError as err:
        raise InputError(f"{what} is not valid JSON: {err}") from err


def _string(doc: dict, key: str, what: str, required: bool = True) -> str:
    value = doc.get(key)
    if value is None:
        if required:
            raise InputError(f"{what}: missing {key!r}")
        return ""
    if not isinstance(value, str):
        raise InputError(f"{what}: {key!r} must be a string, not {type(value).__name__}")
    if "\0" in value:
        raise InputError(f"{what}: {key!r} contains a NUL byte")
    return value


def _string_map(value, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{what} must be an object, not {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise InputError(f"{what}: value of {k!r} must be a string, not {type(v).__name__}")
    return value


def parse_state(raw: bytes, base_dir: str | None = None) -> State:
    """Parse the state JSON. `base_dir` allows a relative bundle (sample states only)."""
    if len(raw) > MAX_STATE_BYTES:
        raise InputError(f"state is larger than {MAX_STATE_BYTES >> 20} MiB")
    doc = _decode(raw, "state")
    if not isinstance(doc, dict):
        raise InputError(f"state must be a JSON object, not {type(doc).__name__}")
    what = "state"
    oci_version = _string(doc, "ociVersion", what, required=False)
    cid = _string(doc, "id", what)
    if not cid:
        raise InputError("state: 'id' is empty")
    status = _string(doc, "status", what, required=False)
    bundle = _string(doc, "bundle", what)
    if not bundle:
        raise InputError("state: 'bundle' is empty")
    if not bundle.startswith("/"):
        if base_dir is None:
            raise InputError(f"state: 'bundle' must be an absolute path, not {bundle!r}")
        bundle = _join(base_dir, bundle)
    pid = doc.get("pid", 0)
    if pid is None:
        pid = 0
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise InputError(f"state: 'pid' must be a whole number, not {pid!r}"[:200])
    if pid < 0 or pid > 4194304:
        raise InputError(f"state: 'pid' {pid} is out of range")
    annotations = _string_map(doc.get("annotations"), "state: 'annotations'")
    return State(oci_version, cid, status, pid, _normalize(bundle), annotations)


def _join(base: str, rel: str) -> str:
    return _normalize(base.rstrip("/") + "/" + rel)


def _normalize(path: str) -> str:
    """Lexically normalise an absolute path (no filesystem access, no symlinks followed)."""
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def read_config_bytes(bundle: str) -> bytes:
    path = bundle.rstrip("/") + "/config.json"
    try:
        raw = read_regular_file(path, MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"bundle {bundle} has no config.json") from None
    except NotADirectoryError:
        raise InputError(f"bundle {bundle} is not a directory") from None
    except OSError as err:
        what = "is not a regular file" if err.errno == errno.EINVAL else f"cannot be read: {err.strerror}"
        raise InputError(f"{path} {what}") from err
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
    return raw


def parse_spec(raw: bytes, bundle: str) -> Spec:
    """Parse a bundle's config.json into the parts gpuhook uses."""
    what = "config.json"
    doc = _decode(raw, what)
    if not isinstance(doc, dict):
        raise InputError(f"{what} must be a JSON object, not {type(doc).__name__}")
    root = doc.get("root")
    if not isinstance(root, dict):
        raise InputError(f"{what}: missing 'root' object")
    root_path = _string(root, "path", f"{what}: root")
    if not root_path:
        raise InputError(f"{what}: root.path is empty")
    rootfs = _normalize(root_path if root_path.startswith("/") else bundle + "/" + root_path)
    if rootfs == "/":
        raise InputError(f"{what}: root.path resolves to the host's / ; refusing")
    readonly = root.get("readonly", False) is True

    process = doc.get("process")
    process = {} if process is None else process
    if not isinstance(process, dict):
        raise InputError(f"{what}: 'process' must be an object")
    env = _parse_env(process.get("env"), what)
    caps = process.get("capabilities")
    caps = {} if caps is None else caps
    if not isinstance(caps, dict):
        raise InputError(f"{what}: process.capabilities must be an object")
    bounding = caps.get("bounding") or []
    if not isinstance(bounding, list) or not all(isinstance(c, str) for c in bounding):
        raise InputError(f"{what}: process.capabilities.bounding must be a list of strings")

    mounts = []
    raw_mounts = doc.get("mounts")
    raw_mounts = [] if raw_mounts is None else raw_mounts
    if not isinstance(raw_mounts, list):
        raise InputError(f"{what}: 'mounts' must be a list")
    for i, m in enumerate(raw_mounts):
        if not isinstance(m, dict):
            raise InputError(f"{what}: mounts[{i}] must be an object")
        options = m.get("options") or []
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise InputError(f"{what}: mounts[{i}].options must be a list of strings")
        mounts.append(
            Mount(
                _string(m, "destination", f"{what}: mounts[{i}]"),
                _string(m, "source", f"{what}: mounts[{i}]", required=False),
                _string(m, "type", f"{what}: mounts[{i}]", required=False),
                tuple(options),
            )
        )

    linux = doc.get("linux")
    linux = {} if linux is None else linux
    if not isinstance(linux, dict):
        raise InputError(f"{what}: 'linux' must be an object")
    namespaces = {}
    raw_ns = linux.get("namespaces")
    raw_ns = [] if raw_ns is None else raw_ns
    if not isinstance(raw_ns, list):
        raise InputError(f"{what}: linux.namespaces must be a list")
    for i, ns in enumerate(raw_ns):
        if not isinstance(ns, dict):
            raise InputError(f"{what}: linux.namespaces[{i}] must be an object")
        namespaces[_string(ns, "type", f"{what}: linux.namespaces[{i}]")] = _string(
            ns, "path", f"{what}: linux.namespaces[{i}]", required=False
        )
    annotations = _string_map(doc.get("annotations"), f"{what}: 'annotations'")
    devices = _parse_devices(linux.get("devices"), what)
    resources = linux.get("resources")
    if resources is not None and not isinstance(resources, dict):
        raise InputError(f"{what}: linux.resources must be an object")
    rules = _parse_device_rules((resources or {}).get("devices"), what)
    return Spec(rootfs, env, tuple(mounts), annotations, frozenset(bounding), namespaces, readonly, devices, rules)


def _parse_device_rules(value, what: str) -> tuple:
    """linux.resources.devices as CgroupRules, in order. Shapes runc's JSON decoder refuses
    are errors here too; values it decodes but refuses later (a type other than a, b or c,
    access letters other than rwm) are kept for gpuhook.devrules.policy to judge."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(f"{what}: linux.resources.devices must be a list")
    if len(value) > MAX_DEVICES:
        raise InputError(f"{what}: linux.resources.devices has more than {MAX_DEVICES} entries")
    found = []
    for i, entry in enumerate(value):
        where = f"{what}: linux.resources.devices[{i}]"
        if not isinstance(entry, dict):
            raise InputError(f"{where} must be an object")
        allow = entry.get("allow", False)
        if not isinstance(allow, bool):
            raise InputError(f"{where}: 'allow' must be true or false")
        numbers = []
        for key in ("major", "minor"):
            number = entry.get(key)
            if number is None:
                number = -1
            elif type(number) is not int or not -1 <= number < 1 << 32:
                raise InputError(f"{where}: {key} must be an integer")
            numbers.append(number)
        type_ = _string(entry, "type", where, required=False) or "a"
        access = _string(entry, "access", where, required=False)
        found.append(CgroupRule(allow, type_, numbers[0], numbers[1], access))
    return tuple(found)


def _parse_devices(value, what: str) -> tuple:
    """The character devices of linux.devices (path, major, minor). Other entries (block
    devices, FIFOs) are not gpuhook's business and are skipped; a malformed character
    device entry is an error, as it would be for the runtime."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(f"{what}: linux.devices must be a list")
    if len(value) > MAX_DEVICES:
        raise InputError(f"{what}: linux.devices has more than {MAX_DEVICES} entries")
    found = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise InputError(f"{what}: linux.devices[{i}] must be an object")
        if entry.get("type") not in ("c", "u"):
            continue
        path = _string(entry, "path", f"{what}: linux.devices[{i}]")
        numbers = [entry.get("major"), entry.get("minor")]
        if not all(type(n) is int and 0 <= n < 1 << 32 for n in numbers):
            raise InputError(f"{what}: linux.devices[{i}]: major and minor must be non-negative integers")
        found.append(Device(path, numbers[0], numbers[1]))
    return tuple(found)


def _parse_env(value, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise InputError(f"{what}: process.env must be a list of strings")
    env = {}
    for entry in value:
        if not isinstance(entry, str):
            raise InputError(f"{what}: process.env entries must be strings, not {type(entry).__name__}")
        name, sep, val = entry.partition("=")
        if sep and name:
            env[name] = val
    return env
