"""gpuhook: an OCI runtime hook that gives containers their GPUs, checked and clean.

This module must stay import-free: the hook's no-GPU path imports the package on every
container start (see gpuhook/prescan.py and tests/integration/test_hot_path.py).
"""

__version__ = "0.1.0"
