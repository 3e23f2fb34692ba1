"""scripts/setup's step lines (README, "Try it"): numbered once each, out of their count.

The tests of it that need no root; those that do are in tests/integration/test_setup.py.
"""

import os
import re

from conftest import REPO


def test_every_step_has_its_own_number_out_of_the_number_of_steps():
    """It printed '3/4' for two different steps (the venv, then pip)."""
    with open(os.path.join(REPO, "scripts", "setup")) as f:
        steps = re.findall(r'^\s*step "(\d+)/(\d+) ', f.read(), re.M)
    assert len(steps) >= 2
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1)), steps
    assert {int(total) for _, total in steps} == {len(steps)}, steps
