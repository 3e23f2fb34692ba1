"""What gpuhook prints and logs cannot be turned against the operator: no forged lines, no
terminal escapes, no root-only file contents, no log in a directory others can write."""

import os
import pytest
from conftest import require_root_tools
from gpuhook import journal
from gpuhook.apply.cgroup import v1
from gpuhook.errors import ApplyError


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


HOSTILE_UUID = "GPU-../../etc/cron.d/x\x1b[31m"


@pytest.mark.root
@pytest.mark.parametrize("where", ["proc", "nvml"])
def test_a_uuid_the_driver_reports_in_no_uuid_form_is_a_host_error_not_a_traceback(tmp_path, where):
    """UUIDs name state files and log lines. One the driver (its /proc files, or NVML) reports
    in another form is a host fault: one line and exit 4, never exit 70 or a file named by it."""
    require_root_tools("gcc")
    import subprocess
    import sys

    from gpuhook.simulate import host as simhost

    sim = simhost.build(str(tmp_path / "host"), gpus=2, seed="hostile-uuid")
    good = sim["gpus"][0]["uuid"]
    files = [tmp_path / "host" / "nvml.json"] if where == "nvml" else \
        list((tmp_path / "host" / "proc").rglob("information"))
    for path in files:
        path.write_text(path.read_text().replace(good, HOSTILE_UUID.replace("\x1b", "\\u001b") if where == "nvml"
                                                 else HOSTILE_UUID))
    config = str(tmp_path / "host" / "config.toml")
    # proc: the inventory itself is refused (exit 4). nvml: the list shows what /proc says and
    # notes NVML's refusal; the check finds GPU 0 unreachable by its real UUID (exit 6).
    expected = ({("list",): 4, ("check",): 4, ("prepare", "--devices", "1"): 4} if where == "proc"
                else {("list",): 0, ("check",): 6})
    for args, code in expected.items():
        done = subprocess.run([sys.executable, "-m", "gpuhook", *args, "--config", config], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == code, (args, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and "\x1b" not in done.stdout + done.stderr, done.stderr
        assert len([line for line in done.stderr.splitlines() if line.startswith("gpuhook:")]) <= 1
        if where == "proc" or args == ("list",):
            assert "not a GPU" in done.stdout + done.stderr
    assert not list((tmp_path / "host").rglob("*cron*"))
