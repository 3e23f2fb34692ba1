"""deploy/kubernetes: every manifest is valid against the Kubernetes 1.37 schemas (offline,
kubernetes-validate), and the commands it runs are real gpuhook commands."""

import os

import pytest
import yaml

from conftest import REPO, require

MANIFEST = os.path.join(REPO, "deploy", "kubernetes", "gpuhook.yaml")


def documents() -> list:
    with open(MANIFEST) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def test_every_manifest_is_valid_for_kubernetes_1_37():
    try:
        from kubernetes_validate import utils
    except ImportError:
        require(False, "needs kubernetes-validate (pip install -e '.[test]')")
    kinds = []
    for doc in documents():
        utils.validate(doc, "1.37.0", strict=True)
        kinds.append(doc["kind"])
    assert kinds == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"]


def test_the_daemonset_runs_the_plugin_with_what_it_needs():
    (daemonset,) = [d for d in documents() if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (plugin,) = pod["containers"]
    assert plugin["command"][:2] == ["gpuhook", "plugin"]
    mounts = {m["mountPath"] for m in plugin["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/run/gpuhook", "/host"} <= mounts
    assert plugin["lifecycle"]["preStop"]["exec"]["command"][:3] == ["gpuhook", "uninstall", "containerd"]
    (install,) = pod["initContainers"]
    assert "gpuhook install containerd --host-root /host" in install["command"][2]
    # A --base-spec is kept as it is (RLIMIT_NOFILE 1024 of `ctr oci spec` included, which CRI
    # drops only without a base spec): install takes the node's default itself.
    assert "--base-spec" not in install["command"][2] and "ctr oci spec" not in install["command"][2]


@pytest.mark.parametrize("argv", [
    ["plugin", "--config", "/config/config.toml", "--device-plugin-dir", "/var/lib/kubelet/device-plugins"],
    ["uninstall", "containerd", "--host-root", "/host"],
    ["install", "containerd", "--host-root", "/host", "--config", "/etc/gpuhook/config.toml"],
])
def test_the_manifest_commands_parse(argv):
    from click.testing import CliRunner

    from gpuhook.cli import cli

    done = CliRunner().invoke(cli, [*argv, "--help"])
    assert done.exit_code == 0, done.output


def test_the_configmap_is_a_valid_gpuhook_config():
    import tomllib

    from gpuhook import config as cfg

    (configmap,) = [d for d in documents() if d["kind"] == "ConfigMap"]
    loaded = cfg.from_mapping(tomllib.loads(configmap["data"]["config.toml"]))
    assert loaded.accept_env_when_unprivileged is False and loaded.plugin.strategy == "volume-mounts"
