"""One start that carries gpuhook twice (docs/packaging.md, "containerd": a base spec's prestart.

The tests of it that need no root; those that do are in tests/integration/test_two_entries.py.
"""

import os
from gpuhook.apply import statefiles
from gpuhook.kernel import files


def test_records_of_stopped_starts_are_pruned_once_there_are_many(tmp_path):
    """A record outlives its start only until the registry of served starts grows: then the
    records of gone inits that a poststop marked stopped go, and live ones stay."""
    from gpuhook.apply import served
    from gpuhook.kernel import procstat

    state = str(tmp_path / "run")
    me = procstat.read_stat(os.getpid())
    for i in range(served.PRUNE_ABOVE + 1):  # gone inits (pid 0 is none), marked stopped
        statefiles.write_atomic(f"{state}/served/old{i}@0-{i}.json", {"id": f"old{i}", "pid": 0, "start_time": i,
                                                                  "boot_id": files.boot_id(), "stopped": True})
    served.save(state, "live", os.getpid(), "prestart")
    assert [n for n in os.listdir(f"{state}/served") if n != served.PRUNED] == [f"live@{os.getpid()}-{me.start_time}.json"]
    assert served.served_by(state, "live", os.getpid()) == "prestart"


def test_a_start_reads_the_other_records_at_most_once_a_prune_interval(tmp_path, monkeypatch):
    """Many recent records of gone inits (not stopped yet: their deletes have not come) stay;
    the first start past PRUNE_ABOVE reads them all, the starts after it within PRUNE_EVERY
    read none of them (each read costs every GPU start; benchmarks/RESULTS.md saw 342)."""
    from gpuhook.apply import served

    state = str(tmp_path / "run")
    for i in range(served.PRUNE_ABOVE + 20):
        statefiles.write_atomic(f"{state}/served/old{i}@0-{i}.json", {"id": f"old{i}", "pid": 0, "start_time": i,
                                                                  "boot_id": files.boot_id(), "stopped": False})
    reads = []
    real_read = files.read
    monkeypatch.setattr(files, "read", lambda path, *a, **k: reads.append(path) or real_read(path, *a, **k))
    served.save(state, "first", os.getpid(), "prestart")
    assert len(reads) >= served.PRUNE_ABOVE  # the prune ran: all of them were looked at
    assert len(os.listdir(f"{state}/served")) > served.PRUNE_ABOVE  # recent and not stopped: kept
    reads.clear()
    served.save(state, "second", os.getpid(), "createRuntime")
    assert reads == []
    # Once the interval has passed, the next start prunes again.
    stamp = f"{state}/served/{served.PRUNED}"
    old = os.lstat(stamp).st_mtime - served.PRUNE_EVERY - 1
    os.utime(stamp, (old, old))
    served.save(state, "third", os.getpid(), "prestart")
    assert len(reads) >= served.PRUNE_ABOVE
