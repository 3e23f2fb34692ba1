"""The no-GPU path: what a container without a GPU request costs, checked without timing.

Every container start on a host runs the hook, so for a container that wants no GPU the
hook must import nothing beyond a bare `python3 -I -S` (README, Performance): no json, no click, no
gpuhook.hook, nothing from site-packages. `-X importtime` lists every import, so this test
catches a regression without measuring time.
"""

import json
import os
from conftest import run_hook_process


def module_names(importtime_output: str) -> set:
    return {line.rsplit("|", 1)[1].strip() for line in importtime_output.splitlines()
            if line.startswith("import time:") and "|" in line}


def bundle(tmp_path, env=(), extra=None, pid=1) -> bytes:
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "env": ["PATH=/bin", *env]}, "mounts": [], "annotations": {}}
    if extra:
        spec.update(extra)
    (tmp_path / "config.json").write_text(json.dumps(spec))
    (tmp_path / "rootfs").mkdir(exist_ok=True)
    return json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": pid,
                       "bundle": str(tmp_path)}).encode()


def test_gpu_path_on_an_unchanged_host_avoids_the_heavy_stdlib(tmp_path, sim_host):
    """With warm caches the GPU path parses no TOML and imports neither json (re, enum)
    nor typing: those cost more than the hook's whole decision."""
    from conftest import sim_config_values, write_config

    config = write_config(tmp_path / "c.toml", sim_config_values(sim_host, str(tmp_path / "log")),
                          health={"mode": "off"})  # the checks load NVML by design (docs/health.md)
    state = bundle(tmp_path, ("NVIDIA_VISIBLE_DEVICES=0",), pid=os.getpid())
    args = ["prestart", "--config", config]
    run_hook_process(args, state)  # warms the config and inventory caches
    done = run_hook_process(args, state, python_flags=("-X", "importtime"))
    assert b"shares the hook's mount namespace" in done.stderr  # it went all the way to apply
    loaded = module_names(done.stderr.decode())
    assert {"gpuhook.hook", "gpuhook.discover.inventory", "gpuhook.apply.run"} <= loaded
    heavy = loaded & {"json", "re", "enum", "tomllib", "typing", "dataclasses", "subprocess", "signal",
                      "platform", "inspect"}
    assert heavy == set()
