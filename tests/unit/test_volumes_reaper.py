"""Pod volumes, in real runc starts: gpuhook writes only on the container's rootfs and the.

The tests of it that need no root; those that do are in tests/integration/test_volumes.py.
"""

import os
import shutil


def test_the_reaper_takes_back_its_own_records_keeps_others_and_drops_those_of_rootfses_gone(tmp_path):
    """Records as gpuhook.apply.leftovers.settle writes them, for three rootfses whose workers are
    gone: the one being started is taken back, another's stays for its own poststop or
    start, one whose rootfs the runtime already removed is dropped."""
    from gpuhook.apply import statefiles
    from gpuhook.kernel import files
    from gpuhook.apply import leftovers

    state_dir = str(tmp_path / "state")
    rootfses = {}
    for name in ("this", "other", "gone"):
        rootfs = tmp_path / name
        (rootfs / "usr/bin").mkdir(parents=True)
        (rootfs / "usr/bin/nvidia-smi").write_text("")
        st = os.lstat(rootfs / "usr/bin/nvidia-smi")
        statefiles.write_atomic(f"{leftovers.directory(state_dir)}/{name}.json", {
            "container": name, "rootfs": str(rootfs), "rootfs_identity": [os.stat(rootfs).st_dev, os.stat(rootfs).st_ino],
            "worker": 1, "worker_start_time": -1, "boot_id": files.boot_id(), "step": "mount /usr/bin/nvidia-debugdump",
            "entries": [["file", "/usr/bin/nvidia-smi", "nvidia-smi", "", st.st_dev, st.st_ino, st.st_ctime_ns]],
            "overflowed": False})
        rootfses[name] = rootfs
    shutil.rmtree(rootfses["gone"])
    record = {}
    leftovers.reap(state_dir, record, rootfs=str(rootfses["this"]))
    assert sorted(os.listdir(leftovers.directory(state_dir))) == ["other.json"]
    assert not (rootfses["this"] / "usr/bin/nvidia-smi").exists() and (rootfses["other"] / "usr/bin/nvidia-smi").exists()
    assert sorted((r["container"], r["rootfs"]) for r in record["leftovers"]) == [("gone", "gone"), ("this", "there")]
