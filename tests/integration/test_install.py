"""`gpuhook install` / `gpuhook uninstall` on files in temp dirs: every target's dry run,
idempotence, backups, uninstall taking back exactly what install added, and bad input. Every
target registers two stages, prestart and poststop; the last section proves with real runc
that a bundle registered by `gpuhook install runc-bundle` runs both (podman, containerd and
crun: tests/integration/test_podman.py, tests/integration/test_containerd.py, tests/integration/test_crun.py)."""

import json
import os
import stat
import pytest
from helpers.runtimes import gpu_nodes, gpuhook_cli, log_records, registered


def write(path, text) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def one_line_error(done, *fragments):
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpuhook: "), done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def dig(doc, path):
    for key in path:
        doc = doc[key]
    return doc


@pytest.mark.parametrize("planted", ["gpuhook.json", "gpuhook-poststop.json"])
def test_install_never_follows_a_link_planted_in_a_user_owned_hooks_dir(tmp_path, planted):
    """A user who owns the hooks dir links our file name to a root file: install must not
    overwrite it, chown it to the user, or read it back on uninstall."""
    hooks_dir = tmp_path / "hooks.d"
    hooks_dir.mkdir()
    victim = tmp_path / "root-file"
    victim.write_text("root's precious file\n")
    os.chmod(victim, 0o600)
    (hooks_dir / planted).symlink_to(victim)
    os.chown(hooks_dir, 65534, 65534)
    done = gpuhook_cli("install", "podman", "--hooks-dir", str(hooks_dir), check=False)
    one_line_error(done, "is a symlink")
    assert victim.read_text() == "root's precious file\n"
    st = victim.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    done = gpuhook_cli("uninstall", "podman", "--hooks-dir", str(hooks_dir), check=False)
    assert "precious" not in done.stdout + done.stderr


DEBIAN_CONFIG = """\
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""


BASE_SPEC = {"ociVersion": "1.0.2-dev", "process": {"cwd": "/"}, "root": {"path": "rootfs"},
             "linux": {"namespaces": [{"type": "pid"}]}}


def containerd_paths(tmp_path) -> dict:
    base = write(tmp_path / "base.json", json.dumps(BASE_SPEC, indent=4) + "\n")
    return {"spec_path": str(tmp_path / "etc" / "gpuhook-base-spec.json"),
            "containerd_config": str(tmp_path / "etc" / "config.toml"), "base_spec": base}


@pytest.mark.root
def test_install_containerd_warns_when_a_cdi_spec_also_runs_gpuhook(tmp_path, sim_host):
    """A container given a device of gpuhook's CDI spec would run gpuhook from that spec
    (createRuntime) and from the base spec (prestart)."""
    cdi_dir = tmp_path / "cdi"
    gpuhook_cli("cdi", "generate", "--config", sim_host["config"], "--output", str(cdi_dir / "gpuhook.json"))
    paths = containerd_paths(tmp_path)
    write(paths["containerd_config"], DEBIAN_CONFIG.replace(
        '  [plugins."io.containerd.grpc.v1.cri"]\n',
        f'  [plugins."io.containerd.grpc.v1.cri"]\n    enable_cdi = true\n    cdi_spec_dirs = ["{cdi_dir}"]\n'))
    args = ["install", "containerd", "--output", paths["spec_path"], "--containerd-config", paths["containerd_config"],
            "--base-spec", paths["base_spec"]]
    done = gpuhook_cli(*args)
    assert (f"warning: the CDI spec {cdi_dir}/gpuhook.json also runs gpuhook: a container given its devices runs it "
            "twice") in done.stdout
    os.unlink(cdi_dir / "gpuhook.json")
    assert "warning" not in gpuhook_cli(*args).stdout


@pytest.mark.root
def test_a_bundle_installed_with_gpuhook_install_runs_prestart_and_poststop_under_runc(gpus):
    gpus.configure(health={"mode": "fallback"})
    bed = gpus.bed
    rootfs = bed.rootfs(f"{bed.workdir}/bundles/installed/rootfs", files={"/bin/probe": gpus.probe})
    bundle = bed.bundle("installed", ["/bin/probe", "/dev/nvidia1", "/dev/nvidia0"],
                        env=["NVIDIA_VISIBLE_DEVICES=1"], rootfs=rootfs)
    with open(f"{bundle}/config.json") as f:
        original = f.read()
    gpuhook_cli("install", "runc-bundle", bundle, "--config", gpus.config)

    result = bed.run(bundle, "installed")  # runc run, then runc delete, which runs poststop hooks
    assert result.returncode == 0, result.stderr
    assert gpu_nodes(result.probes()) == {"/dev/nvidia1"}
    (start,) = log_records(gpus, "prestart")
    assert (start["container"], start["decision"], start["health"]["mode"]) == \
        ("installed", "gpus injected", "fallback")
    assert isinstance(start["registered"], dict), start["registered"]
    (stop,) = log_records(gpus, "poststop")
    assert (stop["container"], stop["decision"]) == ("installed", "cleaned up"), stop
    assert stop["nvml"] == "not loaded"  # nothing was left to kill, reset-on-release is off (docs/health.md)
    assert not registered(gpus, "installed")

    gpuhook_cli("uninstall", "runc-bundle", bundle)
    with open(f"{bundle}/config.json") as f:
        assert f.read() == original
    assert not os.path.exists(f"{bundle}/config.json.gpuhook-bak")
