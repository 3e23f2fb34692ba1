"""The command line as a user meets it: help everywhere, dry runs on the samples, one-line errors.

The tests of it that need no root; those that do are in tests/integration/test_cli.py.
"""

import os
import subprocess
import sys
import pytest
from gpuhook.cli import COMMANDS
from conftest import REPO


SAMPLES = os.path.join(REPO, "examples", "states")


def gpuhook(*args, stdin=b"", env=None):
    run_env = {"PATH": os.environ["PATH"], **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpuhook", *args], input=stdin, capture_output=True,
                          env=run_env, timeout=120, cwd="/")


def test_top_level_help_lists_every_command():
    done = gpuhook("--help")
    assert done.returncode == 0
    for name in COMMANDS:
        assert name in done.stdout.decode()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    done = gpuhook(name, "--help")
    assert done.returncode == 0, done.stderr
    assert f"Usage: gpuhook {name}" in done.stdout.decode()
    assert len(done.stdout.decode().splitlines()) > 3


@pytest.mark.parametrize("group", ["cgroup", "cdi"])
def test_group_listings_show_whole_sentences(group):
    """`gpuhook cgroup --help` listed `show  Print the device rules in effect for a container: on
    cgroup v1...`: click cuts a long help at 45 characters unless the command has a short_help."""
    text = gpuhook(group, "--help").stdout.decode()
    listing = text[text.index("Commands:"):]
    assert "..." not in listing, listing
    assert listing.rstrip().endswith("."), listing


def test_every_option_of_every_command_has_help():
    """`simulate --driver-version` and `--model` showed in --help with no word of what they are."""
    import click
    from gpuhook.cli import cli

    ctx = click.Context(cli)
    bare = []

    def walk(command, name):
        if isinstance(command, click.Group):
            for sub in command.list_commands(ctx):
                walk(command.get_command(ctx, sub), f"{name} {sub}")
        bare.extend(f"{name} {p.opts[0]}" for p in command.params if isinstance(p, click.Option) and not p.help)

    walk(cli, "gpuhook")
    assert bare == []


def test_version():
    assert gpuhook("--version").stdout.decode().startswith("gpuhook, version ")


@pytest.mark.parametrize("args,message", [
    (["nosuch"], "No such command 'nosuch'"),
    (["prestart", "--json"], "--json goes with --dry-run"),
    (["prestart", "--dry-run", "--state", "/nonexistent.json"], "cannot read state file /nonexistent.json"),
    (["list", "--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
    (["simulate"], "Missing argument 'DIR'"),
])
def test_usage_errors_are_one_line(args, message):
    done = gpuhook(*args)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert err.count("\n") == 1 and err.startswith("gpuhook: ") and message in err, err


EXPECT = {
    "runc-no-gpu": ("nothing", []),
    "runc-gpu0": ("gpus", [0]),
    "crun-all-utility": ("all", [0, 1, 2, 3]),
    "podman-cuda-legacy": ("all", [0, 1, 2, 3]),
    "k8s-volume-mounts": ("gpus", [1]),
    "containerd-cdi": ("gpus", [0]),
    "runc-none": ("driver-only", []),
}


def test_every_shipped_sample_is_covered():
    assert sorted(f[:-5] for f in os.listdir(SAMPLES)) == sorted(EXPECT)


def test_bare_group_prints_its_help():
    for args in ((), ("cgroup",)):
        done = gpuhook(*args)
        assert done.returncode == 0 and done.stderr == b""
        assert done.stdout.decode().startswith("Usage: gpuhook")


def test_poststop_is_described_as_what_it_does():
    text = gpuhook("poststop", "--help").stdout.decode()
    assert "stopped container" in text and "never fails" in " ".join(text.split())
    assert "--dry-run" not in text


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_doctor_refuses_a_host_root_that_is_no_directory(kind, tmp_path):
    """`doctor --host-root /nonexistent` read nothing and said gpuhook was registered with no
    runtime there: a host root that is not a directory is a usage error (exit 2, one line)."""
    where = str(tmp_path / kind)
    if kind == "file":
        open(where, "w").close()
    done = gpuhook("doctor", "--quick", "--host-root", where)
    err = done.stderr.decode()
    assert done.returncode == 2, (done.returncode, err)
    assert err.count("\n") == 1 and err.startswith("gpuhook: ") and "--host-root" in err and where in err, err
    assert done.stdout == b""
