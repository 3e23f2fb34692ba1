"""gpuhook.apply.leftovers.take_back: what a killed or stuck worker left is taken back later, entry
by entry, and only while each entry is still the very file, directory or link it made."""

import os
import time

from gpuhook.apply import leftovers


def made(path) -> list:
    st = os.lstat(path)
    return [st.st_dev, st.st_ino, st.st_ctime_ns]


def test_only_what_the_worker_made_is_taken_back(tmp_path):
    root = tmp_path / "rootfs"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "usr/lib64/libcuda.so.550").write_text("")  # a mount point file it made
    (root / "usr/lib64/libcuda.so.1").symlink_to("libcuda.so.550")
    (root / "usr/lib64/libnvidia-ml.so.550").write_text("")
    (root / "etc/.ld.so.cache.gpuhook-old-1").write_text("the image's own cache")
    (root / "etc/ld.so.cache").write_text("the cache it installed")
    entries = [
        ["dir", "/usr/lib64", "lib64", "", *made(root / "usr/lib64")],
        ["file", "/usr/lib64/libcuda.so.550", "libcuda.so.550", "", *made(root / "usr/lib64/libcuda.so.550")],
        ["file", "/usr/lib64/libcuda.so.1", "libcuda.so.1", "", *made(root / "usr/lib64/libcuda.so.1")],
        ["file", "/usr/lib64/libnvidia-ml.so.550", "libnvidia-ml.so.550", "",
         *made(root / "usr/lib64/libnvidia-ml.so.550")],
        ["replaced", "/etc/ld.so.cache", "ld.so.cache", ".ld.so.cache.gpuhook-old-1", *made(root / "etc/ld.so.cache")],
        ["file", "/dev/nvidia0", "nvidia0", "", 0, 1, 0],  # the container's /dev: not the rootfs's device
    ]
    # Since the worker stopped, someone put a file of their own where it had made one (which
    # may well get the same inode number).
    os.unlink(root / "usr/lib64/libnvidia-ml.so.550")
    time.sleep(0.01)
    (root / "usr/lib64/libnvidia-ml.so.550").write_text("not the worker's")

    assert leftovers.take_back(str(root), entries) == ["dir /usr/lib64: Directory not empty"]
    assert sorted(os.listdir(root / "usr/lib64")) == ["libnvidia-ml.so.550"]
    assert (root / "usr/lib64/libnvidia-ml.so.550").read_text() == "not the worker's"
    assert os.listdir(root / "etc") == ["ld.so.cache"]
    assert (root / "etc/ld.so.cache").read_text() == "the image's own cache"


def test_entries_through_a_link_out_of_the_rootfs_are_never_followed(tmp_path):
    root, host = tmp_path / "rootfs", tmp_path / "host"
    (root / "usr").mkdir(parents=True)
    host.mkdir()
    (host / "precious").write_text("host file")
    (root / "usr/lib64").symlink_to(str(host))  # swapped in after the worker stopped
    entry = ["file", "/usr/lib64/precious", "precious", "", *made(host / "precious")]
    leftovers.take_back(str(root), [entry])
    assert (host / "precious").read_text() == "host file"
