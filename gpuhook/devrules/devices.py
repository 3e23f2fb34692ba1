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

    def covers(self, other: "DeviceRule") -> bool:
        """True if this allow rule grants everything `other` asks for."""
        return (
            self.allow
            and (self.type == "a" or self.type == other.type)
            and (self.type == "a" or self.major in (WILDCARD, other.major))
            and (self.type == "a" or self.minor in (WILDCARD, other.minor))
            and set(other.access) <= set(self.access)
        )

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
