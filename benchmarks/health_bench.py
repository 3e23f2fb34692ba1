#!/usr/bin/env python3
"""What gpuhook's health checks cost (docs/health.md): the healthy path for N GPUs, and a repair.

    sudo .venv/bin/python benchmarks/health_bench.py [--gpus 1,8,16] [--latency-ms 1000]
                                                     [--repeat 5] [--json]

`measure(gpus, latency_ms, repeat)` builds a simulated host of its own with `gpus` GPUs,
gives every GPU a check latency of `latency_ms` (the simulated NVML sleeps that long in the
one handle lookup each GPU's check makes: `handle_latency_ms` in docs/simulated-host.md),
and times `repeat` runs of exactly what the hook does before a start: check, repair if
needed (nothing is, on healthy GPUs), write the reports. It returns, in seconds:

    median_s, min_s, max_s   wall time of one run
    serial_estimate_s        median over runs of the sum of the GPUs' own check times: what
                             the same work costs one GPU after the other

`measure_reset(repeat)` times a repair on one GPU (a volatile ECC error: detect, reset with
the simulated nvidia-smi, check again). Needs root and a C compiler, like `gpuhook simulate`.
Nothing here asserts; benchmarks/run.py compares the figures with the targets.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from gpuhook import config as cfg  # noqa: E402
from gpuhook.health import engine  # noqa: E402
from gpuhook.simulate import host as simhost  # noqa: E402
from gpuhook.simulate import nvml as simnvml  # noqa: E402


class _Host:
    """A simulated host in a temporary directory, and a config pointing at it."""

    def __init__(self, gpus: int):
        self.directory = tempfile.mkdtemp(prefix="gpuhook-health-bench-")
        self.sim = simhost.build(f"{self.directory}/host", gpus=gpus, seed=f"health-bench-{gpus}")
        d = self.sim["directory"]
        self.config = cfg.from_mapping({
            "driver-root": f"{d}/driver", "dev-root": f"{d}/dev", "proc-root": f"{d}/proc",
            "nvml-library": self.sim["nvml_library"], "state-dir": f"{self.directory}/run", "log-file": "",
            # Generous: a benchmark measures, it does not fail on a slow machine.
            "health": {"deadline-seconds": 600},
        })
        self.uuids = [g["uuid"] for g in self.sim["gpus"]]
        self.state = self.sim["nvml_state"]

    def __enter__(self):
        # The simulated NVML follows $GPUHOOK_NVML_STATE when set; this host's own file counts here.
        self._saved = os.environ.pop(simnvml.ENV_VAR, None)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            os.environ[simnvml.ENV_VAR] = self._saved
        shutil.rmtree(self.directory, ignore_errors=True)

    def run(self, uuids):
        policy = engine.Policy(True, True, None, "needed")  # the hook's policy before a start
        return engine.run(uuids, self.config, "prestart", policy, time.monotonic() + 600)


def measure(gpus: int, latency_ms: int, repeat: int) -> dict:
    """Time the healthy-path check of `gpus` simulated GPUs at `latency_ms` per GPU check."""
    with _Host(gpus) as host:
        simnvml.update(host.state, lambda s: [g.update(handle_latency_ms=latency_ms) for g in s["gpus"]])
        walls, serial = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            report = host.run(host.uuids)
            walls.append(time.perf_counter() - started)
            if not report.ok:
                raise RuntimeError(f"a simulated GPU failed its checks: {report.error().one_line()}")
            serial.append(report.serial_seconds())
    return {"median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
            "serial_estimate_s": statistics.median(serial), "gpus": gpus, "latency_ms": latency_ms,
            "repeat": repeat}


def measure_reset(repeat: int) -> dict:
    """Time the repair of one GPU with a volatile ECC error: the whole run, and the reset alone."""
    with _Host(1) as host:
        walls, resets = [], []
        for _ in range(repeat):
            simnvml.set_gpu(host.state, 0, ecc_volatile_uncorrected=1)
            started = time.perf_counter()
            report = host.run(host.uuids)
            walls.append(time.perf_counter() - started)
            (result,) = report.gpus
            if result.status is not engine.Status.REPAIRED:
                raise RuntimeError(f"the repair did not work: {result.failure()}")
            resets.append(sum(a.seconds for a in result.actions if a.action == "reset"))
    return {"median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
            "reset_median_s": statistics.median(resets), "repeat": repeat}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,8,16", help="GPU counts, comma-separated (default 1,8,16)")
    parser.add_argument("--latency-ms", type=int, default=1000, help="check latency per GPU (default 1000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = []
    for count in [int(n) for n in args.gpus.split(",") if n.strip()]:
        result = measure(count, args.latency_ms, args.repeat)
        result["speedup"] = result["serial_estimate_s"] / result["median_s"]
        rows.append(result)
    repair = measure_reset(args.repeat)
    if args.json:
        print(json.dumps({"healthy": rows, "repair": repair}, indent=2))
        return
    print(f"healthy path, {args.latency_ms} ms per GPU check, {args.repeat} runs each")
    print(f"{'GPUs':>5} {'median s':>9} {'min s':>7} {'max s':>7} {'serial s':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f} "
              f"{r['serial_estimate_s']:>9.3f} {r['speedup']:>8.1f}x")
    print(f"repair of one GPU (ECC error: check, reset, check again): median {repair['median_s'] * 1000:.1f} ms, "
          f"of which the reset {repair['reset_median_s'] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
