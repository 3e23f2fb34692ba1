"""Device access on pure cgroup v2: real runc containers, real eBPF device programs.

The tests of it that need no root; those that do are in tests/integration/test_cgroup_v2.py.
"""

import json
import os
import subprocess
import sys
import pytest
from gpuhook.apply.cgroup import systemd, v2
from gpuhook.devrules.devices import DeviceRule, parse_v1_line
from gpuhook.errors import ApplyError


def R(text: str, allow: bool = True) -> DeviceRule:
    return parse_v1_line(text, allow)


# /proc/self/mountinfo inside `unshare -m` after `mount -t cgroup2 cgroup2 /sys/fs/cgroup` on a
# hybrid host (this machine): the v1 mounts are still listed, but under the new cgroup2 mount.
HYBRID_WITH_V2_ON_TOP = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
66 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw
"""


HYBRID = "\n".join(HYBRID_WITH_V2_ON_TOP.splitlines()[:4]) + "\n"


@pytest.mark.parametrize("mountinfo,devices_path,expected", [
    # A container runc put on v2 (in a private mount namespace), seen from the hybrid host:
    # its policy is its v2 cgroup's programs, not the v1 root's "allow all".
    (HYBRID, "/", ("v2", "/sys/fs/cgroup/unified/ctr")),
    (HYBRID, "/ctr", ("v1", "/sys/fs/cgroup/devices/ctr")),
    (HYBRID_WITH_V2_ON_TOP, "/", ("v2", "/sys/fs/cgroup/ctr")),
])
def test_policy_is_found_where_the_runtime_put_it(tmp_path, mountinfo, devices_path, expected):
    from gpuhook.apply.cgroup import hierarchy

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(f"9:name=systemd:/\n5:devices:{devices_path}\n0::/ctr\n")
    place = hierarchy.placement(42, proc=str(tmp_path), mountinfo=mountinfo)
    assert (place.mode, place.directory) == expected


def test_a_v2_policy_this_namespace_cannot_see_is_said_not_guessed(tmp_path):
    from gpuhook.apply.cgroup import hierarchy
    from gpuhook.errors import HostError

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("5:devices:/\n0::/ctr\n")
    only_v1 = "36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
    with pytest.raises(HostError) as caught:
        hierarchy.placement(42, proc=str(tmp_path), mountinfo=only_v1)
    assert "on cgroup v2 (/ctr), which is not mounted in this mount namespace" in caught.value.one_line()
    assert "nsenter" in caught.value.one_line()


def test_hidden_v1_devices_cgroup_that_restricts_is_an_error_not_a_silent_v2(tmp_path):
    from gpuhook.apply.cgroup import hierarchy
    from gpuhook.errors import HostError

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("5:devices:/ctr\n0::/ctr\n")
    with pytest.raises(HostError, match="no devices hierarchy is mounted here"):
        hierarchy.placement(42, proc=str(tmp_path), mountinfo=HYBRID_WITH_V2_ON_TOP)


def test_cgroup_show_reads_devices_list_on_v1(tmp_path):
    cgroup = tmp_path / "docker-1.scope"
    cgroup.mkdir()
    (cgroup / "devices.list").write_text("c 1:3 rwm\nc 195:0 rw\nc 136:* rwm\n")
    done = subprocess.run([sys.executable, "-m", "gpuhook", "cgroup", "show", "--path", str(cgroup), "--json"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "v1" and report["programs"] is None
    assert [(r["type"], r["major"], r["minor"], r["access"]) for r in report["rules"]] == [
        ("c", 1, 3, "rwm"), ("c", 195, 0, "rw"), ("c", 136, None, "rwm")]


def test_cgroup_show_needs_exactly_one_of_pid_and_path():
    done = subprocess.run([sys.executable, "-m", "gpuhook", "cgroup", "show"], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode != 0
    assert done.stderr == "gpuhook: give either --pid PID or --path CGROUP_DIR\n"


FAKE_SYSTEMCTL = r"""#!/bin/sh
# Stand-in for systemctl: logs its arguments; `show` prints the unit file $DIR/unit plus what
# set-property added ($DIR/added) and the unit's ControlGroup= from $DIR/cgroup.<unit> (the
# unit is the last argument); set-property fails with $DIR/refuse's text if that exists.
DIR=$(dirname "$0")
echo "$*" >> "$DIR/calls"
for last; do :; done
for arg; do case "$arg" in
  show) cat "$DIR/unit" "$DIR/added" 2>/dev/null
        printf 'ControlGroup=%s\n' "$(cat "$DIR/cgroup.$last" 2>/dev/null)"; exit 0 ;;
  set-property)
    if [ -f "$DIR/refuse" ]; then cat "$DIR/refuse" >&2; exit 1; fi
    for a; do case "$a" in DeviceAllow=*) echo "$a" >> "$DIR/added" ;; esac; done
    exit 0 ;;
