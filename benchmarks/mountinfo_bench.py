#!/usr/bin/env python3
"""What reading the mount table costs a GPU start, on this host and on a node full of pods.

    .venv/bin/python benchmarks/mountinfo_bench.py [--volumes 0,300,1000,3000] [--rounds 200]

A GPU start reads a mount table four times: the cgroup placement of the container and of
the runtime (gpuhook.apply.cgroup.hierarchy.placement, in the host's namespace), and the
namespace worker's lookups of the mounts it meets (gpuhook.apply.target.Target.mount_entry,
twice, in the container's namespace, which before its pivot holds every mount of the host).
On a Kubernetes node every pod adds mounts (its volumes, secrets and service-account token)
to that table. This times, on this host's own table plus `--volumes` tmpfs lines like a pod's
token volume, interleaved in one run:

    placement, before   the full parse, and each hierarchy tested against every later mount
                        (the code before 2026-12-06, kept here as the reference)
    placement, now      gpuhook.kernel.mountinfo.cgroup_mounts_in
    worker, before      the full parse into {id: entry}, one lookup
    worker, now         gpuhook.kernel.mountinfo.index, one line parsed

and checks that both ways give the same answer. Pure CPU on bytes already read: the kernel's
own cost of writing the table out is the same either way.
"""

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpuhook.kernel import mountinfo  # noqa: E402


def covered_before(entries) -> list:
    """gpuhook.kernel.mountinfo.cgroup_mounts as it was: each hierarchy against every later mount."""
    def covers(upper, point):
        upper = upper.rstrip("/")
        return point == upper or point.startswith(upper + "/") or not upper
    found = []
    for i, m in enumerate(entries):
        if m.fstype in ("cgroup", "cgroup2") and not any(covers(later.point, m.point) for later in entries[i + 1:]):
            found.append((m.fstype, m.root, m.point, set(m.super_options)))
    return found


def node_table(volumes: int) -> bytes:
    own = mountinfo.read_bytes()
    pods = [b"%d 22 0:%d / /var/lib/kubelet/pods/%08d-7c1e/volumes/kubernetes.io~projected/kube-api-access "
            b"rw,relatime shared:%d - tmpfs tmpfs rw,size=65536k" % (100000 + i, 1000 + i, i, 5000 + i)
            for i in range(volumes)]
    return own + b"\n".join(pods) + (b"\n" if pods else b"")


def measure(volumes: int, rounds: int) -> dict:
    data = node_table(volumes)
    wanted = mountinfo.parse(data)[len(mountinfo.parse(data)) // 2].id  # a mount in the middle
    ways = {
        "placement, before": lambda: covered_before(mountinfo.parse(data)),
        "placement, now": lambda: mountinfo.cgroup_mounts_in(data),
        "worker, before": lambda: {m.id: m for m in mountinfo.parse(data)}[wanted],
        "worker, now": lambda: mountinfo.MountEntry(mountinfo.index(data)[wanted]),
    }
    assert ways["placement, before"]() == ways["placement, now"](), "the two placements differ"
    assert ways["worker, before"]().point == ways["worker, now"]().point, "the two lookups differ"
    samples = {name: [] for name in ways}
    order = list(ways)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            ways[name]()
            samples[name].append((time.perf_counter() - start) * 1000)
    return {"lines": len(data.splitlines()), **{name: statistics.median(v) for name, v in samples.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--volumes", default="0,300,1000,3000", help="pod volume lines added to this host's table")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    print(f"{'lines':>6}  {'placement before':>16}  {'placement now':>13}  {'worker before':>13}  {'worker now':>10}"
          "  (medians, ms; a start: 2 placements + 2 worker reads)")
    for volumes in (int(v) for v in args.volumes.split(",")):
        r = measure(volumes, args.rounds)
        print(f"{r['lines']:>6}  {r['placement, before']:>16.3f}  {r['placement, now']:>13.3f}  "
              f"{r['worker, before']:>13.3f}  {r['worker, now']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
