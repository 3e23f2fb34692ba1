"""Durable device grants under systemd: register them with the container's scope unit.

With runc's systemd cgroup driver a container's cgroup is a transient scope, and systemd
turns the scope's DeviceAllow= list into its own device program (v2) or devices.allow
writes (v1). `systemctl daemon-reload` applies that list again and drops whatever only a
hook added: the "Failed to initialize NVML: Unknown Error" reports (docs/runtime-facts.md
§5). So when the container's cgroup is a scope, systemd is running, the unit's own
cgroup (its ControlGroup=) IS the container's cgroup and the unit restricts devices,
`register` adds the granted devices to the unit's DeviceAllow= at
runtime only (``systemctl set-property --runtime``: it ends with the scope and is never
written under /etc), and makes sure the /dev/char/MAJ:MIN (/dev/block/...) links exist:
older systemd resolves such entries by stat(2), and the NVIDIA driver's nodes are not made
by udev, so nothing else creates those links. A unit that does not restrict devices is
left alone: giving it a DeviceAllow= would switch an allow list on. So is a unit whose
ControlGroup= is another cgroup: a cgroupfs-driver cgroupsPath may end in any unit's name
(``…/init.scope``, ``…/session-1.scope``, another container's scope), and widening that
unit's devices would widen a cgroup that is not the container's (docs/cgroup-v2.md).

`status` answers the question `gpuhook cgroup show` asks: which allowed devices systemd
does not know, and so would take away on the next daemon-reload.

systemctl runs through gpuhook.kernel.child (minimal environment, timeout, no leftovers).
Everything that touches the host is a parameter of `Systemd`, so tests run it against a
stand-in systemctl, runtime directory and /dev.
"""

import errno
import os
import stat

from gpuhook.devrules.devices import WILDCARD, DeviceRule
from gpuhook.errors import ApplyError
from gpuhook.record import record

# sd_booted(3): this directory exists exactly when systemd is the running init system.
RUNTIME_DIR = "/run/systemd/system"
SYSTEMCTL_CANDIDATES = ("/usr/bin/systemctl", "/bin/systemctl")
TIMEOUT = 5.0
# Allowed by systemd under DevicePolicy=auto and closed without being listed (systemd.resource-control(5)).
PSEUDO_DEVICES = tuple(DeviceRule("c", 1, minor, "rwm") for minor in (3, 5, 7, 8, 9))
RESTRICTING_POLICIES = ("strict", "closed")

# UnitStatus.state values.
NOT_A_SCOPE = "not a scope"
NOT_RUNNING = "systemd not running"
NO_SYSTEMCTL = "no systemctl"
UNREADABLE = "unit unreadable"
NOT_LOADED = "unit not loaded"
NOT_THE_UNIT = "not the container's unit"
UNRESTRICTED = "unit does not restrict devices"
RESTRICTS = "unit restricts devices"


class UnitDevices(record("UnitDevices", "unit load_state policy entries control_group", defaults=("",))):
    """A unit's device settings as `systemctl show` prints them; `entries` are the
    DeviceAllow= values ("/dev/char/195:0 rw", "char-pts rwm"); `control_group` the unit's
    own cgroup ("" when it has none)."""

    __slots__ = ()

    @property
    def restricts(self) -> bool:
        # DevicePolicy=auto with an empty list attaches no device program at all.
        return self.policy in RESTRICTING_POLICIES or bool(self.entries)


class UnitStatus(record("UnitStatus", "unit state unknown detail")):
    """Whether systemd would keep a cgroup's allowed devices over a daemon-reload.

    `unknown` lists the allowed rules the unit's DeviceAllow= does not cover; they are at
    risk only when `state` is RESTRICTS.
    """

    __slots__ = ()

    @property
    def at_risk(self) -> list:
        return list(self.unknown) if self.state == RESTRICTS else []

    def as_dict(self) -> dict:
        return {"unit": self.unit, "state": self.state, "detail": self.detail,
                "unknown_to_systemd": [r.as_dict() for r in self.at_risk]}

    def summary(self) -> str:
        if self.state != RESTRICTS:
            return f"systemd: {self.detail}"
        if not self.unknown:
            return f"systemd: {self.unit} lists every allowed device in DeviceAllow= (a daemon-reload keeps them)"
        rules = ", ".join(r.v1_line() for r in self.unknown)
        return (f"systemd: {self.unit} does not know {len(self.unknown)} allowed device rule(s); "
                f"a daemon-reload would take them away: {rules}")


