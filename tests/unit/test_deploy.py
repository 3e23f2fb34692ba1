"""deploy/kubernetes: every manifest is valid against the schemas of the current Kubernetes
releases (offline, kubernetes-validate), the commands it runs are real gpuhook commands, and
the node's hook and the plugin container each get a configuration for where they run."""

import os

import pytest
import yaml

from conftest import REPO, require

MANIFEST = os.path.join(REPO, "deploy", "kubernetes", "gpuhook.yaml")


def documents() -> list:
    with open(MANIFEST) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def validator():
    try:
        from kubernetes_validate import utils
    except ImportError:
        require(False, "needs kubernetes-validate (pip install -e '.[test]')")
    return utils


def current_releases() -> list:
    """The three newest minor releases kubernetes-validate has schemas for: Kubernetes
    supports its three newest minor releases (kubernetes.io, "Version Skew Policy"). The test
    dependency asks for kubernetes-validate >= 1.37, so they are 1.35 to 1.37 or newer."""
    try:
        from kubernetes_validate import utils
    except ImportError:
        return ["1.35.0", "1.36.0", "1.37.0"]  # the test below then reports the missing tool
    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(int(p) for p in v.split(".")))
    return versions[-3:]


def test_the_current_releases_are_at_least_1_35_to_1_37():
    releases = current_releases()
    assert len(releases) == 3 and tuple(int(p) for p in releases[0].split(".")) >= (1, 35), releases


@pytest.mark.parametrize("version", current_releases())
def test_every_manifest_is_valid_for_the_current_kubernetes_releases(version):
    utils = validator()
    kinds = []
    for doc in documents():
        utils.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert kinds == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]


def test_the_daemonset_runs_the_plugin_with_what_it_needs():
    (daemonset,) = [d for d in documents() if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (plugin,) = pod["containers"]
    assert plugin["command"][:3] == ["gpuhook", "-v", "plugin"]
    mounts = {m["mountPath"] for m in plugin["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/run/gpuhook", "/host"} <= mounts
    assert plugin["lifecycle"]["preStop"]["exec"]["command"][:3] == ["gpuhook", "uninstall", "containerd"]
    (install,) = pod["initContainers"]
    assert "gpuhook install containerd --host-root /host" in install["command"][2]
    # A --base-spec is kept as it is (RLIMIT_NOFILE 1024 of `ctr oci spec` included, which CRI
    # drops only without a base spec): install takes the node's default itself.
    assert "--base-spec" not in install["command"][2] and "ctr oci spec" not in install["command"][2]


@pytest.mark.parametrize("argv", [
    ["-v", "plugin", "--config", "/config/plugin.toml", "--device-plugin-dir", "/var/lib/kubelet/device-plugins"],
    ["uninstall", "containerd", "--host-root", "/host"],
    ["install", "containerd", "--host-root", "/host", "--config", "/etc/gpuhook/config.toml"],
])
def test_the_manifest_commands_parse(argv):
    from click.testing import CliRunner

    from gpuhook.cli import cli

    done = CliRunner().invoke(cli, [*argv, "--help"])
    assert done.exit_code == 0, done.output


def configs() -> dict:
    import tomllib

    from gpuhook import config as cfg

    (configmap,) = [d for d in documents() if d["kind"] == "ConfigMap"]
    return {name: cfg.from_mapping(tomllib.loads(text), name) for name, text in configmap["data"].items()}


def pod_spec() -> dict:
    (daemonset,) = [d for d in documents() if d["kind"] == "DaemonSet"]
    return daemonset["spec"]["template"]["spec"]


def test_the_node_gets_the_hooks_config_with_the_nodes_own_roots():
    """The init container copies config.toml to the node, where the hook runs: a driver root
    or NVML path meant for the plugin container would break every GPU start there."""
    node = configs()["config.toml"]
    assert (node.driver_root, node.dev_root, node.proc_root, node.sys_root, node.nvml_library) == \
        ("/", "", "/proc", "/sys", "")
    assert node.accept_env_when_unprivileged is False and node.accept_cdi_annotations is False
    (install,) = pod_spec()["initContainers"]
    assert "cp /config/config.toml /host/etc/gpuhook/config.toml" in install["command"][2]
    assert "plugin.toml" not in install["command"][2]


def test_the_plugin_container_reaches_the_nodes_driver_through_its_own_config():
    plugin_config = configs()["plugin.toml"]
    (plugin,) = pod_spec()["containers"]
    assert plugin["command"][plugin["command"].index("--config") + 1] == "/config/plugin.toml"
    mounts = {m["mountPath"]: m["name"] for m in plugin["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    # The node's root (its driver's ld cache, libnvidia-ml.so.1, nvidia-smi) and its /dev.
    assert plugin_config.driver_root == "/host" and volumes[mounts["/host"]]["hostPath"]["path"] == "/"
    assert plugin_config.dev_root == "/dev" and volumes[mounts["/dev"]]["hostPath"]["path"] == "/dev"
    assert plugin_config.nvml_library == ""  # found in the driver root's ld cache (gpuhook.discover.nvml)
    # The state the hook reads (stamps, the health daemon's socket) is the node's.
    assert volumes[mounts[plugin_config.state_dir]]["hostPath"]["path"] == plugin_config.state_dir == "/run/gpuhook"
    assert plugin_config.log_file.startswith("/host/")
    assert plugin_config.health.reset_command.split()[:3] == ["/usr/sbin/chroot", "/host", "nvidia-smi"]
    assert plugin_config.plugin.strategy == "volume-mounts" and configs()["config.toml"].accept_volume_mounts
