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
    path.write_text(f'driver-root = "/run/nvidia/driver"\nstate-dir = "{tmp_path}/run"\n')
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


def test_an_unknown_top_level_key_lists_the_tables_too():
    """A misspelt table such as [healh] listed only the plain keys, not [health] or [plugin]."""
    with pytest.raises(ConfigError) as err:
        cfg.from_mapping({"healh": {"mode": "off"}})
    message = err.value.message
    assert "unknown key 'healh'" in message
    assert message.endswith(", [health], [plugin])"), message
    assert "driver-root" in message and "mode" not in message.split("known keys: ")[1]


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


def test_readme_documents_every_key_with_its_default():
    import json

    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    for key in cfg.KEYS:
        row = f"| `{key.dotted}` | `{json.dumps(key.default)}` |"
        assert row in readme, f"README's configuration table lacks {row}"


def test_parsed_config_is_cached_and_invalidated_by_any_change(tmp_path, monkeypatch):
    from gpuhook.apply import statefiles

    state = tmp_path / "state"
    path = tmp_path / "c.toml"
    path.write_text(f'proc-root = "/one"\nstate-dir = "{state}"\n')
    config = cfg.load(str(path))
    assert config.proc_root == "/one"
    statefiles.write_caches(config)  # as a start writes it
    (cached,) = os.listdir(state / "config-cache")
    # A cache hit never parses TOML: make parsing impossible and load again.
    monkeypatch.setattr(cfg, "_parse_toml", lambda raw, target: (_ for _ in ()).throw(AssertionError("parsed")))
    assert cfg.load(str(path)).proc_root == "/one"
    monkeypatch.undo()
    path.write_text(f'proc-root = "/two"\nstate-dir = "{state}"\n')  # same size, new content
    assert cfg.load(str(path)).proc_root == "/two"
    (state / "config-cache" / cached).write_text("{damaged")
    assert cfg.load(str(path)).proc_root == "/two"


def test_a_bad_config_is_never_cached(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'nonsense-key = 1\nstate-dir = "{tmp_path}/state"\n')
    for _ in range(2):
        with pytest.raises(ConfigError, match="unknown key"):
            cfg.load(str(path))
    assert not (tmp_path / "state").exists()


def test_loading_a_config_writes_nothing_a_start_writes_its_cache_and_the_next_load_uses_it(tmp_path):
    # A host write outside apply: config.load used to write (and prune) its cache on every
    # start, dry runs and commands included.
    from gpuhook.apply import statefiles

    state = tmp_path / "state"
    (tmp_path / "c.toml").write_text(f'driver-root = "/run/nvidia/driver"\nstate-dir = "{state}"\n')
    config = cfg.load(str(tmp_path / "c.toml"))
    assert not state.exists()
    path, document = config.cache_entry
    assert path == cfg.cache_path(str(state), str(tmp_path / "c.toml")) and document["data"]["state-dir"] == str(state)
    statefiles.write_caches(config)
    assert os.listdir(state / "config-cache") == [os.path.basename(path)]
    again = cfg.load(str(tmp_path / "c.toml"))
    assert again.cache_entry is None and again.driver_root == "/run/nvidia/driver"  # from the cache
    assert cfg.load(str(tmp_path / "c.toml"), use_cache=False).cache_entry is None


def test_cache_of_deleted_configs_is_pruned(tmp_path):
    from gpuhook.apply import statefiles

    state = tmp_path / "state"
    for i in range(70):
        (tmp_path / f"c{i}.toml").write_text(f'state-dir = "{state}"\n')
        statefiles.write_caches(cfg.load(str(tmp_path / f"c{i}.toml")))
        (tmp_path / f"c{i}.toml").unlink()
    (tmp_path / "live.toml").write_text(f'state-dir = "{state}"\n')
    statefiles.write_caches(cfg.load(str(tmp_path / "live.toml")))
    left = os.listdir(state / "config-cache")
    assert len(left) < 64
    assert os.path.basename(cfg.cache_path(str(state), str(tmp_path / "live.toml"))) in left


def test_every_key_is_a_declared_attribute_of_its_table():
    # Declared, so a reader can grep `state_dir` to its definition and mypy can check uses.
    for section, table in cfg.TABLES.items():
        declared = [name for name in table.__annotations__ if name not in cfg.TABLES]
        keys = [k.name.replace("-", "_") for k in cfg.KEYS if k.section == section]
        assert declared == keys, section
    assert [name for name in cfg.Config.__annotations__ if name in cfg.TABLES] == sorted(set(cfg.TABLES) - {""})
    config = cfg.defaults()
    assert config.health.mode == "fallback" and config.state_dir == "/run/gpuhook"
    with pytest.raises(AttributeError):
        config.no_such_key  # noqa: B018


def test_a_preloaded_configuration_serves_a_load_only_while_its_file_is_unchanged(tmp_path, monkeypatch):
    """gpuhook.agent's spares load the last start's configuration ahead of the next start; that
    start gets it only if the file is the one loaded (device, inode, size, mtime, ctime)."""
    path = tmp_path / "config.toml"
    path.write_text(f'state-dir = "{tmp_path}/state"\nlog-file = ""\n')
    monkeypatch.setattr(cfg, "_PRELOADED", {})
    cfg.preload(str(path), {})
    early = cfg._PRELOADED[str(path)][1]
    assert cfg.load(str(path), {}) is early
    assert cfg.load(None, {"GPUHOOK_CONFIG": str(path)}) is early  # the same file, named otherwise
    path.write_text(f'state-dir = "{tmp_path}/state"\nlog-file = "{tmp_path}/log"\n')
    changed = cfg.load(str(path), {})
    assert changed is not early and changed.log_file == f"{tmp_path}/log"
    path.write_text("not toml [")
    cfg.preload(str(path), {})  # a bad file: nothing kept, nothing printed
    assert cfg._PRELOADED == {}
