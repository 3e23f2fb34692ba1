"""Configuration: defaults, validation, precedence, and documentation that cannot drift."""

import os

import pytest

from gpuhook import config as cfg
from gpuhook.errors import ConfigError

from conftest import REPO


def test_missing_default_file_means_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(cfg, "DEFAULT_PATH", str(tmp_path / "absent.toml"))
    c = cfg.load(None, {})
    assert c.driver_root == "/" and c.proc_root == "/proc" and c.accept_env_when_unprivileged is True
    assert c.source == "defaults"


def test_explicit_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        cfg.load(str(tmp_path / "nope.toml"))


def test_environment_variable_names_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('driver-root = "/run/nvidia/driver"\n')
    c = cfg.load(None, {cfg.ENV_VAR: str(path)})
    assert c.driver_root == "/run/nvidia/driver" and c.source == str(path)
    assert cfg.load(str(path), {cfg.ENV_VAR: "/elsewhere"}).driver_root == "/run/nvidia/driver"


@pytest.mark.parametrize("text,message", [
    ("driver-rot = '/x'", "unknown key 'driver-rot'"),
    ("driver-root = 'relative'", "must be an absolute path"),
    ("driver-root = 5", "must be a path string"),
    ("accept-volume-mounts = 'yes'", "must be true or false"),
    ("deadline-seconds = 0", "must be a number of seconds"),
    ("deadline-seconds = true", "must be a number of seconds"),
    ("[nosuch]\nx = 1", "unknown key 'nosuch'"),
    ("driver-root = ", "invalid TOML"),
    ("driver-root = \"/a\"\ndriver-root = \"/b\"", "invalid TOML"),
])
def test_bad_config_is_one_clear_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        cfg.load(str(path))
    assert message in err.value.message and str(path) in err.value.message


def test_non_utf8_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"driver-root = '\xff'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        cfg.load(str(path))


def test_device_root_follows_driver_root_unless_set():
    assert cfg.from_mapping({}).device_root == "/dev"
    assert cfg.from_mapping({"driver-root": "/run/nvidia/driver"}).device_root == "/run/nvidia/driver/dev"
    assert cfg.from_mapping({"driver-root": "/d", "dev-root": "/sim/dev"}).device_root == "/sim/dev"


def test_paths_are_normalized():
    assert cfg.from_mapping({"driver-root": "/run/nvidia/driver/"}).driver_root == "/run/nvidia/driver"
    assert cfg.from_mapping({"driver-root": "/"}).driver_root == "/"


def test_readme_documents_every_key():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    for key in cfg.KEYS:
        assert f"`{key.dotted}`" in readme, f"README does not document {key.dotted}"
