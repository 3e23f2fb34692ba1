"""What the runtime's own device rules (linux.resources.devices) allow a container, pure.

gpuhook never widens what the runtime allowed (docs/security.md): a device node the runtime
put in linux.devices is a grant only as far as these rules open it, letter by letter. The
rules are read the way the runtimes that enforce them read them, and a device access counts
as allowed only when every one of them allows it:

- runc (cgroup v1 and v2; opencontainers/cgroups devices/devices_emulator.go, which runc's
  v2 device filter also runs through): the rules are applied in order to a device cgroup
  that denies everything. An ``a`` rule (whatever its numbers and letters) resets it to
  allow-all or deny-all; under deny-all an allow rule adds an exception (letters merged with
  those of the same device), a deny rule takes letters off the exception of exactly the
  same device, and taking letters a wildcard exception of that device also has is an error
  (runc refuses the container). Under deny-all an access is allowed when ONE exception
  matching the device has all its letters (the kernel's match_exception, which an O_RDWR
  open asks once for "rw"); under allow-all it is denied when any matching exception shares
  a letter with it (the kernel's v1 check; runc's v2 filter denies less). crun on cgroup v1
  writes the same rules to devices.allow and devices.deny, which the kernel treats the same
  way.
- crun on cgroup v2 (src/libcrun/cgroup-resources.c, create_dev_bpf, and ebpf.c): one
  program checks the rules from the LAST to the first; the first whose type, numbers and
  letters (all of the access asked for) match decides; none matching denies.

Both runtimes put their default devices (``/dev/null`` and friends, and ``m`` on every
device) in front of or behind these rules; they are left out here, which can only make
the answer stricter: gpuhook never asks for those devices nor for ``m``. A rule set runc
would refuse (a type other than a, b, c; access letters other than rwm, or none) allows
nothing.
"""

from gpuhook.devrules.devices import ACCESS_ORDER, WILDCARD, DeviceRule, intersection, is_subset, subsets, union
from gpuhook.record import record

TYPES = ("a", "b", "c")


class _Exception(record("_Exception", "type major minor")):
    """The device part of a runc emulator exception (no "a": an "a" rule resets instead)."""

    __slots__ = ()

    def matches(self, device: DeviceRule) -> bool:
        return (self.type == device.type and self.major in (WILDCARD, device.major)
                and self.minor in (WILDCARD, device.minor))


