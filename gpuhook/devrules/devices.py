"""Device cgroup rules as plain records, shared by the v1 (devices.allow) and v2 (eBPF) paths.

A rule is what runc calls a LinuxDeviceCgroup: type c, b or a (all), major and minor (-1 for
the wildcard "*"), an access string over "rwm", and allow or deny. `devices.list` text and
decoded eBPF programs both become these records, so tests compare rules, not formats.
"""

from gpuhook.record import record

WILDCARD = -1
ACCESS_ORDER = "rwm"


def normalize_access(access: str) -> str:
    if not access or any(c not in ACCESS_ORDER for c in access):
        raise ValueError(f"bad device access {access!r}: use letters from 'rwm'")
    return "".join(c for c in ACCESS_ORDER if c in access)


# Access sets, as runc's Permissions (devices/config/device.go) has them: strings over "rwm"
# in that order, "" for none. One place for the letter arithmetic the grant and its undo need.

def union(a: str, b: str) -> str:
    return "".join(c for c in ACCESS_ORDER if c in a or c in b)


def intersection(a: str, b: str) -> str:
    return "".join(c for c in ACCESS_ORDER if c in a and c in b)


def difference(a: str, b: str) -> str:
    return "".join(c for c in ACCESS_ORDER if c in a and c not in b)


def is_subset(a: str, b: str) -> bool:
    return not difference(a, b)


def subsets(access: str) -> list:
    """Every non-empty subset of `access`, largest first (then in "rwm" order): the access
    sets one open(2) or mknod(2) can ask a device cgroup for at once."""
    letters = union(access, "")
    found = ["".join(c for i, c in enumerate(letters) if mask >> i & 1) for mask in range(1, 1 << len(letters))]
    return sorted(found, key=lambda s: (-len(s), [ACCESS_ORDER.index(c) for c in s]))


class DeviceRule(record("DeviceRule", "type major minor access allow")):
    __slots__ = ()

    def __new__(cls, type, major, minor, access, allow=True):
        if type not in ("a", "b", "c"):
            raise ValueError(f"bad device type {type!r}: use a, b or c")
        return super().__new__(cls, type, major, minor, normalize_access(access), allow)

    def v1_line(self) -> str:
        """The text written to devices.allow / devices.deny, e.g. "c 195:0 rw"."""
        major = "*" if self.major == WILDCARD else str(self.major)
        minor = "*" if self.minor == WILDCARD else str(self.minor)
        return f"{self.type} {major}:{minor} {self.access}"

    def __str__(self) -> str:
        return ("allow " if self.allow else "deny ") + self.v1_line()

    def matches(self, other: "DeviceRule") -> bool:
        """True if this rule applies to every device `other` names (the same device, or a
        wildcard over it), whatever the access."""
        return (
            (self.type == "a" or self.type == other.type)
            and (self.type == "a" or self.major in (WILDCARD, other.major))
            and (self.type == "a" or self.minor in (WILDCARD, other.minor))
        )

    def same_device(self, other: "DeviceRule") -> bool:
        """True if both rules name exactly the same device (or the same wildcard)."""
        return (self.type, self.major, self.minor) == (other.type, other.major, other.minor)

    def covers(self, other: "DeviceRule") -> bool:
        """True if this allow rule grants everything `other` asks for."""
        return self.allow and self.matches(other) and is_subset(other.access, self.access)

    def with_access(self, access: str) -> "DeviceRule":
        """This rule for `access` instead ("" allowed: a rule that grants nothing)."""
        return self._replace(access=union(access, ""))

    def as_dict(self) -> dict:
        return {
            "type": self.type,
            "major": None if self.major == WILDCARD else self.major,
            "minor": None if self.minor == WILDCARD else self.minor,
            "access": self.access,
            "allow": self.allow,
        }


def parse_v1_line(line: str, allow: bool = True) -> DeviceRule:
    """Parse one devices.list line ("c 195:* rwm", "a *:* rwm")."""
    try:
        type_, numbers, access = line.split()
        major, minor = numbers.split(":")
        return DeviceRule(
            type_,
            WILDCARD if major == "*" else int(major),
            WILDCARD if minor == "*" else int(minor),
            access,
            allow,
        )
    except ValueError as err:
        raise ValueError(f"bad device rule {line!r}: {err}") from None


def char_device(major: int, minor: int, access: str = "rw") -> DeviceRule:
    return DeviceRule("c", major, minor, access, True)


def without_letters(rules, taken) -> list:
    """`rules` less the access letters `taken` names for the same device (DeviceRule.same_device);
    a rule left with no letter goes."""
    left = []
    for rule in rules:
        gone = "".join(t.access for t in taken if t.same_device(rule))
        letters = "".join(c for c in rule.access if c not in gone)
        if letters:
            left.append(rule.with_access(letters))
    return left