esac; done
exit 2
"""


PROC_DEVICES = "Character devices:\n  1 mem\n136 pts\n195 nvidia-frontend\n509 nvidia-uvm\n\nBlock devices:\n  8 sd\n"


class FakeSystemd:
    """A Systemd wired to a stand-in systemctl, runtime dir, /dev and /proc/devices in a temp dir."""

    def __init__(self, tmp_path, unit_text="", running=True, control_groups=()):
        """`control_groups`: the cgroup paths of the units to answer ControlGroup= for (the
        unit is the path's last component), as systemd places them."""
        self.dir = tmp_path / "systemctl"
        self.dir.mkdir()
        (self.dir / "systemctl").write_text(FAKE_SYSTEMCTL)
        (self.dir / "systemctl").chmod(0o755)
        (self.dir / "unit").write_text(unit_text)
        for path in control_groups:
            (self.dir / f"cgroup.{path.rsplit('/', 1)[-1]}").write_text(path)
        runtime = tmp_path / "run-systemd-system"
        if running:
            runtime.mkdir()
        self.dev = tmp_path / "dev"
        self.dev.mkdir()
        (tmp_path / "devices").write_text(PROC_DEVICES)
        self.systemd = systemd.Systemd(systemctl=str(self.dir / "systemctl"), runtime_dir=str(runtime),
                                       dev_dir=str(self.dev), proc_devices=str(tmp_path / "devices"))

    def calls(self) -> list:
        try:
            return (self.dir / "calls").read_text().splitlines()
        except FileNotFoundError:
            return []

    def node(self, name, major, minor):
        os.mknod(self.dev / name, 0o20666, os.makedev(major, minor))


RUNC_SCOPE_UNIT = ("LoadState=loaded\nDevicePolicy=strict\nDeviceAllow=/dev/char/1:3 rwm\n"
                   "DeviceAllow=char-pts rwm\n")


GPU_RULES = [R("c 195:255 rw"), R("c 195:0 rw"), R("c 1:3 rw")]


def test_registering_again_finds_everything_known_and_calls_only_show(tmp_path):
    fake = FakeSystemd(tmp_path, RUNC_SCOPE_UNIT, control_groups=["/kubepods.slice/cri-containerd-1.scope"])
    fake.systemd.register("/kubepods.slice/cri-containerd-1.scope", GPU_RULES)
    again = fake.systemd.register("/kubepods.slice/cri-containerd-1.scope", GPU_RULES)
    assert again.entries == []
    assert [call.split()[2] for call in fake.calls()] == ["show", "set-property", "show"]


@pytest.mark.parametrize("cgroup_path,unit_text,running,why", [
    ("/docker/abc", RUNC_SCOPE_UNIT, True, "not a scope of the system's systemd"),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/c.scope", RUNC_SCOPE_UNIT, True,
     "not a scope of the system's systemd"),
    ("/system.slice/docker-abc.scope", RUNC_SCOPE_UNIT, False, "systemd is not running"),
    ("/system.slice/docker-abc.scope", "LoadState=not-found\n", True, "LoadState=not-found"),
    ("/system.slice/docker-abc.scope", "LoadState=loaded\nDevicePolicy=auto\n", True, "does not restrict devices"),
    # A cgroupfs path that merely ends in another unit's name is not that unit's cgroup.
    ("/attacker/init.scope", RUNC_SCOPE_UNIT, True, "is not init.scope's (ControlGroup=/init.scope)"),
    ("/attacker/docker-abc.scope", RUNC_SCOPE_UNIT, True,
     "is not docker-abc.scope's (ControlGroup=/system.slice/docker-abc.scope)"),
    ("/attacker/session-1.scope", RUNC_SCOPE_UNIT, True, "is not session-1.scope's (ControlGroup=none)"),
])
def test_registration_is_skipped_where_systemd_would_not_drop_the_grant(tmp_path, cgroup_path, unit_text,
                                                                          running, why):
    fake = FakeSystemd(tmp_path, unit_text, running,
                       control_groups=["/system.slice/docker-abc.scope", "/init.scope"])
    done = fake.systemd.register(cgroup_path, GPU_RULES)
    assert done.entries == [] and why in done.skipped
    assert not [call for call in fake.calls() if "set-property" in call]  # never switches an allow list on


