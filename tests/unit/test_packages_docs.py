"""The .deb and the .rpm (docs/packaging.md): generated files, builds, lintian, and the installed
.deb.

The tests of it that need no root; those that do are in tests/integration/test_packages.py.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from conftest import REPO, require
from gpuhook import __version__, config as cfg


RENDER = os.path.join(REPO, "packaging", "render.py")


VENDOR = os.path.join(REPO, "packaging", "vendor", "nvidia-ml-py")


CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def render(*args) -> str:
    return subprocess.run([sys.executable, RENDER, *args], capture_output=True, text=True, check=True).stdout


def run(*argv, check=True, timeout=300, **kwargs):
    kwargs.setdefault("env", CLEAN_ENV)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/", **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def test_default_config_lists_every_key_commented_out_at_its_default():
    text = render("config")
    assert tomllib.loads(text) == {}  # all commented: the file itself changes nothing
    for key in cfg.KEYS:
        assert f"# {key.name} = " in text, key.dotted
        assert " ".join(key.doc.split()[:6]) in " ".join(text.replace("# ", " ").split()), key.dotted
    uncommented = re.sub(r"(?m)^# (\[[\w-]+\]|[\w-]+ = .*)$", r"\1", text)
    assert cfg.from_mapping(tomllib.loads(uncommented)).as_dict() == cfg.defaults().as_dict()


def test_manual_page_documents_every_command_option_and_key():
    page = render("manpage")
    assert page.startswith(".TH GPUHOOK 1 ") and f"gpuhook {__version__}" in page.splitlines()[0]
    from gpuhook.cli import COMMANDS

    for name in COMMANDS:
        assert f".SS gpuhook {name} " in page, name
    for option in ("\\-\\-hooks\\-dir", "\\-\\-annotated", "\\-\\-containerd\\-config", "\\-\\-dry\\-run"):
        assert option in page
    for key in cfg.KEYS:
        assert key.dotted.replace("-", "\\-") in page
    require(shutil.which("man") is not None, "needs man (man-db)")
    formatted = run("man", "--warnings", "-l", "-Tutf8", "-", input=page)
    assert formatted.stderr == "" and "gpuhook install" in formatted.stdout


def test_vendored_pynvml_is_the_pinned_upstream_file():
    with open(os.path.join(VENDOR, "SHA256SUMS")) as f:
        digest, name = f.read().split()
    with open(os.path.join(VENDOR, name), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest
    with open(os.path.join(VENDOR, "LICENSE")) as f:
        assert "NVIDIA Corporation" in f.read()


def test_package_versions_are_gpuhooks_version():
    with open(os.path.join(REPO, "packaging", "deb", "debian", "changelog")) as f:
        assert f.readline().startswith(f"gpuhook ({__version__}) ")
    with open(os.path.join(REPO, "packaging", "rpm", "gpuhook.spec")) as f:
        assert re.search(rf"(?m)^Version:\s+{re.escape(__version__)}$", f.read())


def test_the_cdi_refresh_service_runs_a_real_gpuhook_command():
    with open(os.path.join(REPO, "packaging", "systemd", "gpuhook-cdi-refresh.service")) as f:
        (exec_start,) = [line.split("=", 1)[1].split() for line in f if line.startswith("ExecStart=")]
    assert exec_start[0] == "/usr/bin/gpuhook"
    from click.testing import CliRunner

    from gpuhook.cli import cli

    done = CliRunner().invoke(cli, [*exec_start[1:], "--help"])
    assert done.exit_code == 0 and "--output" in done.output
