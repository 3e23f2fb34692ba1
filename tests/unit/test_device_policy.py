"""What a runtime's linux.resources.devices allows, as runc and crun read it (gpuhook.devrules.policy).

Literal rule lists in, the letters gpuhook may grant for one device out. A letter counts only
when runc (its emulator: in order, "a" resets, exceptions merged per device) AND crun on
cgroup v2 (last matching rule first) both allow every access set made of the granted letters.
"""

import pytest

from gpuhook.devrules import devices
from gpuhook.devrules.devices import char_device, parse_v1_line
from gpuhook.devrules.policy import RuntimeRules
from gpuhook.request.oci import CgroupRule


def rule(text: str, allow: bool = True) -> CgroupRule:
    """"c 195:2 rw" (or "a") as the spec's entry."""
    if text == "a":
        return CgroupRule(allow, "a", -1, -1, "rwm")
    kind, numbers, access = text.split()
    major, minor = numbers.split(":")
    return CgroupRule(allow, kind, -1 if major == "*" else int(major), -1 if minor == "*" else int(minor), access)


def deny(text: str) -> CgroupRule:
    return rule(text, allow=False)


DENY_ALL = deny("a")


@pytest.mark.parametrize("rules,gpu2,gpu3", [
    ([], "", ""),  # no rules: runc's and crun's own defaults only, which never open a GPU
    ([DENY_ALL], "", ""),
    ([DENY_ALL, rule("c 195:2 rwm")], "rw", ""),  # containerd and CRI-O for a CDI device
    ([DENY_ALL, rule("c 195:2 r")], "r", ""),  # podman --device /dev/nvidia2:/dev/nvidia2:r
    ([DENY_ALL, rule("c 195:2 m")], "", ""),  # a node may be made, never opened
    ([DENY_ALL, rule("c 195:* rw")], "rw", "rw"),
    # One exception must hold every letter of an access: O_RDWR asks for "rw" at once.
    ([DENY_ALL, rule("c 195:2 r"), rule("c 195:* w")], "r", "w"),
    ([rule("a")], "rw", "rw"),  # a privileged container's
    ([rule("a"), deny("c 195:2 w")], "r", "rw"),
    # runc takes "r" off the exception (leaving "w"); crun finds the deny first for "r" alone.
    ([DENY_ALL, rule("c 195:2 rw"), deny("c 195:2 r")], "w", ""),
    # A later deny-all resets everything before it.
    ([rule("c 195:2 rw"), DENY_ALL], "", ""),
    # runc refuses to punch a hole in a wildcard exception: it would not start this container.
    ([DENY_ALL, rule("c 195:* rw"), deny("c 195:2 w")], "", ""),
])
def test_the_letters_a_grant_may_keep(rules, gpu2, gpu3):
    policy = RuntimeRules(rules)
    assert policy.grantable(char_device(195, 2, "rw")).access == gpu2
    assert policy.grantable(char_device(195, 3, "rw")).access == gpu3


@pytest.mark.parametrize("rules,everything", [
    ([rule("a")], True),  # docker and podman --privileged
    ([DENY_ALL, rule("a")], True),  # a default deny-all in front resets
    ([rule("a"), rule("c 195:0 rw")], True),  # a later allow changes nothing
    ([], False),
    ([DENY_ALL], False),
    ([DENY_ALL, rule("c *:* rwm"), rule("b *:* rwm")], False),  # not runc's privileged shape
    ([rule("a"), DENY_ALL], False),
    ([rule("a"), deny("c 195:0 w")], False),  # a deny after it takes something away
    ([DENY_ALL, CgroupRule(True, "a", 195, -1, "rwm")], False),  # numbered: crun opens one major only
    ([DENY_ALL, CgroupRule(True, "a", -1, -1, "rw")], False),  # no m
    ([rule("a"), CgroupRule(True, "x", 1, 1, "r")], False),  # a rule runc refuses
])
def test_allows_everything_is_runcs_privileged_shape(rules, everything):
    assert RuntimeRules(rules).allows_everything() is everything
    if everything:  # and it agrees with what both readings allow
        assert RuntimeRules(rules).grantable(char_device(1, 7, "rwm")).access == "rwm"


def test_an_a_rule_with_numbers_is_read_as_each_runtime_reads_it():
    """runc: any "a" rule resets to allow-all; crun's program checks its major. Both must
    allow, so only major 195 is opened."""
    policy = RuntimeRules([DENY_ALL, CgroupRule(True, "a", 195, -1, "rwm")])
    assert policy.grantable(char_device(195, 2, "rw")).access == "rw"
    assert policy.grantable(char_device(510, 0, "rw")).access == ""


@pytest.mark.parametrize("bad", [CgroupRule(True, "u", 195, 2, "rwm"), CgroupRule(True, "c", 195, 2, ""),
                                 CgroupRule(True, "c", 195, 2, "rwx"), CgroupRule(True, "", 195, 2, "rw")])
def test_rules_runc_refuses_allow_nothing(bad):
    policy = RuntimeRules([rule("a"), bad])
    assert not policy.valid
    assert policy.grantable(char_device(195, 2, "rw")).access == ""


