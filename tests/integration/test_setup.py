"""scripts/setup (README, "Try it"): it says what it does before each slow step, and nothing
when nothing is missing."""

import os
import subprocess

import pytest

from conftest import REPO, require_root_tools

pytestmark = pytest.mark.root


def test_setup_announces_each_step_it_takes_and_is_silent_when_nothing_is_missing(tmp_path):
    """A copy of the tree without the generated stubs, on this checkout's .venv and Debian
    packages: the one step left to do is announced; a second run prints nothing."""
    require_root_tools("git")
    copy = tmp_path / "gpuhook"
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout
    subprocess.run(["tar", "-C", REPO, "--null", "-T", "-", "-cf", str(tmp_path / "tree.tar")], input=files,
                   check=True)
    copy.mkdir()
    subprocess.run(["tar", "-C", str(copy), "-xf", str(tmp_path / "tree.tar")], check=True)
    os.symlink(os.path.join(REPO, ".venv"), copy / ".venv")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    first = subprocess.run([str(copy / "scripts" / "setup")], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        "scripts/setup: 5/5 generating the device plugin's gRPC stubs from gpuhook/plugin/deviceplugin.proto",
        "scripts/setup: ready"], first.stdout
    assert (copy / "gpuhook" / "plugin" / "generated" / "deviceplugin_pb2_grpc.py").exists()
    again = subprocess.run([str(copy / "scripts" / "setup")], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == "", again
