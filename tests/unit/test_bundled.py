"""What the RHEL 9 RPM goes without: its click is bundled (gpuhook/_vendor/site), and it has
no jsonschema, so the dry run's schema check says it was skipped. packaging/vendor/click/."""

import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEEL = os.path.join(REPO, "packaging", "vendor", "click", "click-8.1.7-py3-none-any.whl")

# Runs gpuhook as the RHEL 9 RPM would: the named modules cannot be imported from anywhere
# but the bundled site, and only once that is on sys.path.
AS_RHEL9 = r"""
import importlib.machinery, sys
site, missing, args = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]

class OnlyBundled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in missing:  # submodules are found through their package
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [site] if site in sys.path else [])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec

sys.meta_path.insert(0, OnlyBundled)
import gpuhook._vendor
gpuhook._vendor.BUNDLED_SITE = site
from gpuhook.entry import main
try:
    main(args)
finally:
    import click
    print("click from", click.__file__, file=sys.stderr)
"""


def as_rhel9(tmp_path, *args, missing="click,jsonschema"):
    site = tmp_path / "site"
    with zipfile.ZipFile(WHEEL) as wheel:  # what the spec's %install does
        wheel.extractall(site)
    return subprocess.run([sys.executable, "-c", AS_RHEL9, str(site), missing, *args], capture_output=True,
                          text=True, cwd="/", timeout=60)


def test_the_cli_runs_on_the_bundled_click_when_the_system_has_none(tmp_path):
    done = as_rhel9(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: gpuhook" in done.stdout and "prestart" in done.stdout
    assert f"click from {tmp_path}/site/click/__init__.py" in done.stderr


def test_without_jsonschema_the_dry_run_says_it_did_not_check_the_schema(tmp_path):
    state = os.path.join(REPO, "examples", "states", "runc-no-gpu.json")
    done = as_rhel9(tmp_path, "prestart", "--dry-run", "--state", state)
    assert done.returncode == 0, done.stderr
    assert "state not checked against the OCI schema: jsonschema is not installed" in done.stdout


def test_a_system_click_wins_over_the_bundled_one(tmp_path):
    done = as_rhel9(tmp_path, "--version", missing="jsonschema")
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path}/site" not in done.stderr.rpartition("click from ")[2]
