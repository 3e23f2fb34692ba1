"""gpuhook's CDI spec next to NVIDIA's on one node, with real podman (docs/cdi.md, "Next to
NVIDIA's").

NVIDIA's toolkit writes /var/run/cdi/nvidia.yaml (nvidia-cdi-refresh) with kind
nvidia.com/gpu and devices "0", "GPU-<uuid>", "all"; tests/data/cdi/nvidia-cdi-refresh.yaml is
a stand-in of that file. gpuhook's spec used the same kind and names, and podman then refused
both specs' devices ("unresolvable CDI devices nvidia.com/gpu=1"). With gpuhook's own kind,
`--device gpuhook.example/gpu=1` gets gpuhook's devices and hook, and `--device
nvidia.com/gpu=1` NVIDIA's, on the same node.

podman 4.3 reads only /etc/cdi and /var/run/cdi, so podman runs in a private mount namespace
whose /run/cdi (and /etc/cdi, if the host has one) is an empty tmpfs holding the test's specs:
the host's CDI directories are never written.
"""

import json
import os
import subprocess
import sys
import pytest
from conftest import HERE, require_root_tools, sim_config_values, write_config
from gpuhook.driver import MULTIARCH
from gpuhook.simulate import host as simhost
from helpers.runtimes import Podman


pytestmark = pytest.mark.root


GPUHOOK_KIND = "gpuhook.example/gpu"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    require_root_tools("gcc", "ldconfig", "podman", "runc", "unshare")
    return simhost.build(str(tmp_path_factory.mktemp("coexist") / "host"), gpus=2, seed="coexist")


def nvidia_spec(sim) -> str:
    """The stand-in of NVIDIA's spec for the simulated node: the GPU Operator's driver root
    /run/nvidia/driver becomes the simulated host's (dev and driver), the placeholder UUIDs its
    GPUs' and NVIDIA's hook binary, absent here, /bin/true (tests/data/cdi/README.md)."""
    with open(os.path.join(HERE, "data", "cdi", "nvidia-cdi-refresh.yaml")) as f:
        text = f.read()
    d = sim["directory"]
    text = text.replace("/run/nvidia/driver/dev/", f"{d}/dev/").replace("/run/nvidia/driver/", f"{d}/driver/")
    text = text.replace("x86_64-linux-gnu", MULTIARCH[sim["machine"]]).replace("/usr/bin/nvidia-cdi-hook", "/bin/true")
    for gpu in sim["gpus"]:
        text = text.replace(f"GPU-UUID-{gpu['index']}", gpu["uuid"])
    assert "/run/nvidia" not in text and "GPU-UUID" not in text
    return text


def generate(config, *args):
    return subprocess.run([sys.executable, "-m", "gpuhook", "cdi", "generate", "--config", config, *args],
                          capture_output=True, text=True, timeout=120, cwd="/")


@pytest.fixture
def cdi_dir(node, tmp_path):
    """A directory holding NVIDIA's spec (nvidia.yaml, the name nvidia-cdi-refresh writes) and
    gpuhook's (gpuhook-nvidia.json, the name the packaged refresh unit writes)."""
    specs = tmp_path / "cdi"
    specs.mkdir(mode=0o755)
    (specs / "nvidia.yaml").write_text(nvidia_spec(node))
    log = tmp_path / "gpuhook.log"
    config = write_config(str(tmp_path / "config.toml"), sim_config_values(node, str(log)),
                          **{"cdi-spec-dirs": [str(specs)]})
    done = generate(config, "--output", str(specs / "gpuhook-nvidia.json"))
    assert done.returncode == 0, done.stderr
    for spec in specs.iterdir():
        os.chmod(spec, 0o644)
    return specs, log


