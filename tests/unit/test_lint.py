"""ruff over the whole tree and mypy over the planning modules, as CI runs them
(configuration in pyproject.toml). A missing tool fails under GPUHOOK_STRICT=1."""

import os
import shutil
import subprocess
import sys
import tempfile

from conftest import REPO, require

TYPED = ["gpuhook/config.py", "gpuhook/plan/make.py", "gpuhook/request/resolve.py", "gpuhook/discover/survey.py", "gpuhook/discover/cdi.py", "gpuhook/errors.py",
         "gpuhook/apply/grants.py"]


def tool(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    found = path if os.path.exists(path) else shutil.which(name)
    require(found is not None, f"needs {name} (pip install -e '.[test]')")
    return found


def test_ruff_finds_nothing():
    # No cache: tests/unit runs as any user, who may not write the tree's .ruff_cache.
    done = subprocess.run([tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_accepts_the_planning_modules():
    # The cache lives where this user can write (tests/unit runs as any user).
    cache = os.path.join(tempfile.gettempdir(), f"gpuhook-mypy-cache-{os.geteuid()}")
    done = subprocess.run([tool("mypy"), "--cache-dir", cache, *TYPED], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_two_classes_in_the_package_share_a_name():
    # One name, one meaning: a reader who greps a type finds one definition.
    import ast

    seen: dict = {}
    for directory, _, files in os.walk(os.path.join(REPO, "gpuhook")):
        if "_vendor" in directory or "generated" in directory:
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for node in tree.body:
                    if isinstance(node, ast.ClassDef):
                        seen.setdefault(node.name, []).append(os.path.relpath(path, REPO))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
