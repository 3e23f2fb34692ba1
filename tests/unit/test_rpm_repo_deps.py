"""packaging/rpm/check-repo-deps compares versions as rpm does: the expected results below are
what rpm 4.18's own rpm.vercmp gave for each pair (docs/packaging.md)."""

import importlib.machinery
import importlib.util
import os

import pytest

from conftest import REPO


def tool():
    path = os.path.join(REPO, "packaging", "rpm", "check-repo-deps")
    loader = importlib.machinery.SourceFileLoader("check_repo_deps", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("check_repo_deps", loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("a,b,expected", [
    ("1.0", "1.0.1", -1), ("1.0a", "1.0.1", -1), ("1.0~rc1", "1.0", -1), ("1.0^git1", "1.0", 1),
    ("1.0^git1", "1.0.1", -1), ("1.10", "1.9", 1), ("3.11.9", "3.11", 1), ("3.11", "3.11.10", -1),
    ("2.0", "1.10", 1), ("1.0", "1.0", 0), ("1.0~rc1", "1.0~rc2", -1), ("a", "b", -1), ("1.0a", "1.0b", -1),
    ("6.0.1", "6.0", 1),
])
def test_versions_compare_as_rpm_compares_them(a, b, expected):
    vercmp = tool().vercmp
    assert (vercmp(a, b), vercmp(b, a)) == (expected, -expected)


def test_requirements_are_matched_by_provides_versions_and_files(tmp_path):
    import xml.etree.ElementTree as ET

    index = tool().Index()
    index.add(ET.parse(os.path.join(REPO, "tests", "data", "rpm-repodata", "el9", "repodata", "primary.xml")).getroot())
    assert index.providers("/usr/bin/python3.11") == ["python3.11-3.11.9-7.el9"]
    assert index.providers("python3 >= 3.11") == []  # RHEL 9's python3 is 3.9
    assert index.providers("python3.11 >= 3.11") == ["python3.11-3.11.9-7.el9"]
    assert index.providers("python(abi) = 3.11") == ["python3.11-3.11.9-7.el9"]
    assert index.providers("/bin/sh") == ["bash-5.1.8-9.el9"]
    assert index.providers("python3.11-click") == []
