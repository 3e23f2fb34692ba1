"""The test suite's own promise: tests/unit runs as an ordinary user, with nothing skipped.

The tests of it that need no root; those that do are in tests/integration/test_layout.py.
"""

import os
from conftest import REPO


def test_every_test_file_is_in_one_part():
    here = os.path.join(REPO, "tests")
    assert not [name for name in os.listdir(here) if name.startswith("test_")], "put it in unit/ or integration/"


class _Item:
    """What the markers-by-folder hooks of tests/conftest.py look at in a collected test."""

    def __init__(self, path, fixturenames):
        self.path = path
        self.fixturenames = fixturenames
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)

    def get_closest_marker(self, name):
        found = [m for m in self.markers if getattr(m, "name", None) == name]
        return found[-1].mark if found else None


def test_a_unit_test_asking_for_a_root_fixture_fails_and_an_integration_one_is_marked_root():
    import pytest

    import conftest

    unit = _Item(os.path.join(REPO, "tests", "unit", "test_x.py"), ["tmp_path", "sim_host"])
    integration = _Item(os.path.join(REPO, "tests", "integration", "test_x.py"), ["gpus"])
    plain = _Item(os.path.join(REPO, "tests", "unit", "test_y.py"), ["tmp_path"])
    conftest.pytest_collection_modifyitems(None, [unit, integration, plain])
    assert "root" in integration.markers and "root" in unit.markers and plain.markers == ["unit"]
    with pytest.raises(pytest.fail.Exception, match="asks for the root fixture.*sim_host.*tests/integration"):
        conftest.pytest_runtest_setup(unit)
    conftest.pytest_runtest_setup(integration)
    conftest.pytest_runtest_setup(plain)