def test_allows_asks_for_the_whole_access_set_at_once():
    """runc merges "r" and "w" of one device into an "rw" exception; crun's program checks
    each rule alone, so an O_RDWR open finds no rule holding both: not allowed."""
    for second in ("c 195:2 w", "c 195:* w"):
        policy = RuntimeRules([DENY_ALL, rule("c 195:2 r"), rule(second)])
        assert policy.allows(char_device(195, 2, "r")) and policy.allows(char_device(195, 2, "w"))
        assert not policy.allows(char_device(195, 2, "rw"))
        assert policy.grantable(char_device(195, 2, "rw")).access == "r"
    assert RuntimeRules([DENY_ALL, rule("c 195:2 rw")]).allows(char_device(195, 2, "rw"))


# --- access sets ----------------------------------------------------------------------------

@pytest.mark.parametrize("a,b,union,intersection,difference", [
    ("rw", "m", "rwm", "", "rw"),
    ("mr", "wr", "rwm", "r", "m"),
    ("", "rwm", "rwm", "", ""),
    ("rwm", "rwm", "rwm", "rwm", ""),
])
def test_access_sets_combine_like_runcs_permissions(a, b, union, intersection, difference):
    assert (devices.union(a, b), devices.intersection(a, b), devices.difference(a, b)) == \
           (union, intersection, difference)


def test_the_subsets_of_an_access_come_largest_first():
    assert devices.subsets("rw") == ["rw", "r", "w"]
    assert devices.subsets("mr") == ["rm", "r", "m"]
    assert devices.subsets("") == []


def test_a_wildcard_rule_covers_only_what_it_matches_and_holds():
    wide = parse_v1_line("c 195:* rw")
    assert wide.covers(char_device(195, 7, "r")) and not wide.covers(char_device(195, 7, "rwm"))
    assert not wide.covers(char_device(510, 0, "r"))
    assert wide.with_access("").access == "" and wide.with_access("wr").access == "rw"


@pytest.mark.parametrize("rules,gpu0,gpu1", [
    # Issue 23, G1: everything allowed, then GPU 0 denied by name.
    ([rule("a"), deny("c 195:0 rwm")], "rw", ""),
    ([rule("a"), deny("c 195:* rwm")], "rw", "rw"),
    ([rule("a"), deny("c 195:0 w")], "w", ""),
    ([DENY_ALL, rule("c 195:* rw"), deny("c 195:0 rwm")], "rw", ""),
    ([DENY_ALL, deny("c 195:0 rwm")], "rw", ""),  # named, though deny-all already said it
    ([rule("a"), deny("c 195:0 m")], "", ""),  # gpuhook never asks for m
    # attack4 F1: a deny with a wildcard major, or of type a, that names the minor is explicit too.
    ([rule("a"), deny("c *:0 rwm")], "rw", ""),
    ([rule("a"), deny("c *:1 w")], "", "w"),
    ([rule("a"), deny("a 195:0 rwm")], "rw", ""),
    # attack4 F1c: each letter allowed alone, the pair refused together (crun's v2 program).
    ([rule("a"), deny("c 195:0 rw"), rule("c 195:0 r"), rule("c 195:0 w")], "rw", ""),
    # Blanket denials are the default a GPU request adds to: nothing explicit.
    ([], "", ""),
    ([DENY_ALL], "", ""),
    ([rule("a"), deny("c *:* rwm")], "", ""),
    ([rule("a"), deny("b 195:0 rwm")], "", ""),  # a block device of that number is another device
    # A later rule that opens the device again undoes the deny in both runtimes.
    ([deny("c 195:0 rwm"), rule("a")], "", ""),
    ([rule("a"), deny("c 195:0 rwm"), rule("c 195:0 rw")], "", ""),
])
def test_the_letters_the_runtime_explicitly_denies(rules, gpu0, gpu1):
    policy = RuntimeRules(rules)
    assert policy.denied(char_device(195, 0, "rw")) == gpu0
    assert policy.denied(char_device(195, 1, "rw")) == gpu1


@pytest.mark.parametrize("rules,named", [
    ([rule("a", False)], False),                                   # the default deny every grant adds to
    ([rule("a", False), rule("c *:* m")], False),                  # runc's mknod-everything default
    ([rule("a", False), rule("c 195:* r")], True),                 # every GPU, read-only
    ([rule("a", False), rule("c 195:1 m")], True),                 # podman --device ...:m
    ([rule("a", False), rule("c 195:2 rw")], False),               # another GPU
    ([rule("a", False), rule("c *:1 r")], True),                   # any major, this minor
    ([rule("a", False), rule("b 195:1 rw")], False),               # a block device of that number
    ([rule("a"), rule("c 195:1 rwm", False)], True),               # an explicit deny names it too
])
def test_a_rule_naming_a_number_of_the_device_is_the_runtimes_decision_about_it(rules, named):
    assert RuntimeRules(rules).names(char_device(195, 1, "rw")) is named
