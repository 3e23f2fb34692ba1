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
    assert os.listdir(f"{state}/served") == [f"live@{os.getpid()}-{me.start_time}.json"]
    assert served.served_by(state, "live", os.getpid()) == "prestart"
