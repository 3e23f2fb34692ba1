"""containerd with the base spec and config edit `gpuhook install containerd` makes (docs/packaging.md).

A containerd daemon of the test's own (private config, root, state and sockets) loads the
edited config; `ctr run --rm --config` starts a container from the installed base spec, and
runc runs gpuhook from it: at prestart, and at poststop when the shim deletes the container.
The CRI plugin reads base_runtime_spec at start, so its status shows whether containerd
accepted the file the config points at.
"""

import copy
import json
import os
import shutil
import tomllib

import pytest

from conftest import require_root_tools
from gpuhook import install
from helpers.runtimes import (Containerd, gpu_nodes, gpuhook_cli, log_records, other_gpu_node, read_json, registered,
                              wait_for_record)


pytestmark = pytest.mark.root

CRI = "io.containerd.grpc.v1.cri"
OTHER = "/dev/other-gpu"


@pytest.fixture
def containerd(tmp_path):
    require_root_tools("containerd", "ctr", "runc")
    daemon = Containerd(str(tmp_path / "containerd"))
    daemon.write_config()
    yield daemon
    daemon.stop()


def runc_runtime(dump: str) -> dict:
    return tomllib.loads(dump)["plugins"][CRI]["containerd"]["runtimes"]["runc"]


def container_spec(base: dict, rootfs: str, name: str, script: str, env=()) -> dict:
    """A full spec for `ctr run --config`: the installed base spec plus process and root."""
    spec = copy.deepcopy(base)
    spec["process"]["args"] = ["/bin/busybox", "sh", "-c", script]
    spec["process"]["env"] = ["PATH=/bin", *env]
    spec["root"] = {"path": rootfs}
    spec["linux"]["cgroupsPath"] = f"/gpuhook-test-{name}"  # a leaf: runc removes it on delete
    return spec


def test_installed_base_spec_is_loaded_by_cri_and_runs_gpuhook(containerd, gpus, tmp_path):
    spec_path = str(tmp_path / "gpuhook-base-spec.json")
    dump_before = containerd.config_dump()
    with open(containerd.config_path) as f:
        config_before = f.read()

    gpuhook_cli("install", "containerd", "--output", spec_path, "--containerd-config", containerd.config_path,
                "--config", gpus.config)

    # The effective configuration changed in exactly gpuhook's setting: runc's options table
    # becomes empty, which holds the same zero values.
    before, after = runc_runtime(dump_before), runc_runtime(containerd.config_dump())
    assert after["base_runtime_spec"] == spec_path and after["runtime_type"] == "io.containerd.runc.v2"
    assert all(value in ("", 0, False) for value in before["options"].values())
    strip = ("base_runtime_spec", "options")
    assert {k: v for k, v in after.items() if k not in strip} == {k: v for k, v in before.items() if k not in strip}
    whole_before, whole_after = tomllib.loads(dump_before), tomllib.loads(containerd.config_dump())
    for doc in (whole_before, whole_after):
        del doc["plugins"][CRI]["containerd"]["runtimes"]["runc"], doc["imports"]
    assert whole_after == whole_before  # every other setting, Debian's CNI bin_dir included

    containerd.start()
    assert containerd.plugin_status(CRI.rsplit(".", 1)[0], "cri") == "ok"

    base = read_json(spec_path)
    (hook,) = base["hooks"]["prestart"]
    assert hook["args"][-3:] == ["prestart", "--config", gpus.config]
    (hook,) = base["hooks"]["poststop"]
    assert hook["args"][-3:] == ["poststop", "--config", gpus.config]
    script = f"{other_gpu_node(1)}\n/bin/probe /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl {OTHER}"
    rootfs = gpus.bed.rootfs(str(tmp_path / "rootfs-gpu"), files={"/bin/probe": gpus.probe})
    run_spec = tmp_path / "run-gpu.json"
    run_spec.write_text(json.dumps(container_spec(base, rootfs, "ctr-gpu", script, ["NVIDIA_VISIBLE_DEVICES=0"])))
    result = containerd.run(str(run_spec), "ctr-gpu")
    assert result.returncode == 0, result.stderr
    p = result.probes()
    assert gpu_nodes(p) == {"/dev/nvidia0"} and p["/dev/nvidia0"]["read"] == "ENXIO"
    assert p["/dev/nvidiactl"]["read"] == "ENXIO" and p[OTHER]["read"] == "EPERM"
    (line,) = log_records(gpus, "prestart")
    assert line["container"] == "ctr-gpu" and line["gpus"] == [gpus.uuid(0)]
    assert isinstance(line["registered"], dict), line["registered"]
    stop = wait_for_record(gpus, "poststop", "ctr-gpu")
    assert stop["decision"] == "cleaned up", stop
    assert not registered(gpus, "ctr-gpu")

    rootfs = gpus.bed.rootfs(str(tmp_path / "rootfs-plain"), files={"/bin/probe": gpus.probe})
    run_spec = tmp_path / "run-plain.json"
    run_spec.write_text(json.dumps(container_spec(base, rootfs, "ctr-plain", "/bin/probe /dev/nvidia0 /dev/nvidiactl")))
    result = containerd.run(str(run_spec), "ctr-plain")
    assert result.returncode == 0, result.stderr
    assert not any(item["exists"] for item in result.probes().values())
    assert [(line["stage"], line["container"]) for line in gpus.log_lines()] == \
        [("prestart", "ctr-gpu"), ("poststop", "ctr-gpu")]  # ctr run --rm returns after the delete

    containerd.stop()
    gpuhook_cli("uninstall", "containerd", "--output", spec_path, "--containerd-config", containerd.config_path)
    with open(containerd.config_path) as f:
        assert f.read() == config_before
    assert not (tmp_path / "gpuhook-base-spec.json").exists()
    assert containerd.config_dump() == dump_before