class RuntimeRules:
    """The runtime's device rules (oci.CgroupRule, in spec order), ready to be asked what they
    allow (see the module docstring)."""

    def __init__(self, rules):
        self.rules = tuple(rules)
        self.valid = all(r.type in TYPES and r.access and all(c in ACCESS_ORDER for c in r.access)
                         for r in self.rules)
        self._runc = _emulate(self.rules) if self.valid else None

    def allows_everything(self) -> bool:
        """True if the rules open every device with every letter in both readings, as runc's
        privileged containers (docker and podman --privileged write ``allow a *:* rwm``): the
        last ``a`` rule is that allow, and only allow rules follow it. runc's emulator resets
        to allow-all there and an allow then changes nothing; crun's program reaches it for
        any access no later allow already decided. Anything less (no such rule, a deny after
        it, fewer letters or numbered majors) is not everything."""
        if not self.valid:
            return False
        last = max((i for i, r in enumerate(self.rules) if r.type == "a"), default=None)
        if last is None:
            return False
        rule = self.rules[last]
        return (rule.allow and rule.major == WILDCARD and rule.minor == WILDCARD
                and is_subset(ACCESS_ORDER, rule.access)
                and all(later.allow for later in self.rules[last + 1:]))

    def allows(self, device: DeviceRule) -> bool:
        """True if every runtime allows the access set `device.access` (all of it at once,
        as one open(2) asks) on the device `device` names."""
        if not self.valid or not device.access:
            return False
        return _runc_allows(self._runc, device) and _crun_v2_allows(self.rules, device)

    def names(self, device: DeviceRule) -> bool:
        """True if a rule that names a number (not a rule for every device: ``a``, ``c *:*``)
        matches `device`: the runtime (or its user: ``podman --device …:r``, a rule written
        for the container) decided about this device, so its letters are final and a GPU
        request may not add to them."""
        return any((rule.major != WILDCARD or rule.minor != WILDCARD) and rule.type in ("a", device.type)
                   and rule.major in (WILDCARD, device.major) and rule.minor in (WILDCARD, device.minor)
                   for rule in self.rules)

    def denied(self, wanted: DeviceRule) -> str:
        """The letters of `wanted.access` the runtime's rules EXPLICITLY deny: "" when none.

        A deny is explicit when it names a number (``c 195:0``, ``c 195:*``, ``c *:0``,
        ``a 195:0``) and matches the device: only a deny of every device (``a``, ``c *:*``)
        is the default a GPU request exists to add to. Where such a deny matches, every letter
        the rules do not allow is the runtime (or its user) saying no, and so is the whole
        access when the rules refuse it together though they allow each letter alone (crun's
        v2 program matches a rule only if it holds the whole access). Granting any of it would
        widen what the runtime allowed: on cgroup v1 an allow of the device removes the
        runtime's deny exception from an allow-all cgroup, on v2 a program that allows it lets
        it through."""
        if not any(not rule.allow and (rule.major != WILDCARD or rule.minor != WILDCARD)
                   and rule.type in ("a", wanted.type) and rule.major in (WILDCARD, wanted.major)
                   and rule.minor in (WILDCARD, wanted.minor) and set(rule.access or "rwm") & set(wanted.access)
                   for rule in self.rules):
            return ""
        letters = "".join(c for c in wanted.access if not self.allows(wanted.with_access(c)))
        if not letters and wanted.access and not self.allows(wanted):
            letters = wanted.access
        return letters

    def grantable(self, wanted: DeviceRule) -> DeviceRule:
        """`wanted` cut down to the letters the runtime already allows, so that an allow rule
        for them lets through nothing the runtime's rules deny: the largest subset of
        wanted.access every non-empty subset of which `allows` (the access "" when none)."""
        for letters in subsets(wanted.access):
            if all(self.allows(wanted.with_access(part)) for part in subsets(letters)):
                return wanted.with_access(letters)
        return wanted.with_access("")


def _emulate(rules):
    """runc's emulator run over `rules`: (default_allow, {_Exception: letters}), or None when
    runc refuses them (a deny that punches a hole in a wildcard exception)."""
    default_allow, exceptions = False, {}
    for rule in rules:
        if rule.type == "a":
            default_allow, exceptions = rule.allow, {}
            continue
        key = _Exception(rule.type, rule.major, rule.minor)
        letters = union(rule.access, "")
        if rule.allow != default_allow:
            exceptions[key] = union(exceptions.get(key, ""), letters)
            continue
        for partial in ((rule.type, WILDCARD, rule.minor), (rule.type, rule.major, WILDCARD),
                        (rule.type, WILDCARD, WILDCARD)):
            partial = _Exception(*partial)
            if partial != key and intersection(exceptions.get(partial, ""), letters):
                return None
        left = "".join(c for c in exceptions.get(key, "") if c not in letters)
        if left:
            exceptions[key] = left
        else:
            exceptions.pop(key, None)
    return default_allow, exceptions


def _runc_allows(state, device: DeviceRule) -> bool:
    if state is None:
        return False
    default_allow, exceptions = state
    matching = [letters for key, letters in exceptions.items() if key.matches(device)]
    if default_allow:
        return not any(intersection(letters, device.access) for letters in matching)
    return any(is_subset(device.access, letters) for letters in matching)


def _crun_v2_allows(rules, device: DeviceRule) -> bool:
    for rule in reversed(rules):
        if rule.type != "a" and rule.type != device.type:
            continue
        if rule.major != WILDCARD and rule.major != device.major:
            continue
        if rule.minor != WILDCARD and rule.minor != device.minor:
            continue
        if is_subset(device.access, union(rule.access, "")):
            return rule.allow
    return False
