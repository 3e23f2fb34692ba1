"""gpuhook.apply.cgroup.v1 against directories that stand in for a devices cgroup (no root needed).

The kernel takes one rule per write(2) and answers with devices.list. Like runc's
devices/v1.go, gpuhook reads the list back after writing: a write the kernel took without
the list then allowing the rule (here a plain file, which takes any write and never changes
the list) fails the grant and undoes it, instead of a start that reports a GPU the container
cannot open.
"""

import pytest

from gpuhook.apply.cgroup import v1
from gpuhook.devrules.devices import char_device
from gpuhook.errors import ApplyError


def cgroup_dir(tmp_path, listed: str):
    for name, text in (("devices.list", listed), ("devices.allow", ""), ("devices.deny", "")):
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_grant_the_list_does_not_show_afterwards_fails_and_is_undone(tmp_path):
    directory = cgroup_dir(tmp_path, "c 1:3 rwm\nc 136:* rwm\n")
    with pytest.raises(ApplyError) as caught:
        v1.grant(str(directory), [char_device(195, 0)])
    assert caught.value.one_line() == (f"cgroup: {directory}/devices.list does not allow c 195:0 rw after it was "
                                       f"written to devices.allow")
    assert (directory / "devices.allow").read_text() == "c 195:0 rw"
    assert (directory / "devices.deny").read_text() == "c 195:0 rw"  # taken back


def test_a_grant_the_list_already_holds_writes_nothing(tmp_path):
    directory = cgroup_dir(tmp_path, "c 195:* rwm\n")
    assert v1.grant(str(directory), [char_device(195, 0), char_device(195, 1, "r")]) == []
    assert (directory / "devices.allow").read_text() == ""
