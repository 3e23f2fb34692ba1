"""Third-party modules the distribution packages ship privately.

Empty in the source tree. packaging/build-deb and packaging/build-rpm install
packaging/vendor/nvidia-ml-py/pynvml.py here, because Debian, Fedora and RHEL have no
nvidia-ml-py package; gpuhook imports this copy only when no ``pynvml`` is importable. The
RPM (for python3.11) also unpacks click into ``site/`` (packaging/vendor/click/README.md),
which `add_bundled_site` puts at the end of sys.path when no system click exists. pip
installs get both from PyPI instead.
"""

import os
import sys

BUNDLED_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def add_bundled_site() -> bool:
    """Append the bundled libraries' directory to sys.path (last: a system copy always wins).
    False when this installation bundles none."""
    if not os.path.isdir(BUNDLED_SITE):
        return False
    if BUNDLED_SITE not in sys.path:
        sys.path.append(BUNDLED_SITE)
    return True