class Registration(record("Registration", "unit entries links skipped")):
    """What `register` did: DeviceAllow= `entries` added to `unit`, /dev links made, or why
    it did nothing (`skipped`)."""

    __slots__ = ()


def unit_of(cgroup_path: str) -> str | None:
    """The scope unit that owns a cgroup path ("/system.slice/docker-1.scope"), or None.

    Only the cgroup's own directory counts: runc's systemd driver makes the container's
    cgroup the scope itself; a cgroup below a scope is delegated and not systemd's to manage.
    Scopes of a user manager (user@UID.service) belong to another systemd instance.
    """
    parts = [p for p in cgroup_path.split("/") if p]
    if not parts or not parts[-1].endswith(".scope"):
        return None
    if any(p.startswith("user@") and p.endswith(".service") for p in parts):
        return None
    return parts[-1]


def _same_cgroup(control_group: str, cgroup_path: str) -> bool:
    """Whether systemd's ControlGroup= and the container's cgroup path name one cgroup (both
    as the host's cgroup namespace shows them)."""
    return bool(control_group) and "/" + control_group.strip("/") == "/" + cgroup_path.strip("/")


def device_entries(rule: DeviceRule, proc_devices: str = "") -> list:
    """The DeviceAllow= values that allow `rule` ("/dev/char/195:0 rw", "char-nvidia rw")."""
    kinds = ("char", "block") if rule.type == "a" else ("char" if rule.type == "c" else "block",)
    entries = []
    for kind in kinds:
        if rule.major == WILDCARD:
            name = "*"
        elif rule.minor == WILDCARD:
            name = _driver_names(proc_devices, kind).get(rule.major, str(rule.major))
        else:
            entries.append(f"/dev/{kind}/{rule.major}:{rule.minor} {rule.access}")
            continue
        entries.append(f"{kind}-{name} {rule.access}")
    return entries


def _driver_names(proc_devices: str, kind: str) -> dict:
    """major -> driver name for one section ("char" or "block") of /proc/devices."""
    section = {"Character devices:": "char", "Block devices:": "block"}
    names, current = {}, None
    for line in proc_devices.splitlines():
        line = line.strip()
        if line in section:
            current = section[line]
            continue
        fields = line.split(None, 1)
        if current == kind and len(fields) == 2 and fields[0].isdigit():
            names.setdefault(int(fields[0]), fields[1])
    return names


def parse_entry(entry: str, proc_devices: str = "") -> list:
    """DeviceRules for one DeviceAllow= value; [] for what cannot be resolved here."""
    path, _, access = entry.strip().partition(" ")
    access = access.strip() or "rwm"
    try:
        if path.startswith(("char-", "block-")):
            kind, _, name = path.partition("-")
            type_ = "c" if kind == "char" else "b"
            if name == "*":
                return [DeviceRule(type_, WILDCARD, WILDCARD, access)]
            if name.isdigit():
                return [DeviceRule(type_, int(name), WILDCARD, access)]
            import fnmatch  # only here: it brings in re, which the hook's path otherwise avoids

            return [DeviceRule(type_, major, WILDCARD, access)
                    for major, driver in sorted(_driver_names(proc_devices, kind).items())
                    if fnmatch.fnmatch(driver, name)]
        for kind, type_ in (("/dev/char/", "c"), ("/dev/block/", "b")):
            if path.startswith(kind):
                major, minor = path[len(kind):].split(":")
                return [DeviceRule(type_, int(major), int(minor), access)]
        st = os.stat(path)
    except (ValueError, OSError):
        return []
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        type_ = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return [DeviceRule(type_, os.major(st.st_rdev), os.minor(st.st_rdev), access)]
    return []


