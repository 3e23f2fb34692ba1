"""gpuhook's own state files (caches, health reports, registry) cannot be forged or read by.

The tests of it that need no root; those that do are in tests/integration/test_state_files.py.
"""

import os
import stat
import pytest
from gpuhook.apply import statefiles


@pytest.fixture
def umask_zero():
    old = os.umask(0)  # what a runtime started with umask 0 hands the hook
    yield
    os.umask(old)


def test_state_files_and_their_directories_are_private_under_a_umask_of_0(tmp_path, umask_zero):
    path = tmp_path / "run" / "gpuhook" / "health" / "report.json"
    statefiles.write_atomic(str(path), {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for parent in (tmp_path / "run", tmp_path / "run" / "gpuhook"):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o755  # made 0755, not 0777


def test_health_reports_and_registry_entries_are_readable_by_root_only(tmp_path, umask_zero):
    from gpuhook.health import store

    path = tmp_path / "state" / "health" / "x.json"
    store.write_json(str(path), {"pod": "secret-pod"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