def podman_run(tmp_path, probe, specs, device):
    """`podman run --device DEVICE` of a busybox rootfs that probes GPUs 0 and 1 and libcuda and
    prints NVIDIA_VISIBLE_DEVICES, with /run/cdi holding exactly `specs`."""
    hooks = tmp_path / "no-hooks.d"  # gpuhook runs only as its spec's hook
    hooks.mkdir(exist_ok=True)
    rootfs = tmp_path / "rootfs"
    if not rootfs.exists():
        for d in ("bin", "etc"):
            (rootfs / d).mkdir(parents=True)
        subprocess.run(["cp", "/bin/busybox", probe, str(rootfs / "bin")], check=True)
        (rootfs / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    libcuda = f"/usr/lib/{MULTIARCH[os.uname().machine]}/libcuda.so.{simhost.DEFAULT_DRIVER_VERSION}"
    podman = Podman(str(tmp_path / "podman"), str(hooks))
    argv = podman.argv(str(rootfs), ["/bin/busybox", "sh", "-c",
                                     f"/bin/probe /dev/nvidia0 /dev/nvidia1 {libcuda}; "
                                     "echo \"visible=${NVIDIA_VISIBLE_DEVICES-unset}\""])
    argv[argv.index("run") + 1:argv.index("run") + 1] = ["--device", device]
    # /run/cdi must exist to be mounted over (it is the CDI directory podman reads); the
    # mounts live and die with the private namespace.
    os.makedirs("/run/cdi", exist_ok=True)
    script = ('set -e; mount -t tmpfs -o mode=0755 gpuhook-test-cdi /run/cdi; '
              'if [ -d /etc/cdi ]; then mount -t tmpfs -o mode=0755 gpuhook-test-cdi /etc/cdi; fi; '
              'cp -p "$0"/* /run/cdi/; exec "$@"')
    try:
        result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(specs), *argv],
                                capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, cwd="/")
    finally:
        podman.close()
    probes = {p["path"]: p for p in map(json.loads, (x for x in result.stdout.splitlines() if x.startswith("{")))}
    return result, probes, libcuda


def records(log) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_podman_gives_gpuhooks_devices_with_nvidias_spec_on_the_same_node(node, cdi_dir, probe, tmp_path):
    specs, log = cdi_dir
    result, probes, _ = podman_run(tmp_path, probe, specs, f"{GPUHOOK_KIND}=1")
    assert result.returncode == 0, result.stderr
    assert probes["/dev/nvidia1"]["read"] == "ENXIO" and probes["/dev/nvidia0"]["exists"] is False
    (start,) = [r for r in records(log) if r["stage"] == "createRuntime"]
    assert start["decision"] == "gpus injected" and start["gpus"] == [node["gpus"][1]["uuid"]]


def test_podman_gives_nvidias_devices_with_gpuhooks_spec_on_the_same_node(node, cdi_dir, probe, tmp_path):
    specs, log = cdi_dir
    result, probes, libcuda = podman_run(tmp_path, probe, specs, "nvidia.com/gpu=1")
    assert result.returncode == 0, result.stderr
    # NVIDIA's spec did it: its node, its library mount, its NVIDIA_VISIBLE_DEVICES=void.
    assert probes["/dev/nvidia1"]["read"] == "ENXIO" and probes["/dev/nvidia0"]["exists"] is False
    assert probes[libcuda]["type"] == "reg"
    assert "visible=void" in result.stdout.splitlines()
    assert records(log) == []  # gpuhook was not involved


def test_a_second_spec_of_gpuhooks_kind_in_the_same_directory_is_refused(cdi_dir, tmp_path):
    specs, _ = cdi_dir
    config = str(tmp_path / "config.toml")
    before = sorted(p.name for p in specs.iterdir())
    done = generate(config, "--output", str(specs / "gpuhook-copy.yaml"))
    assert done.returncode == 2
    assert done.stderr.startswith(f"gpuhook: {specs}/gpuhook-nvidia.json already defines CDI kind {GPUHOOK_KIND}"), \
        done.stderr
    assert sorted(p.name for p in specs.iterdir()) == before
    # Writing the same file again is what the refresh unit does at every boot.
    assert generate(config, "--output", str(specs / "gpuhook-nvidia.json")).returncode == 0


def test_an_earlier_gpuhook_spec_of_nvidias_kind_is_named(cdi_dir, tmp_path):
    specs, _ = cdi_dir
    earlier = json.loads((specs / "gpuhook-nvidia.json").read_text())
    earlier["kind"] = "nvidia.com/gpu"
    elsewhere = tmp_path / "etc-cdi"
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "gpuhook.json").write_text(json.dumps(earlier))
    os.chmod(elsewhere / "gpuhook.json", 0o644)
    config = write_config(str(tmp_path / "config2.toml"), sim_config_values_of(tmp_path),
                          **{"cdi-spec-dirs": [str(elsewhere), str(specs)]})
    done = generate(config, "--output", str(specs / "gpuhook-nvidia.json"))
    assert done.returncode == 0, done.stderr
    assert f"gpuhook: {elsewhere}/gpuhook.json is a spec of an earlier gpuhook under NVIDIA's kind nvidia.com/gpu" \
        in done.stderr
    assert "nvidia.yaml" not in done.stderr  # NVIDIA's own spec is not gpuhook's business


def sim_config_values_of(tmp_path) -> dict:
    """The keys of the config the cdi_dir fixture wrote (its simulated host)."""
    import tomllib

    with open(tmp_path / "config.toml", "rb") as f:
        return {k: v for k, v in tomllib.load(f).items() if not isinstance(v, (dict, list))}