def test_systemd_refusal_is_one_clear_line(tmp_path):
    fake = FakeSystemd(tmp_path, RUNC_SCOPE_UNIT, control_groups=["/system.slice/docker-abc.scope"])
    (fake.dir / "refuse").write_text("Failed to set unit properties on docker-abc.scope: Access denied\n")
    with pytest.raises(ApplyError) as caught:
        fake.systemd.register("/system.slice/docker-abc.scope", GPU_RULES)
    assert caught.value.one_line() == ("cgroup: systemd did not add DeviceAllow= to docker-abc.scope: "
                                       "Failed to set unit properties on docker-abc.scope: Access denied")


def test_show_marks_allowed_devices_that_systemd_does_not_know(tmp_path):
    fake = FakeSystemd(tmp_path, RUNC_SCOPE_UNIT, control_groups=["/docker-abc.scope"])
    cgroup = tmp_path / "docker-abc.scope"
    cgroup.mkdir()
    (cgroup / "devices.list").write_text("c 1:3 rwm\nc 136:* rwm\nc 195:0 rw\n")
    report = v2.describe(v2.placement_of_directory(str(cgroup), mountinfo=""), systemd=fake.systemd)
    assert report.systemd.at_risk == [R("c 195:0 rw")]
    from gpuhook.cli.cgroupcmd import render

    lines = render(report)
    (gpu_row,) = [line for line in lines if line.startswith("  ") and " 195:0 " in line]
    assert gpu_row.rstrip().endswith("NOT KNOWN")
    assert lines[-1] == ("systemd: docker-abc.scope does not know 1 allowed device rule(s); "
                         "a daemon-reload would take them away: c 195:0 rw")
    assert report.cgroup_path == "/docker-abc.scope"
    fake.systemd.register(report.cgroup_path, [R("c 195:0 rw")])
    assert fake.systemd.status(report.cgroup_path, report.allowed()).at_risk == []


@pytest.mark.parametrize("entry,rules", [
    ("/dev/char/195:0 rw", [R("c 195:0 rw")]),
    ("/dev/block/8:0 r", [R("b 8:0 r")]),
    ("char-pts rwm", [R("c 136:* rwm")]),
    ("char-nvidia* rw", [R("c 195:* rw"), R("c 509:* rw")]),
    ("char-* m", [R("c *:* m")]),
    ("block-sd", [R("b 8:* rwm")]),
    ("/dev/no-such-node rw", []),
])
def test_device_allow_entries_are_read_as_rules(tmp_path, entry, rules):
    assert systemd.parse_entry(entry, PROC_DEVICES) == rules


@pytest.mark.parametrize("rule,entries", [
    (R("c 195:0 rw"), ["/dev/char/195:0 rw"]),
    (R("c 195:* rw"), ["char-nvidia-frontend rw"]),
    (R("c 77:* r"), ["char-77 r"]),
    (R("a *:* m"), ["char-* m", "block-* m"]),
])
def test_rules_become_the_device_allow_entries_systemd_understands(rule, entries):
    assert systemd.device_entries(rule, PROC_DEVICES) == entries
