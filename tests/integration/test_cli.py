"""The command line as a user meets it: help everywhere, dry runs on the samples, one-line errors."""

import json
import os
import subprocess
import sys
import pytest
from gpuhook import config as cfg
from conftest import REPO


SAMPLES = os.path.join(REPO, "examples", "states")


def gpuhook(*args, stdin=b"", env=None):
    run_env = {"PATH": os.environ["PATH"], **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpuhook", *args], input=stdin, capture_output=True,
                          env=run_env, timeout=120, cwd="/")


EXPECT = {
    "runc-no-gpu": ("nothing", []),
    "runc-gpu0": ("gpus", [0]),
    "crun-all-utility": ("all", [0, 1, 2, 3]),
    "podman-cuda-legacy": ("all", [0, 1, 2, 3]),
    "k8s-volume-mounts": ("gpus", [1]),
    "containerd-cdi": ("gpus", [0]),
    "runc-none": ("driver-only", []),
}


@pytest.mark.parametrize("sample", sorted(EXPECT))
def test_dry_run_on_shipped_samples_prints_the_plan_and_changes_nothing(sample, sim_host):
    wants, indices = EXPECT[sample]
    state = os.path.join(SAMPLES, f"{sample}.json")
    before = sorted(os.walk(os.path.join(REPO, "examples")))
    done = gpuhook("prestart", "--dry-run", "--json", "--state", state, "--config", sim_host["config"])
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["wants"] == wants
    uuids = [sim_host["gpus"][i]["uuid"] for i in indices]
    assert [g["uuid"] for g in plan["gpus"]] == uuids
    text = gpuhook("prestart", "--dry-run", "--state", state, "--config", sim_host["config"])
    assert text.returncode == 0 and f"container {plan['container_id']}" in text.stdout.decode()
    assert sorted(os.walk(os.path.join(REPO, "examples"))) == before


def test_dry_run_reads_stdin_and_reports_schema_deviations(sim_host):
    with open(os.path.join(SAMPLES, "runc-gpu0.json")) as f:
        doc = json.load(f)
    doc.update(status="starting", bundle=os.path.join(REPO, "examples", "bundles", "gpu0"))
    del doc["ociVersion"]
    done = gpuhook("prestart", "--dry-run", "--config", sim_host["config"], stdin=json.dumps(doc).encode())
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    assert "'ociVersion' is a required property" in out and "'starting' is not one of" in out


def test_list_and_config_on_the_simulated_host(sim_host):
    done = gpuhook("list", "--json", "--config", sim_host["config"])
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [g["uuid"] for g in listed["gpus"]] == [g["uuid"] for g in sim_host["gpus"]]
    done = gpuhook("config", "--json", env={"GPUHOOK_CONFIG": sim_host["config"]})
    shown = json.loads(done.stdout)
    assert shown["source"] == sim_host["config"] and shown["values"]["proc-root"].endswith("/proc")


def test_os_errors_are_one_line_not_a_traceback():
    done = gpuhook("simulate", "/proc/gpuhook-cannot-be-here")
    assert done.returncode == 4
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err and "/proc/gpuhook-cannot-be-here" in err


def test_config_text_output_is_the_configuration_as_toml(sim_host):
    import tomllib

    done = gpuhook("config", "--config", sim_host["config"])
    assert done.returncode == 0, done.stderr
    shown = tomllib.loads(done.stdout.decode())
    as_json = json.loads(gpuhook("config", "--json", "--config", sim_host["config"]).stdout)["values"]
    assert shown == as_json


def test_a_state_file_with_a_relative_bundle_works_without_dry_run_too(sim_host):
    state = os.path.join(SAMPLES, "runc-gpu0.json")  # pid 4242: no such container here
    done = gpuhook("prestart", "--state", state, "--config", sim_host["config"])
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "must be an absolute path" not in err and "4242" in err


def test_dry_run_writes_no_cache(tmp_path, sim_host):
    config = tmp_path / "c.toml"
    config.write_text(f'proc-root = "{sim_host["directory"]}/proc"\n'
                      f'driver-root = "{sim_host["directory"]}/driver"\nstate-dir = "{tmp_path}/state"\n')
    done = gpuhook("prestart", "--dry-run", "--state", os.path.join(SAMPLES, "runc-gpu0.json"),
                   "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "state").exists()
    assert not os.path.exists(cfg.cache_path(f"{tmp_path}/state", str(config)))
