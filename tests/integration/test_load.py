"""Load: many containers starting at once on one simulated host, and the decision log.

(Issue 7, items 5 and 6.) 32 real runc containers start concurrently on a 4-GPU host, each
asking for one GPU; every one must get exactly its GPU, nothing may deadlock, and the log
must hold one intact JSON line per start.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.root

CONTAINERS = 32


def nvidia_gpu_nodes(probes) -> set:
    return {p for p, item in probes.items() if p[:11] == "/dev/nvidia" and p[11:].isdigit() and item["exists"]}


def test_32_concurrent_starts_on_4_gpus_all_get_exactly_their_gpu(gpus):
    def start(i):
        return i, gpus.run(f"load{i}", env=[f"NVIDIA_VISIBLE_DEVICES={i % 4}"])

    with ThreadPoolExecutor(max_workers=CONTAINERS) as pool:
        results = list(pool.map(start, range(CONTAINERS), timeout=600))
    for i, result in results:
        assert result.returncode == 0, (i, result.stderr)
        probes = result.probes()
        assert nvidia_gpu_nodes(probes) == {f"/dev/nvidia{i % 4}"}, i
        assert probes[f"/dev/nvidia{i % 4}"]["read"] == "ENXIO"
    lines = gpus.log_lines()  # json.loads on every line: an interleaved line would not parse
    starts = [line for line in lines if line["stage"] == "prestart"]
    assert len(starts) == CONTAINERS
    assert sorted(line["container"] for line in starts) == sorted(f"load{i}" for i in range(CONTAINERS))
    assert all(line["decision"] == "gpus injected" for line in starts)
    # Shared state stayed consistent: one parseable inventory cache, and each GPU's health
    # report is whole, healthy and says it was written by a start (health mode fallback).
    state_dir = os.path.join(gpus.workdir, "run")
    with open(os.path.join(state_dir, "inventory.json")) as f:
        assert json.load(f)["inventory"]["driver_version"] == gpus.version
    for index in range(4):
        with open(os.path.join(state_dir, "health", f"{gpus.uuid(index)}.json")) as f:
            report = json.load(f)
        assert report["healthy"] is True and report["status"] == "healthy" and report["by"] == "prestart"
    assert not [name for name in os.listdir(state_dir) if name.endswith(".tmp")]


@pytest.mark.parametrize("log_target", ["missing-dir", "dev-full", "a-directory", "read-only-file"])
def test_a_broken_log_never_fails_a_start(gpus, tmp_path, log_target):
    path = {"missing-dir": str(tmp_path / "no" / "such" / "dir" / "log"),
            "dev-full": "/dev/full",
            "a-directory": str(tmp_path),
            "read-only-file": str(tmp_path / "ro.log")}[log_target]
    if log_target == "read-only-file":
        (tmp_path / "ro.log").write_text("")
        (tmp_path / "ro.log").chmod(0o444)
        import subprocess

        subprocess.run(["chattr", "+i", path], check=False)  # root ignores mode bits; immutability it does not
    try:
        gpus.configure(**{"log-file": path})
        result = gpus.run(f"log-{log_target}", env=["NVIDIA_VISIBLE_DEVICES=2"])
        assert result.returncode == 0, result.stderr
        assert nvidia_gpu_nodes(result.probes()) == {"/dev/nvidia2"}
    finally:
        if log_target == "read-only-file":
            import subprocess

            subprocess.run(["chattr", "-i", path], check=False)


def test_log_lines_carry_kubernetes_names(gpus):
    annotations = {"io.kubernetes.pod.name": "train-0", "io.kubernetes.pod.namespace": "ml",
                   "io.kubernetes.container.name": "trainer"}
    result = gpus.run("k8s-names", env=["NVIDIA_VISIBLE_DEVICES=3"], annotations=annotations)
    assert result.returncode == 0, result.stderr
    (line,) = gpus.log_lines()
    assert (line["pod"], line["namespace"], line["container_name"]) == ("train-0", "ml", "trainer")
    assert line["container"] == "k8s-names"
    assert line["gpus"] == [gpus.uuid(3)] and isinstance(line["seconds"], float)
    json.dumps(line)
