"""The rule sets behind tests/data/bpf/*.txt and a reader for those golden files, shared by
tests/unit/test_cgroup_program.py and tests/integration/test_cgroup_v2.py."""

import os

from gpuhook.devrules.devices import DeviceRule, parse_v1_line

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "bpf")


def R(text: str, allow: bool = True) -> DeviceRule:
    """DeviceRule from devices.list notation: R("c 195:* rw")."""
    return parse_v1_line(text, allow)


# The rule sets behind tests/data/bpf/*.txt (its README says how those files were made).
RULE_SETS = {
    "gpu-plan": [R("c 195:255 rw"), R("c 509:0 rw"), R("c 509:1 rw"), R("c 195:0 rw")],
    "wildcards": [R("c 195:* rw"), R("b *:* rwm"), R("c *:* m"), R("a *:* r")],
    "block-partial": [R("b 8:0 r"), R("b 259:* rw"), R("c 10:200 rwm"), R("c 1:3 w"), R("b 7:1 m")],
}


def golden(name: str) -> list:
    with open(f"{DATA}/{name}.txt") as f:
        return f.read().splitlines()