def test_cri_fails_when_the_base_spec_is_missing(containerd, tmp_path):
    """The control for the test above: an ok CRI status means containerd read the spec."""
    missing = str(tmp_path / "missing.json")
    containerd.write_config(containerd.default_config() +
                            f'\n[plugins."{CRI}".containerd.runtimes.runc]\n'
                            '  runtime_type = "io.containerd.runc.v2"\n'
                            f'  base_runtime_spec = "{missing}"\n')
    containerd.start()
    assert containerd.plugin_status(CRI.rsplit(".", 1)[0], "cri") == "error"


def open_files_limit(result) -> tuple:
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("Max open files")]
    return tuple(int(v) for v in line.split()[3:5])


def test_a_container_from_the_installed_base_spec_keeps_the_runtimes_open_files_limit(tmp_path, gpus):
    """CRI drops the RLIMIT_NOFILE 1024/1024 of containerd's generated default when the
    runtime has no base spec, and keeps a base spec's (docs/packaging.md): gpuhook's base
    spec must not carry it, so a container keeps the limit it inherits (20000 here)."""
    require_root_tools("containerd", "ctr", "runc")
    daemon = Containerd(str(tmp_path / "containerd"), nofile=20000)
    daemon.write_config()
    spec_path = str(tmp_path / "gpuhook-base-spec.json")
    try:
        done = gpuhook_cli("install", "containerd", "--output", spec_path, "--containerd-config",
                           daemon.config_path, "--config", gpus.config)
        assert "without what CRI drops from it for containers when there is no base spec (process.rlimits)" \
            in done.stdout
        base = read_json(spec_path)
        default = json.loads(daemon.ctr("oci", "spec").stdout)
        assert default["process"]["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
        del default["process"]["rlimits"]
        assert install.without_hook(base) == default  # nothing else differs: only the hooks are added
        daemon.start()
        rootfs = gpus.bed.rootfs(str(tmp_path / "rootfs"))
        run_spec = tmp_path / "run.json"
        run_spec.write_text(json.dumps(container_spec(base, rootfs, "ctr-limits", "cat /proc/self/limits")))
        result = daemon.run(str(run_spec), "ctr-limits")
        assert result.returncode == 0, result.stderr
        assert open_files_limit(result) == (20000, 20000)
    finally:
        daemon.stop()


def test_install_takes_the_default_spec_from_the_ctr_beside_the_running_containerd(tmp_path, gpus):
    """The release tarball's containerd and ctr live in /usr/local/bin, outside the hook
    PATH gpuhook used to search: the ctr beside the binary of the daemon that serves the
    config's socket gives the default spec, and install says which."""
    require_root_tools("containerd", "ctr", "containerd-shim-runc-v2", "runc")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("containerd", "ctr", "containerd-shim-runc-v2"):
        shutil.copy2(shutil.which(tool), bin_dir / tool)
    daemon = Containerd(str(tmp_path / "containerd"), containerd=str(bin_dir / "containerd"),
                        ctr=str(bin_dir / "ctr"))
    daemon.write_config()
    spec_path = str(tmp_path / "gpuhook-base-spec.json")
    try:
        daemon.start()
        done = gpuhook_cli("install", "containerd", "--output", spec_path, "--containerd-config",
                           daemon.config_path, "--config", gpus.config, "--dry-run")
        assert (f"# base spec: containerd's default spec (`ctr oci spec`) from {bin_dir}/ctr, next to the running "
                f"containerd (pid {daemon.pid}, {bin_dir}/containerd)") in done.stdout
        assert "# CRI's runc runtime: [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc] " \
               "(config version 2)" in done.stdout
        os.unlink(bin_dir / "ctr")  # no ctr beside it: a ctr of the same release elsewhere serves
        done = gpuhook_cli("install", "containerd", "--output", spec_path, "--containerd-config",
                           daemon.config_path, "--config", gpus.config, "--dry-run")
        assert f"from {shutil.which('ctr')} (containerd " in done.stdout
        assert f"the release of the running containerd (pid {daemon.pid}, {bin_dir}/containerd))" in done.stdout
    finally:
        daemon.stop()


V1_CONFIG = """\
# containerd 1.x reads a file without `version` as version 1: plugins by their short id
root = "{w}/root"
state = "{w}/state"
[grpc]
  address = "{w}/containerd.sock"
[ttrpc]
  address = "{w}/containerd.sock.ttrpc"
[debug]
  address = "{w}/debug.sock"
[plugins.cri.cni]
  bin_dir = "/usr/lib/cni"
[plugins.opt]
  path = "{w}/opt"
"""


def test_a_version_1_config_gets_the_base_spec_in_its_own_cri_table(containerd, gpus, tmp_path):
    containerd.write_config(V1_CONFIG.format(w=containerd.workdir))
    dump_before = containerd.config_dump()
    spec_path = str(tmp_path / "gpuhook-base-spec.json")
    done = gpuhook_cli("install", "containerd", "--output", spec_path, "--containerd-config", containerd.config_path,
                       "--config", gpus.config)
    assert "[plugins.cri.containerd.runtimes.runc] (config version 1)" in done.stdout
    after = runc_runtime(containerd.config_dump())
    assert after["base_runtime_spec"] == spec_path and after["runtime_type"] == "io.containerd.runc.v2"
    containerd.start()
    assert containerd.plugin_status(CRI.rsplit(".", 1)[0], "cri") == "ok"
    containerd.stop()
    gpuhook_cli("uninstall", "containerd", "--output", spec_path, "--containerd-config", containerd.config_path)
    assert containerd.config_dump() == dump_before
