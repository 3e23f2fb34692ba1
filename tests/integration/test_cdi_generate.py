"""`gpuhook cdi generate` (docs/cdi.md): a CDI spec for the simulated host, valid against
schemas/cdi-spec.json, and the bar from the issue: a real `podman run --device
gpuhook.example/gpu=1` with the spec in a CDI dir gives GPU 1 (ENXIO), no GPU 0, libcuda
mounted and in the container's ld cache, and a health check in gpuhook's log."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest
import yaml

from conftest import REPO, require_root_tools
from gpuhook.simulate import host as simhost
from helpers.runtimes import Podman, with_private_cdi_dir

pytestmark = pytest.mark.root



def generate(config, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuhook", "cdi", "generate", "--config", config, *args],
                          capture_output=True, text=True, timeout=120, cwd="/")


def schema() -> dict:
    with open(os.path.join(REPO, "schemas", "cdi-spec.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory):
    require_root_tools("gcc")
    return simhost.build(str(tmp_path_factory.mktemp("cdi-mig") / "host"), gpus=2, seed="cdi-mig",
                         mig={1: ["3g.40gb", "1g.10gb"]})


def test_the_spec_names_every_gpu_mig_device_and_all_and_is_valid(mig_host):
    done = generate(mig_host["config"])
    assert done.returncode == 0, done.stderr
    spec = json.loads(done.stdout)
    jsonschema.Draft7Validator(schema()).validate(spec)
    assert spec["kind"] == "gpuhook.example/gpu" and spec["cdiVersion"] == "0.5.0"
    names = [d["name"] for d in spec["devices"]]
    gpu0, gpu1 = mig_host["gpus"][0], mig_host["gpus"][1]
    assert names[:2] == ["0", gpu0["uuid"]] and names[-1] == "all"
    assert "1" in names and gpu1["uuid"] in names and "1:0" in names and "1:1" in names
    migs = [n for n in names if n.startswith("MIG-")]
    assert len(migs) == 2
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    # A MIG device: its parent's node, its GPU-instance and compute-instance access nodes,
    # and the marker the hook reads.
    edits = by_name["1:1"]
    assert [n["path"] for n in edits["deviceNodes"]][0] == f"/dev/nvidia{gpu1['minor']}"
    assert all(n["path"].startswith("/dev/nvidia-caps/nvidia-cap") for n in edits["deviceNodes"][1:])
    assert len(edits["deviceNodes"]) == 3 and edits == by_name[migs[1]]
    assert edits["mounts"][0]["containerPath"] == f"/var/run/nvidia-container-devices/{migs[1]}"
    assert by_name["0"]["mounts"][0] == {
        "hostPath": "/dev/null", "containerPath": f"/var/run/nvidia-container-devices/{gpu0['uuid']}",
        "type": "bind", "options": ["ro", "nosuid", "nodev", "noexec", "bind"]}
    common = spec["containerEdits"]
    assert [h["hookName"] for h in common["hooks"]] == ["createRuntime", "poststop"]
    assert common["hooks"][0]["args"][-3:] == ["createRuntime", "--config", mig_host["config"]]
    assert common["hooks"][0]["args"][1:3] == ["-I", "-S"] and common["hooks"][0]["env"][0].startswith("PATH=")
    assert any(m["containerPath"].endswith(f"libcuda.so.{mig_host['driver_version']}") for m in common["mounts"])
    assert all("ro" in m["options"] for m in common["mounts"])


def test_yaml_output_is_the_same_spec(sim_host, tmp_path):
    out = tmp_path / "nvidia.yaml"
    done = generate(sim_host["config"], "--output", str(out))
    assert done.returncode == 0 and done.stdout == f"wrote {out}\n", done.stderr
    assert oct(os.stat(out).st_mode & 0o777) == "0o644"
    assert yaml.safe_load(out.read_text()) == json.loads(generate(sim_host["config"]).stdout)


def test_yaml_output_has_no_anchors_or_aliases(mig_host, tmp_path):
    """The spec shares edits between a device's names (1:1 and its MIG UUID): PyYAML wrote them
    once with an anchor (&id001) and then as an alias (*id001), legal YAML that people (and
    some tools) read badly. Each device now carries its own edits."""
    out = tmp_path / "gpuhook.yaml"
    done = generate(mig_host["config"], "--output", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "&id" not in text and "*id" not in text
    assert yaml.safe_load(text) == json.loads(generate(mig_host["config"]).stdout)


@pytest.mark.parametrize("name", ["gpuhook.txt", "gpuhook", "gpuhook.json.tmp"])
def test_an_output_runtimes_would_not_read_is_refused(sim_host, tmp_path, name):
    """Runtimes read only *.json, *.yaml and *.yml from a CDI dir: --output gpuhook.txt was
    written without a word and never used."""
    out = tmp_path / name
    done = generate(sim_host["config"], "--output", str(out))
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpuhook: --output ") and ".json" in done.stderr
    assert done.stdout == "" and not out.exists() and os.listdir(tmp_path) == []


def test_unknown_capabilities_are_one_line(sim_host):
    done = generate(sim_host["config"], "--capabilities", "compute,warp")
    assert done.returncode == 2 and done.stderr.startswith("gpuhook: --capabilities: unknown warp"), done.stderr


def test_podman_with_the_generated_spec_gives_exactly_the_device_checked_and_in_the_ld_cache(sim_host, probe,
                                                                                           tmp_path):
    require_root_tools("podman", "runc", "unshare")
    cdi_dir = tmp_path / "cdi"  # podman sees it as /var/run/cdi (helpers.runtimes.with_private_cdi_dir)
    cdi_dir.mkdir()
    spec_file = str(cdi_dir / "gpuhook.json")
    from conftest import sim_config_values, write_config

    log = tmp_path / "gpuhook.log"
    config = write_config(str(tmp_path / "config.toml"), sim_config_values(sim_host, str(log)),
                          health={"mode": "always"})
    done = generate(config, "--output", spec_file)
    assert done.returncode == 0, done.stderr
    hooks = tmp_path / "no-hooks.d"  # gpuhook runs only as the spec's hook
    hooks.mkdir()
    rootfs = tmp_path / "rootfs"
    for d in ("bin", "etc"):
        (rootfs / d).mkdir(parents=True)
    subprocess.run(["cp", "/bin/busybox", probe, str(rootfs / "bin")], check=True)
    (rootfs / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")  # a glibc-style image
    podman = Podman(str(tmp_path / "podman"), str(hooks))
    libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.1" if os.uname().machine == "x86_64" else "/usr/lib/aarch64-linux-gnu/libcuda.so.1"
    try:
        argv = podman.argv(str(rootfs), ["/bin/busybox", "sh", "-c",
                                         f"/bin/probe /dev/nvidia0 /dev/nvidia1 {libcuda}; "
                                         "/bin/busybox grep -c libcuda.so.1 /etc/ld.so.cache"])
        argv[argv.index("run") + 1:argv.index("run") + 1] = ["--device", "gpuhook.example/gpu=1"]
        result = subprocess.run(with_private_cdi_dir(argv, str(cdi_dir)), capture_output=True, text=True,
                                timeout=120, stdin=subprocess.DEVNULL, cwd="/")
    finally:
        podman.close()
    assert result.returncode == 0, result.stderr
    probes = {p["path"]: p for p in map(json.loads, (x for x in result.stdout.splitlines() if x.startswith("{")))}
    assert probes["/dev/nvidia1"]["read"] == "ENXIO"
    assert probes["/dev/nvidia0"]["exists"] is False
    assert probes[libcuda]["type"] == "reg"
    assert result.stdout.splitlines()[-1] != "0"  # libcuda.so.1 is in the container's ld cache
    records = [json.loads(line) for line in log.read_text().splitlines()]
    (start,) = [r for r in records if r["stage"] == "createRuntime"]
    assert start["decision"] == "gpus injected" and start["gpus"] == [sim_host["gpus"][1]["uuid"]]
    assert start["health"]["mode"] == "always" and start["health"]["gpus"][0]["checks"]["ecc"] == "ok"
