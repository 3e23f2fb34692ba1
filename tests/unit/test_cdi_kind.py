"""gpuhook's CDI spec next to NVIDIA's on one node, with real podman (docs/cdi.md, "Next to.

The tests of it that need no root; those that do are in tests/integration/test_cdi_coexist.py.
"""

from gpuhook.driver import CDI_KIND


GPUHOOK_KIND = "gpuhook.example/gpu"


def test_gpuhooks_spec_has_a_kind_of_its_own():
    assert CDI_KIND == GPUHOOK_KIND != "nvidia.com/gpu"
