"""`gpuhook prepare` and `gpuhook check` as a device plugin or a person runs them."""

import json
import os
import subprocess
import sys

import pytest

from gpuhook.health import store
from gpuhook.simulate import host as simhost
from gpuhook.simulate import nvml as simnvml

from conftest import require_root_tools

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    require_root_tools("gcc", "ldconfig")
    return simhost.build(str(tmp_path_factory.mktemp("health-cli") / "host"), gpus=3, seed="health-cli")


@pytest.fixture(scope="module")
def pristine(sim):
    return simnvml.load(sim["nvml_state"])


@pytest.fixture
def host(sim, pristine, tmp_path):
    """This test's config (its own state dir and log) on the module's host, healthy again."""
    simnvml.save(sim["nvml_state"], pristine)
    d = sim["directory"]
    path = tmp_path / "config.toml"
    path.write_text(f'driver-root = "{d}/driver"\nproc-root = "{d}/proc"\ndev-root = "{d}/dev"\n'
                    f'nvml-library = "{sim["nvml_library"]}"\nstate-dir = "{tmp_path}/run"\n'
                    f'log-file = "{tmp_path}/log"\n')
    return {"config": str(path), "state_dir": f"{tmp_path}/run", "log": f"{tmp_path}/log", "sim": sim,
            "uuids": [g["uuid"] for g in sim["gpus"]]}


def gpuhook(host, *args):
    return subprocess.run([sys.executable, "-m", "gpuhook", *args, "--config", host["config"]], capture_output=True,
                          text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})


def one_line(done) -> str:
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpuhook: "), done.stderr
    return done.stderr[len("gpuhook: "):].rstrip("\n")


def resets(host, index) -> int:
    return simnvml.load(host["sim"]["nvml_state"])["gpus"][index]["reset_count"]


def test_check_of_a_healthy_host_lists_every_gpu(host):
    done = gpuhook(host, "check", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(g["uuid"], g["status"]) for g in report["gpus"]] == [(u, "healthy") for u in host["uuids"]]
    assert report["purpose"] == "check" and report["ok"] is True
    assert all(store.read_report(host["state_dir"], u)["status"] == "healthy" for u in host["uuids"])


def test_check_reports_a_fault_and_changes_nothing(host):
    simnvml.set_gpu(host["sim"]["nvml_state"], 1, ecc_volatile_uncorrected=3)
    done = gpuhook(host, "check", "--devices", "1")
    assert done.returncode == 6
    assert done.stdout.startswith(f"{host['uuids'][1]}  unhealthy  ")
    assert one_line(done) == (f"{host['uuids'][1]} failed its ecc check: 3 volatile uncorrectable ECC error(s) "
                              "since the last reset; not repaired (check only)")
    assert resets(host, 1) == 0


TOKEN = "0123456789abcdef0123456789abcdef"  # an allocation's token (docs/device-plugin.md)


def stamps(host) -> list:
    directory = f"{host['state_dir']}/health/stamps"
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_check_with_repair_repairs_but_leaves_no_stamp(host):
    simnvml.set_gpu(host["sim"]["nvml_state"], 1, ecc_volatile_uncorrected=3)
    done = gpuhook(host, "check", "--devices", host["uuids"][1], "--repair")
    assert done.returncode == 0, done.stderr
    assert "repaired" in done.stdout and "reset " in done.stdout and resets(host, 1) == 1
    assert stamps(host) == []


def test_prepare_stamps_every_gpu_it_names_for_the_allocation(host):
    done = gpuhook(host, "prepare", "--devices", f"{host['uuids'][2]},0", "--allocation", TOKEN)
    assert done.returncode == 0, done.stderr
    assert [line.split()[:2] for line in done.stdout.splitlines()] == \
           [[host["uuids"][2], "healthy"], [host["uuids"][0], "healthy"]]
    # The text said nothing of the stamps, the one thing --allocation is for.
    assert all(line.endswith(f"  stamped for allocation {TOKEN}") for line in done.stdout.splitlines()), done.stdout
    assert stamps(host) == sorted(f"{uuid}@{TOKEN}.json" for uuid in (host["uuids"][2], host["uuids"][0]))
    for uuid in (host["uuids"][2], host["uuids"][0]):
        assert not store.claim_stamp(host["state_dir"], uuid, 60, ["another-allocation-0000"]).fresh
        assert store.claim_stamp(host["state_dir"], uuid, 60, [TOKEN]).fresh
    with open(host["log"]) as f:
        (record,) = [json.loads(line) for line in f]
    assert record["stage"] == "prepare" and record["stamped"] == [host["uuids"][2], host["uuids"][0]]


