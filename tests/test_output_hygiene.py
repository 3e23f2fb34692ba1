"""What gpuhook prints and logs cannot be turned against the operator: no forged lines, no
terminal escapes, no root-only file contents, no log in a directory others can write."""

import os

import pytest

from conftest import require_root_tools

from gpuhook import journal
from gpuhook.cgroup import v1
from gpuhook.errors import ApplyError, InputError, printable


def test_error_lines_carry_no_control_characters():
    err = InputError("pod \x1b]0;owned\x07name\nFAKE LINE\r\u202eevil")
    line = err.one_line()
    assert "\n" not in line and "\x1b" not in line and "\r" not in line and "\u202e" not in line
    assert line.startswith("pod ?]0;owned?name FAKE LINE")


def test_printable_keeps_ordinary_text():
    assert printable("GPU 0 (GPU-abc) ünïcode 中") == "GPU 0 (GPU-abc) ünïcode 中"


@pytest.mark.root
def test_cgroup_show_does_not_read_a_file_linked_as_devices_list(tmp_path):
    require_root_tools()
    secret = tmp_path / "root-only"
    secret.write_text("ROOT-SECRET first line\n")
    os.chmod(secret, 0o600)
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "devices.list").symlink_to(secret)
    with pytest.raises(ApplyError) as caught:
        v1.current_rules(str(tmp_path / "cg"))
    assert "ROOT-SECRET" not in caught.value.one_line()
    (tmp_path / "cg" / "devices.list").unlink()
    (tmp_path / "cg" / "devices.list").write_text("ROOT-SECRET\n")  # not a rule: never quoted back
    with pytest.raises(ApplyError) as caught:
        v1.current_rules(str(tmp_path / "cg"))
    assert "ROOT-SECRET" not in caught.value.one_line() and "not a device rule" in caught.value.one_line()


@pytest.mark.root
def test_the_log_is_not_written_in_a_directory_others_can_write(tmp_path):
    require_root_tools()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert journal.write(str(shared / "gpuhook.log"), {"decision": "x"}) is False
    private = tmp_path / "private"
    private.mkdir(mode=0o755)
    assert journal.write(str(private / "gpuhook.log"), {"decision": "x"}) is True
    os.chown(private / "gpuhook.log", 65534, 65534)  # a file another user left there
    assert journal.write(str(private / "gpuhook.log"), {"decision": "y"}) is False
    os.mkfifo(private / "fifo.log")
    assert journal.write(str(private / "fifo.log"), {"decision": "z"}) is False  # and it did not block
