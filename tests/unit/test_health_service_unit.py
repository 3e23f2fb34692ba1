"""The health daemon as the packages run it (packaging/systemd/gpuhook-health.service.

The tests of it that need no root; those that do are in tests/integration/test_health_service.py.
"""

import configparser
import os
from conftest import REPO


UNIT = os.path.join(REPO, "packaging", "systemd", "gpuhook-health.service")


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    with open(UNIT) as f:
        parser.read_file(f)
    return parser


def test_the_unit_is_a_notify_service_ordered_before_the_runtimes_and_restarted():
    service, section = unit()["Service"], unit()["Unit"]
    assert service["Type"] == "notify" and service["Restart"] == "on-failure"
    before = section["Before"].split()
    for runtime in ("containerd.service", "docker.service", "crio.service", "kubelet.service"):
        assert runtime in before
    assert unit()["Install"]["WantedBy"] == "multi-user.target"