class Systemd:
    """The host's systemd as far as device grants go. Every path and the runner are
    parameters so tests can use a stand-in."""

    def __init__(self, systemctl: str | None = None, runtime_dir: str = RUNTIME_DIR, dev_dir: str = "/dev",
                 proc_devices: str = "/proc/devices", timeout: float = TIMEOUT, run=None):
        self.systemctl = systemctl
        self.runtime_dir = runtime_dir
        self.dev_dir = dev_dir.rstrip("/")
        self.proc_devices = proc_devices
        self.timeout = timeout
        self._run = run

    def running(self) -> bool:
        return os.path.isdir(self.runtime_dir)

    def _systemctl(self) -> str | None:
        if self.systemctl is not None:
            return self.systemctl if os.access(self.systemctl, os.X_OK) else None
        return next((path for path in SYSTEMCTL_CANDIDATES if os.access(path, os.X_OK)), None)

    def _call(self, args: list) -> tuple:
        """(exit status or None on timeout, output) of systemctl ARGS."""
        from gpuhook.kernel import child

        run = self._run or child.run
        result = run([self._systemctl(), "--no-pager", "--no-ask-password", *args], self.timeout)
        if result.timed_out:
            return None, f"timed out after {self.timeout:g}s"
        return result.status, result.output.decode("utf-8", "replace")

    def _devices_text(self) -> str:
        try:
            with open(self.proc_devices) as f:
                return f.read()
        except OSError:
            return ""

    def show(self, unit: str) -> UnitDevices:
        """The unit's LoadState, DevicePolicy and DeviceAllow=; raises OSError if systemctl fails."""
        status, output = self._call(["show", "--property=LoadState", "--property=DevicePolicy",
                                     "--property=DeviceAllow", "--property=ControlGroup", "--", unit])
        if status != 0:
            detail = " ".join(output.split())[-300:] if status is not None else output
            raise OSError(errno.EIO, f"systemctl show {unit}: {detail or f'exit status {status}'}")
        load_state, policy, entries, control_group = "", "", [], ""
        for line in output.splitlines():
            key, sep, value = line.partition("=")
            if not sep:
                continue
            if key == "LoadState":
                load_state = value.strip()
            elif key == "DevicePolicy":
                policy = value.strip()
            elif key == "DeviceAllow" and value.strip():
                entries.append(value.strip())
            elif key == "ControlGroup":
                control_group = value.strip()
        return UnitDevices(unit, load_state, policy, entries, control_group)

    def _unit_state(self, cgroup_path: str):
        """(unit, UnitDevices or None, UnitStatus for when there is nothing to compare)."""
        unit = unit_of(cgroup_path)
        if unit is None:
            return None, None, UnitStatus(None, NOT_A_SCOPE, [],
                                      f"the cgroup {cgroup_path} is not a scope of the system's systemd")
        if not self.running():
            return unit, None, UnitStatus(unit, NOT_RUNNING, [], "systemd is not running: a daemon-reload cannot "
                                                              "take grants away")
        if self._systemctl() is None:
            return unit, None, UnitStatus(unit, NO_SYSTEMCTL, [], "systemd is running but systemctl is missing")
        try:
            devices = self.show(unit)
        except OSError as err:
            return unit, None, UnitStatus(unit, UNREADABLE, [], str(err.strerror or err))
        if devices.load_state != "loaded":
            return unit, devices, UnitStatus(unit, NOT_LOADED, [], f"{unit} is not a loaded unit "
                                                               f"(LoadState={devices.load_state or '?'})")
        if not _same_cgroup(devices.control_group, cgroup_path):
            # A name is no identity: only the unit whose cgroup the container is in is the
            # container's (a cgroupfs path may end in any unit's name).
            return unit, devices, UnitStatus(unit, NOT_THE_UNIT, [],
                                             f"the cgroup {cgroup_path} is not {unit}'s "
                                             f"(ControlGroup={devices.control_group or 'none'})")
        if not devices.restricts:
            return unit, devices, UnitStatus(unit, UNRESTRICTED, [], f"{unit} does not restrict devices "
                                                                 f"(DevicePolicy={devices.policy or 'auto'})")
        return unit, devices, None

    def known_rules(self, devices: UnitDevices) -> list:
        text = self._devices_text()
        rules = [rule for entry in devices.entries for rule in parse_entry(entry, text)]
        if devices.policy in ("auto", "closed"):
            rules += PSEUDO_DEVICES
        return rules

    def status(self, cgroup_path: str, allowed) -> UnitStatus:
        """Which of the `allowed` rules the cgroup's unit does not know."""
        unit, devices, early = self._unit_state(cgroup_path)
        if early is not None:
            return early
        known = self.known_rules(devices)
        unknown = [rule for rule in allowed if rule.allow and not any(k.covers(rule) for k in known)]
        return UnitStatus(unit, RESTRICTS, unknown, f"{unit} restricts devices (DevicePolicy={devices.policy})")

    def register(self, cgroup_path: str, rules) -> Registration:
        """Add `rules` the unit does not know yet to its DeviceAllow= (runtime only) and
        make their /dev/char links. Raises ApplyError when systemd refuses."""
        unit, devices, early = self._unit_state(cgroup_path)
        if early is not None:
            if early.state in (UNREADABLE, NO_SYSTEMCTL):
                raise ApplyError("cgroup", f"cannot ask systemd about {unit}: {early.detail}",
                                 "without DeviceAllow= a daemon-reload would take the GPUs away")
            return Registration(unit, [], [], early.detail)
        known = self.known_rules(devices)
        missing = [rule for rule in rules if not any(k.covers(rule) for k in known)]
        try:
            links = self.ensure_links(rules)
        except OSError as err:
            raise ApplyError("cgroup", f"cannot make the {err.filename or 'device'} link systemd resolves "
                                       f"DeviceAllow= entries through: {err.strerror}") from err
        if not missing:
            return Registration(unit, [], links, None)
        text = self._devices_text()
        entries = [entry for rule in missing for entry in device_entries(rule, text)]
        status, output = self._call(["set-property", "--runtime", "--", unit]
                                    + [f"DeviceAllow={entry}" for entry in entries])
        if status != 0:
            detail = " ".join(output.split())[-300:] if status is not None else output
            raise ApplyError("cgroup", f"systemd did not add DeviceAllow= to {unit}: "
                                       f"{detail or f'systemctl exit status {status}'}")
        return Registration(unit, entries, links, None)

    def ensure_links(self, rules) -> list:
        """Make /dev/char/MAJ:MIN (/dev/block/...) links for concrete `rules` where missing;
        returns the links made. A device with no node under dev_dir gets none."""
        wanted = []
        for rule in rules:
            if rule.type in ("b", "c") and WILDCARD not in (rule.major, rule.minor):
                kind = "char" if rule.type == "c" else "block"
                link = f"{self.dev_dir}/{kind}/{rule.major}:{rule.minor}"
                if not _is_device(link, rule) and (link, rule) not in wanted:
                    wanted.append((link, rule))
        if not wanted:
            return []
        nodes = self._nodes()
        made = []
        for link, rule in wanted:
            node = nodes.get((rule.type, os.makedev(rule.major, rule.minor)))
            if node is None:
                continue
            directory = os.path.dirname(link)
            os.makedirs(directory, mode=0o755, exist_ok=True)
            # Made aside and renamed over: a stale link is replaced atomically.
            temp = f"{directory}/.{os.path.basename(link)}.gpuhook"
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
            os.symlink(os.path.relpath(node, directory), temp)
            os.rename(temp, link)
            made.append(link)
        return made

    def _nodes(self) -> dict:
        """(type, rdev) -> device node under dev_dir (one directory level deep)."""
        found = {}
        for top in sorted(os.listdir(self.dev_dir)) if os.path.isdir(self.dev_dir) else ():
            path = f"{self.dev_dir}/{top}"
            if top in ("char", "block"):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                try:
                    names = sorted(os.listdir(path))
                except OSError:
                    continue
                for name in names:
                    _record(found, f"{path}/{name}")
            else:
                _record(found, path)
        return found


def _record(found: dict, path: str) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISCHR(st.st_mode):
        found.setdefault(("c", st.st_rdev), path)
    elif stat.S_ISBLK(st.st_mode):
        found.setdefault(("b", st.st_rdev), path)


def _is_device(path: str, rule: DeviceRule) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    is_type = stat.S_ISCHR(st.st_mode) if rule.type == "c" else stat.S_ISBLK(st.st_mode)
    return is_type and st.st_rdev == os.makedev(rule.major, rule.minor)
