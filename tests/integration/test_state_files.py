"""gpuhook's own state files (caches, health reports, registry) cannot be forged or read by
other local users, whatever the runtime's umask, and are never trusted when they could have
been written by someone else."""

import os
import stat
import pytest
from conftest import require_root_tools
from gpuhook.apply import statefiles
from gpuhook.kernel import files
from gpuhook import config as cfg


pytestmark = pytest.mark.root


NOBODY = 65534


def test_a_state_file_someone_else_could_have_written_is_ignored(tmp_path):
    require_root_tools()
    good = tmp_path / "d" / "f.json"
    statefiles.write_atomic(str(good), {"ok": True})
    assert files.read(str(good)) == {"ok": True}
    os.chown(good, NOBODY, NOBODY)
    assert files.read(str(good)) is None  # another user's file
    os.chown(good, 0, 0)
    os.chmod(good, 0o666)
    assert files.read(str(good)) is None  # anyone could have written it
    os.chmod(good, 0o600)
    os.chmod(good.parent, 0o777)
    assert files.read(str(good)) is None  # anyone could have put it there
    with pytest.raises(OSError):
        statefiles.write_atomic(str(good), {"ok": False})  # and we do not write into such a directory


def test_a_directory_another_user_made_is_not_used(tmp_path):
    require_root_tools()
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(OSError):
        statefiles.ensure_dir(str(planted))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(OSError):
        statefiles.ensure_dir(str(link))


def test_a_forged_config_cache_entry_is_not_trusted(tmp_path):
    """The parsed config is cached by the config file's identity alone; a forged entry
    would turn every policy off (or point ldconfig anywhere). It must be ours to count."""
    require_root_tools()
    state = tmp_path / "state"
    config_file = tmp_path / "config.toml"
    config_file.write_text(f'accept-volume-mounts = false\nstate-dir = "{state}"\n')
    statefiles.write_caches(cfg.load(str(config_file)))  # parsed, then cached as a start caches it
    entry = cfg.cache_path(str(state), str(config_file))
    doc = files.read(entry)
    doc["data"]["accept-volume-mounts"] = True
    with open(entry, "w") as f:
        import json

        json.dump(doc, f)
    os.chown(entry, NOBODY, NOBODY)  # a local user's forgery
    assert cfg.load(str(config_file)).accept_volume_mounts is False


def test_the_config_cache_lives_under_the_state_dir_the_config_names(tmp_path):
    """Not in /run/gpuhook whatever state-dir says: two test runs, or two gpuhooks with their
    own state dirs, never share it, and a state dir taken away takes its cache along."""
    require_root_tools()
    state = tmp_path / "state"
    config_file = tmp_path / "config.toml"
    config_file.write_text(f'log-file = "{tmp_path}/one.log"\nstate-dir = "{state}"\n')
    statefiles.write_caches(cfg.load(str(config_file)))
    name = str(config_file).replace("%", "%25").replace("/", "%") + ".json"
    assert os.listdir(state / "config-cache") == [name]
    assert not os.path.exists(f"/run/gpuhook/config-cache/{name}")
    assert stat.S_IMODE(os.stat(state / "config-cache").st_mode) == 0o700


def test_a_cache_entry_is_used_only_under_the_state_dir_it_was_parsed_for(tmp_path):
    """Where the cache is comes from the config file's own bytes; an entry found there counts
    only when the file it was parsed from named that same state-dir. An entry of this very
    file (same identity) that says another state-dir is not taken."""
    require_root_tools()
    config_file = tmp_path / "config.toml"
    config_file.write_text(f'log-file = "{tmp_path}/real.log"\nstate-dir = "{tmp_path}/a"\n')
    identity = files.file_identity(os.stat(config_file))
    planted = {"identity": identity, "source": str(config_file),
               "data": {"log-file": f"{tmp_path}/planted.log", "state-dir": f"{tmp_path}/b"}}
    statefiles.write_atomic(cfg.cache_path(f"{tmp_path}/a", str(config_file)), planted)
    assert cfg.load(str(config_file)).log_file == f"{tmp_path}/real.log"
    # The same entry naming its own place is taken (the hit the cache is for).
    planted["data"]["state-dir"] = f"{tmp_path}/a"
    statefiles.write_atomic(cfg.cache_path(f"{tmp_path}/a", str(config_file)), planted)
    assert cfg.load(str(config_file)).log_file == f"{tmp_path}/planted.log"


def test_a_gpu_start_writes_the_caches_a_start_without_gpus_writes_none(gpus):
    """Caches are written by a start that applies, once, after planning (config.load and
    discovery only read): the parsed config's entry and the inventory."""
    run = f"{gpus.workdir}/run"
    result = gpus.run("nothing", env=["CUDA_VERSION=12.2", "NVIDIA_VISIBLE_DEVICES=void"])  # past the prescan
    assert result.returncode == 0, result.stderr
    assert gpus.log_lines()[-1]["decision"] == "untouched" and not os.path.exists(f"{run}/config-cache")
    result = gpus.run("one", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert result.returncode == 0, result.stderr
    assert os.listdir(f"{run}/config-cache") == [os.path.basename(cfg.cache_path(run, gpus.config))]
    assert files.read(f"{run}/inventory.json")["inventory"]["gpus"]
