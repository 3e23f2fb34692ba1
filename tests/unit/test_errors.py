"""One exit-code table (gpuhook.errors.EXIT_CODES): every error class, the README, --help and
the man page agree with it, and no module keeps its own copy."""

import ast
import os
import subprocess
import sys

from gpuhook import errors

from conftest import REPO


def _error_classes():
    seen, todo = set(), [errors.GpuhookError]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo += cls.__subclasses__()
    return seen


def test_every_error_class_exits_with_a_code_of_the_table():
    import gpuhook.install  # noqa: F401  (subclasses live there too)
    import gpuhook.simulate  # noqa: F401
    import gpuhook.simulate.demo  # noqa: F401

    for cls in _error_classes():
        assert cls.exit_code in errors.EXIT_CODES, cls


def test_exit_codes_are_declared_only_in_errors_py():
    for directory, _, files in os.walk(os.path.join(REPO, "gpuhook")):
        for name in files:
            if not name.endswith(".py") or name == "errors.py":
                continue
            tree = ast.parse(open(os.path.join(directory, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in ("exit_code", "INTERNAL_ERROR")
                                                        for t in node.targets):
                    raise AssertionError(f"{name}:{node.lineno} declares an exit code outside errors.py")


def test_readme_help_and_manpage_list_the_table():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    shown = subprocess.run([sys.executable, "-m", "gpuhook", "--help"], capture_output=True, text=True).stdout
    sys.path.insert(0, os.path.join(REPO, "packaging"))
    try:
        import render
    finally:
        sys.path.pop(0)
    page = render.manpage_text()
    for code, meaning in errors.EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in readme, code
        assert f"{code} {meaning}" in " ".join(shown.split()), code
        assert f".TP\n\\fB{code}\\fR\n" in page, code


def test_an_os_error_nobody_translated_is_a_host_error_in_one_line():
    err = errors.from_os_error(PermissionError(13, "Permission denied", "/run/x"))
    assert err.exit_code == 4 and err.one_line() == "/run/x: Permission denied"
