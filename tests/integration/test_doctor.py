"""`gpuhook doctor`, and the warnings `list` and `prestart --dry-run` print: a host problem
shows before a container start fails on it. Simulated hosts, the CLI as a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, require_root_tools, write_config
from gpuhook.cli import preflight
from gpuhook.simulate import host as simhost

SAMPLE = os.path.join(REPO, "examples", "states", "runc-gpu0.json")
CHECKS = ["driver", "device-majors", "device-nodes", "driver-libraries", "driver-programs", "ldconfig", "cgroup",
          "state-dir", "log", "health-daemon", "nvml", "runtimes"]


def gpuhook(*args):
    return subprocess.run([sys.executable, "-m", "gpuhook", *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ["PATH"]}, cwd="/")


def doctor(config, *args) -> tuple:
    done = gpuhook("doctor", "--json", "--config", config, *args)
    report = json.loads(done.stdout)
    return done, report, {c["name"]: c for c in report["checks"]}


def sim_values(sim, tmp_path) -> dict:
    d = sim["directory"]
    return {"driver-root": sim["driver_root"], "dev-root": f"{d}/dev", "proc-root": f"{d}/proc",
            "state-dir": str(tmp_path / "run"), "log-file": str(tmp_path / "gpuhook.log"),
            "nvml-library": sim["nvml_library"]}


@pytest.fixture(scope="module")
def gke_host(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("gke") / "host"), gpus=2, layout="gke")


def test_a_sound_host_passes_every_check_and_exits_0(sim_host, tmp_path):
    done, report, checks = doctor(write_config(tmp_path / "c.toml", sim_values(sim_host, tmp_path)))
    assert done.returncode == 0, done.stderr
    assert [c["name"] for c in report["checks"]] == CHECKS and report["ok"] is True
    failing = {name: c for name, c in checks.items() if c["status"] == preflight.FAIL}
    assert failing == {}
    assert checks["ldconfig"]["status"] == "ok" and "statically linked" in checks["ldconfig"]["summary"]
    assert checks["nvml"]["summary"].endswith("4 GPU(s), MIG off")
    assert checks["driver"]["summary"].startswith(f"driver {sim_host['driver_version']}, 4 GPU(s)")


def test_no_static_ldconfig_fails_the_doctor_with_exit_4_and_a_hint(sim_host, tmp_path):
    script = tmp_path / "ldconfig"
    script.write_text("#!/bin/sh\nexec /sbin/ldconfig.real \"$@\"\n")  # Ubuntu's, without its .real
    script.chmod(0o755)
    config = write_config(tmp_path / "c.toml", sim_values(sim_host, tmp_path), ldconfig=str(script))
    done, report, checks = doctor(config)
    assert done.returncode == 4 and report["ok"] is False
    assert checks["ldconfig"]["status"] == "fail" and "not an ELF binary" in checks["ldconfig"]["summary"]
    assert "statically linked ldconfig" in checks["ldconfig"]["hint"]
    assert done.stderr.strip() == "gpuhook: 1 check(s) failed: ldconfig (see the lines above)"
    text = gpuhook("doctor", "--config", config)
    assert text.returncode == 4
    assert any(line.startswith("FAIL  ldconfig") for line in text.stdout.splitlines())


def test_list_and_the_dry_run_warn_about_what_would_fail_every_start(sim_host, tmp_path):
    """The H200 host: list, check and --dry-run said nothing while every start failed."""
    config = write_config(tmp_path / "c.toml", sim_values(sim_host, tmp_path), ldconfig="/usr/bin/ldd")
    dry = gpuhook("prestart", "--dry-run", "--json", "--state", SAMPLE, "--config", config)
    assert dry.returncode == 0, dry.stderr  # the sample's image has no glibc: this start needs no ldconfig
    assert any(note.startswith("host: ldconfig: host ldconfig /usr/bin/ldd") for note in json.loads(dry.stdout)["notes"])
    assert not (tmp_path / "run").exists()  # the checks read only, as the dry run does
    listed = gpuhook("list", "--config", config)
    assert listed.returncode == 0, listed.stderr
    assert "warning: ldconfig: host ldconfig /usr/bin/ldd is not an ELF binary" in listed.stderr
    as_json = json.loads(gpuhook("list", "--json", "--config", config).stdout)
    assert [p["name"] for p in as_json["host_problems"]] == ["ldconfig"]


def test_the_gke_layouts_wrappers_are_named_and_the_real_programs_found(gke_host, tmp_path):
    done, _, checks = doctor(write_config(tmp_path / "c.toml", sim_values(gke_host, tmp_path)))
    programs = checks["driver-programs"]
    assert programs["status"] == "ok" and f"from {gke_host['bin_dir']}" in programs["summary"]
    assert f"skipped {gke_host['driver_root']}/usr/bin/nvidia-smi and 4 more (not an ELF file (a script))" in \
        programs["summary"]
    assert checks["driver-libraries"]["status"] == "ok" and gke_host["lib_dir"] in checks["driver-libraries"]["summary"]
    only_wrappers = write_config(tmp_path / "w.toml", sim_values(gke_host, tmp_path), **{"driver-bin-dirs": ["/usr/bin"]})
    _, _, checks = doctor(only_wrappers)
    assert checks["driver-programs"]["status"] == "warn" and "driver-bin-dirs" in checks["driver-programs"]["hint"]


def test_a_state_dir_others_can_write_fails(sim_host, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    done, _, checks = doctor(write_config(tmp_path / "c.toml", {**sim_values(sim_host, tmp_path),
                                                                 "state-dir": str(shared)}))
    assert done.returncode == 4
    assert checks["state-dir"]["status"] == "fail" and "mode 1777" in checks["state-dir"]["summary"]


def test_a_missing_uvm_module_and_stale_nodes_are_named(sim_host, tmp_path):
    """A private copy of the simulated /proc without nvidia-uvm, and a dev dir whose nvidia0
    has the wrong numbers."""
    import shutil

    proc, dev = tmp_path / "proc", tmp_path / "dev"
    shutil.copytree(f"{sim_host['directory']}/proc", proc)
    text = (proc / "devices").read_text()
    (proc / "devices").write_text("".join(line + "\n" for line in text.splitlines() if "nvidia-uvm" not in line))
    dev.mkdir()
    os.mknod(dev / "nvidiactl", 0o20666, os.makedev(195, 255))
    os.mknod(dev / "nvidia0", 0o20666, os.makedev(195, 7))
    values = {**sim_values(sim_host, tmp_path), "proc-root": str(proc), "dev-root": str(dev)}
    done, _, checks = doctor(write_config(tmp_path / "c.toml", values), "--quick")
    assert checks["device-majors"]["status"] == "warn" and "nvidia-uvm is not loaded" in checks["device-majors"]["summary"]
    assert checks["device-nodes"]["status"] == "fail"
    assert f"{dev}/nvidia0 is c 195:7, the driver's is c 195:0" in checks["device-nodes"]["summary"]
    assert "nvml" not in checks and done.returncode == 4  # --quick: files only


def test_registrations_whose_launcher_is_gone_fail_and_none_warns(sim_host, tmp_path):
    root = tmp_path / "node"
    hooks = root / "etc/containers/oci/hooks.d"
    hooks.mkdir(parents=True)
    values = sim_values(sim_host, tmp_path)
    _, _, checks = doctor(write_config(tmp_path / "c.toml", values), "--host-root", str(root))
    assert checks["runtimes"]["status"] == "warn"
    (hooks / "gpuhook.json").write_text(json.dumps({
        "version": "1.0.0", "stages": ["prestart"], "when": {"always": True},
        "hook": {"path": sys.executable, "args": [sys.executable, "-I", "-S", "/opt/gone/gpuhook/launch.py", "prestart"]}}))
    os.makedirs(root / os.path.dirname(sys.executable).lstrip("/"))
    os.symlink(sys.executable, root / sys.executable.lstrip("/"))
    done, _, checks = doctor(write_config(tmp_path / "c.toml", values), "--host-root", str(root))
    assert checks["runtimes"]["status"] == "fail" and "/opt/gone/gpuhook/launch.py" in checks["runtimes"]["summary"]
    os.makedirs(root / "opt/gone/gpuhook")
    (root / "opt/gone/gpuhook/launch.py").write_text("")
    _, _, checks = doctor(write_config(tmp_path / "c.toml", values), "--host-root", str(root))
    assert checks["runtimes"] == {"name": "runtimes", "status": "ok", "hint": None,
                                  "summary": "podman (/etc/containers/oci/hooks.d/gpuhook.json)"}


def test_containerds_base_spec_is_read_as_containerd_reads_its_config(sim_host, tmp_path):
    """The runc table of the file's config version, parsed as TOML: a commented-out line or
    another runtime's base spec is not gpuhook's registration, a trailing comment is no part
    of the path (versions 2, 3 and 4)."""
    root = tmp_path / "node"
    values = sim_values(sim_host, tmp_path)
    os.makedirs(root / os.path.dirname(sys.executable).lstrip("/"))
    os.symlink(sys.executable, root / sys.executable.lstrip("/"))
    os.makedirs(root / "opt/gpuhook/gpuhook")
    (root / "opt/gpuhook/gpuhook/launch.py").write_text("")

    def spec(launcher):
        return json.dumps({"hooks": {"prestart": [
            {"path": sys.executable, "args": [sys.executable, "-I", "-S", launcher, "prestart"]}]}})

    os.makedirs(root / "etc/containerd")
    (root / "etc/containerd/gpuhook.json").write_text(spec("/opt/gpuhook/gpuhook/launch.py"))
    (root / "etc/containerd/stale.json").write_text(spec("/opt/gone/gpuhook/launch.py"))
    tables = {2: 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes',
              3: "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes",
              4: "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes"}
    for version, table in tables.items():
        (root / "etc/containerd/config.toml").write_text(
            f"version = {version}\n"
            '# base_runtime_spec = "/etc/containerd/stale.json"\n'
            f"[{table}.kata]\n"
            '  base_runtime_spec = "/etc/containerd/stale.json"\n'
            f"[{table}.runc]\n"
            '  runtime_type = "io.containerd.runc.v2"\n'
            '  base_runtime_spec = "/etc/containerd/gpuhook.json"  # added by gpuhook\n')
        _, _, checks = doctor(write_config(tmp_path / "c.toml", values), "--host-root", str(root))
        assert checks["runtimes"]["status"] == "ok", (version, checks["runtimes"])
        assert checks["runtimes"]["summary"] == "containerd (base spec /etc/containerd/gpuhook.json)"


def test_an_nvml_that_does_not_load_is_one_sentence(sim_host, tmp_path):
    """The nvml line said `NVML does not load: NVML load failed: ...` and nested the hint's
    parentheses: one sentence, the hint once, no parentheses inside parentheses."""
    missing = tmp_path / "libnvidia-ml.so.1"
    done, _, checks = doctor(write_config(tmp_path / "c.toml", {**sim_values(sim_host, tmp_path),
                                                                 "nvml-library": str(missing)}))
    assert done.returncode == 4
    summary = checks["nvml"]["summary"]
    assert checks["nvml"]["status"] == "fail"
    assert summary.startswith(f"NVML does not load: cannot load {missing}: "), summary
    assert summary.count("NVML") == 1 and "failed" not in summary
    assert "(is the NVIDIA driver installed? config key nvml-library names the library)" in summary
    assert summary.endswith(": health checks fail every GPU start")
    inner = summary[summary.index("(") + 1:summary.rindex(")")]
    assert "(" not in inner and ")" not in inner