def test_prepare_without_an_allocation_cleans_but_leaves_no_stamp(host):
    simnvml.set_gpu(host["sim"]["nvml_state"], 1, ecc_volatile_uncorrected=3)
    done = gpuhook(host, "prepare", "--devices", "1")
    assert done.returncode == 0, done.stderr
    assert resets(host, 1) == 1 and stamps(host) == []  # a stamp for no start would serve any start
    assert "stamped" not in done.stdout


def test_prepare_refuses_an_allocation_token_that_could_name_a_path(host):
    done = gpuhook(host, "prepare", "--devices", "0", "--allocation", "../../../etc/x-0123456789")
    assert done.returncode == 2
    assert one_line(done).startswith("'../../../etc/x-0123456789' is not an allocation token")
    assert stamps(host) == [] and not os.path.exists(host["log"])  # refused before any check


def test_prepare_of_an_unhealthy_gpu_exits_6_with_the_report_on_stdout(host):
    simnvml.set_gpu(host["sim"]["nvml_state"], 0, ecc_volatile_uncorrected=1, reset_fails=True)
    done = gpuhook(host, "prepare", "--devices", "0", "--json")
    assert done.returncode == 6
    assert one_line(done).startswith(f"{host['uuids'][0]} failed its ecc check: 1 volatile uncorrectable ECC "
                                     "error(s) since the last reset; reset failed: nvidia-smi exited 255")
    report = json.loads(done.stdout)
    assert report["ok"] is False and report["gpus"][0]["actions"][0]["action"] == "reset"
    assert stamps(host) == []


def test_prepare_cut_off_by_its_deadline_exits_7(host):
    simnvml.set_gpu(host["sim"]["nvml_state"], 2, handle_latency_ms=3000)
    done = gpuhook(host, "prepare", "--devices", "2", "--deadline", "0.5")
    assert done.returncode == 7
    assert one_line(done).startswith(f"health checks cut off by their 0.5 s deadline: {host['uuids'][2]} at step "
                                     "query (NVML health queries)")


@pytest.mark.parametrize("args,code,message", [
    (["prepare", "--devices", "9"], 2, "--devices: no device '9' on this host (GPUs here: 0 ("),
    (["prepare", "--devices", "../../etc/passwd"], 2, "--devices: no device '../../etc/passwd' on this host"),
    (["prepare", "--devices", " , "], 2, "--devices names no device"),
    (["prepare"], 2, "Missing option '--devices'"),
    (["check", "--deadline", "0"], 2, "Invalid value for '--deadline'"),
])
def test_bad_arguments_are_one_line(host, args, code, message):
    done = gpuhook(host, *args)
    assert done.returncode == code and message in one_line(done), done.stderr


@pytest.mark.parametrize("command", ["check", "prepare"])
def test_a_mistyped_uuid_is_bad_input_and_writes_nothing(host, command):
    """Before: exit 6 ("GPU failed") and a phantom health/<uuid>.json a device plugin would read."""
    typo = host["uuids"][1][:-1] + ("0" if host["uuids"][1][-1] != "0" else "1")
    # The parsed config's cache (config-cache, written by loading the valid config file) is
    # no state about the input.
    state = lambda: sorted(n for n in os.listdir(host["state_dir"]) if n != "config-cache") \
        if os.path.isdir(host["state_dir"]) else []  # noqa: E731
    before = state()
    done = gpuhook(host, command, "--devices", typo)
    assert done.returncode == 2 and f"no device '{typo}' on this host" in one_line(done), done.stderr
    assert not os.path.exists(store.report_path(host["state_dir"], typo))
    assert state() == before
    done = gpuhook(host, command, "--devices", f"{host['uuids'][1].upper()},1")  # any case, once
    assert done.returncode == 0 and done.stdout.count(host["uuids"][1]) == 1, done.stderr


def test_list_says_whether_nvml_was_loaded_or_the_cache_answered(host):
    first = json.loads(gpuhook(host, "list", "--json").stdout)
    second = gpuhook(host, "list")
    assert first["nvml"] in ("NVML facts queried from NVML", "NVML facts from the inventory cache")
    assert second.stdout.rstrip().endswith("(NVML facts from the inventory cache)")


def test_verbose_prints_what_was_decided_and_quiet_prints_nothing(host):
    quiet = gpuhook(host, "check", "--devices", "0")
    assert quiet.returncode == 0 and quiet.stderr == ""
    loud = subprocess.run([sys.executable, "-m", "gpuhook", "-v", "check", "--devices", "0", "--config", host["config"]],
                          capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert loud.returncode == 0
    (line,) = loud.stderr.splitlines()
    doc = json.loads(line)
    assert doc["tag"] == "gpuhook" and doc["stage"] == "check" and doc["health"]["ok"] is True
