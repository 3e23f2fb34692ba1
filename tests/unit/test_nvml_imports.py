"""gpuhook.discover.nvml, the NVML backend, against the simulated NVML; and its import boundary.

The tests of it that need no root; those that do are in tests/integration/test_nvml_backend.py.
"""

import ast
import os
import subprocess
import sys
import pytest
from gpuhook.discover import nvml
from gpuhook.errors import NvmlError
from conftest import REPO


def test_a_missing_library_is_a_clear_error(tmp_path):
    with pytest.raises(NvmlError) as err:
        nvml.Session(str(tmp_path / "libnvidia-ml.so.1")).open()
    assert str(tmp_path / "libnvidia-ml.so.1") in err.value.message and "cannot load" in err.value.message
    assert err.value.hint and "nvml-library" in err.value.hint


def test_importing_the_backend_does_not_load_pynvml():
    done = subprocess.run([sys.executable, "-c", "import sys, gpuhook.discover.nvml, gpuhook.request.requirements; "
                           "print('pynvml' in sys.modules)"], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "False"


def imports_of_pynvml(path: str) -> list:
    """Lines of `path` that import pynvml, by any spelling the AST can see."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [alias.name for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__"):
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        if any(name == "pynvml" or name.split(".")[-1] == "pynvml" or name.startswith("pynvml.") for name in names):
            found.append(node.lineno)
    return found


def test_only_the_nvml_module_imports_pynvml():
    package = os.path.join(REPO, "gpuhook")
    importers = {}
    for root, dirs, files in os.walk(package):
        dirs[:] = [d for d in dirs if d not in ("_vendor", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                if imports_of_pynvml(path):
                    importers[os.path.relpath(path, REPO)] = imports_of_pynvml(path)
    assert list(importers) == ["gpuhook/discover/nvml.py"], importers


def test_the_import_scan_sees_every_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import pynvml\nfrom pynvml import nvmlInit\nfrom gpuhook._vendor import pynvml\n"
                      "import importlib\nimportlib.import_module('pynvml')\n__import__('pynvml')\nimport json\n")
    assert imports_of_pynvml(str(sample)) == [1, 2, 3, 5, 6]
