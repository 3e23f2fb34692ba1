"""`gpuhook install --host-root DIR` (the DaemonSet's init container, docs/kubernetes.md)
against a fake node root: the package is copied to the node, the registration names the
node's paths, re-running changes nothing, uninstall takes everything back, and the copy
runs the hook by itself."""

import json
import os
import subprocess
import sys

import pytest

from helpers.runtimes import gpuhook_cli

BASE_SPEC = {"ociVersion": "1.0.2", "process": {"args": ["sh"]}, "root": {"path": "rootfs"}}
CONFIG = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  snapshotter = "overlayfs"\n'


def node(tmp_path, python="python3.11") -> str:
    root = tmp_path / "node"
    (root / "usr" / "bin").mkdir(parents=True)
    real = root / "usr" / "bin" / python
    real.write_text("")
    os.symlink(python, root / "usr" / "bin" / "python3")
    (root / "etc" / "containerd").mkdir(parents=True)
    (root / "etc" / "containerd" / "config.toml").write_text(CONFIG)
    (tmp_path / "base.json").write_text(json.dumps(BASE_SPEC))
    return str(root)


def tree(root: str) -> dict:
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = "link" if os.path.islink(path) else open(path, "rb").read()
    return found


def test_install_containerd_on_a_node_root_and_back(tmp_path):
    root = node(tmp_path)
    before = tree(root)
    args = ["containerd", "--host-root", root, "--base-spec", str(tmp_path / "base.json")]
    gpuhook_cli("install", *args)
    launcher = f"{root}/opt/gpuhook/lib/gpuhook/launch.py"
    assert os.path.isfile(launcher) and os.path.isfile(f"{root}/opt/gpuhook/lib/gpuhook/_vendor/__init__.py")
    spec = json.load(open(f"{root}/etc/containerd/gpuhook-base-spec.json"))
    (start,) = spec["hooks"]["prestart"]
    assert start["path"] == "/usr/bin/python3"
    assert start["args"][:5] == ["/usr/bin/python3", "-I", "-S", "/opt/gpuhook/lib/gpuhook/launch.py", "prestart"]
    config = open(f"{root}/etc/containerd/config.toml").read()
    assert 'base_runtime_spec = "/etc/containerd/gpuhook-base-spec.json"' in config  # the node's path
    again = gpuhook_cli("install", *args)
    assert all(line.startswith("unchanged") for line in again.stdout.splitlines() if not line.startswith("note:"))
    # The copy runs the hook by itself with the standard library: a container asking for no GPU.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(BASE_SPEC))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": 1, "bundle": str(bundle)})
    done = subprocess.run([sys.executable, "-I", "-S", launcher, "prestart"], input=state, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    gpuhook_cli("uninstall", "containerd", "--host-root", root)
    after = {k: v for k, v in tree(root).items() if "__pycache__" not in k}
    assert after == before


def test_crio_goes_to_the_nodes_default_hooks_dir(tmp_path):
    root = node(tmp_path)
    gpuhook_cli("install", "crio", "--host-root", root)
    hook = json.load(open(f"{root}/usr/share/containers/oci/hooks.d/gpuhook.json"))
    assert hook["hook"]["args"][3] == "/opt/gpuhook/lib/gpuhook/launch.py"
    gpuhook_cli("uninstall", "crio", "--host-root", root)
    assert not os.path.exists(f"{root}/usr/share/containers/oci/hooks.d/gpuhook.json")


@pytest.mark.parametrize("python,message", [("python3.9", "is Python 3.9; gpuhook needs 3.11"),
                                            (None, "the node has no /usr/bin/python3")])
def test_a_node_without_a_usable_python_is_refused_before_anything_is_written(tmp_path, python, message):
    root = node(tmp_path, python or "python3.11")
    if python is None:
        os.unlink(f"{root}/usr/bin/python3")
    before = tree(root)
    done = gpuhook_cli("install", "containerd", "--host-root", root, "--base-spec", str(tmp_path / "base.json"),
                       check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert tree(root) == before


@pytest.mark.parametrize("first,second", [("crio", "containerd"), ("containerd", "crio")])
def test_the_copied_package_stays_while_another_registration_uses_it(tmp_path, first, second):
    root = node(tmp_path)
    before = tree(root)
    extra = {"containerd": ["--base-spec", str(tmp_path / "base.json")], "crio": []}
    for target in (first, second):
        gpuhook_cli("install", target, "--host-root", root, *extra[target])
    launcher = f"{root}/opt/gpuhook/lib/gpuhook/launch.py"
    done = gpuhook_cli("uninstall", first, "--host-root", root)
    assert os.path.isfile(launcher), "removed while the other runtime still runs it"
    assert "/opt/gpuhook/lib kept: still used by" in done.stdout
    gpuhook_cli("uninstall", second, "--host-root", root)
    after = {k: v for k, v in tree(root).items() if "__pycache__" not in k}
    assert after == before
