"""Resolving container paths inside the rootfs: both resolvers, against hostile trees."""

import errno
import os
import socket
import stat

import pytest

from gpuhook.apply import rootfs
from gpuhook.kernel import paths


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    monkeypatch.setattr(paths, "use_openat2", request.param == "openat2")
    return request.param


@pytest.fixture
def tree(tmp_path):
    """A rootfs full of traps, next to a host directory that must never be touched."""
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    (host / "etc/secret").write_text("host secret")
    root = tmp_path / "root"
    for d in ("etc", "usr/lib", "real/deep/er", "dev"):
        (root / d).mkdir(parents=True)
    (root / "etc/secret").write_text("container file")
    (root / "abs-etc").symlink_to("/etc")                      # absolute: the container's /etc
    (root / "rel-up").symlink_to("../../../../../../etc")       # climbs: stops at the root
    (root / "to-host").symlink_to(str(host / "etc"))          # a host path spelled absolutely
    (root / "chain1").symlink_to("chain2")
    (root / "chain2").symlink_to("/real/deep")
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    (root / "lib").symlink_to("usr/lib")
    (root / "dangling").symlink_to("/does/not/exist")
    os.mkfifo(root / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(root / "sock"))
    s.close()
    return root, host


def real(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def rootfd(root):
    return os.open(root, os.O_PATH | os.O_DIRECTORY)


@pytest.mark.parametrize("path,expected", [
    ("/abs-etc/secret", "etc/secret"),
    ("/rel-up/secret", "etc/secret"),
    ("/../../etc/secret", "etc/secret"),
    ("/chain1/er", "real/deep/er"),
    ("/lib", "usr/lib"),
    ("//usr/./lib/", "usr/lib"),
    ("/", ""),
    ("/real/deep/er/..", "real/deep"),
])
def test_paths_resolve_inside_the_root(tree, resolver, path, expected):
    root, _ = tree
    fd = rootfd(root)
    try:
        assert real(paths.open_in_root(fd, path)) == os.path.join(str(root), expected).rstrip("/")
    finally:
        os.close(fd)


def test_a_host_path_spelled_absolutely_is_looked_up_inside_the_root(tree, resolver):
    root, host = tree
    fd = rootfd(root)
    try:
        with pytest.raises(FileNotFoundError):
            paths.open_in_root(fd, "/to-host/secret")
    finally:
        os.close(fd)


@pytest.mark.parametrize("path,code", [("/loop1", errno.ELOOP), ("/dangling", errno.ENOENT),
                                       ("/etc/secret/x", errno.ENOTDIR)])
def test_bad_paths_fail_with_the_right_errno(tree, resolver, path, code):
    root, _ = tree
    fd = rootfd(root)
    try:
        with pytest.raises(OSError) as err:
            paths.open_in_root(fd, path)
        assert err.value.errno == code
    finally:
        os.close(fd)


def test_final_symlink_is_not_followed_on_request(tree, resolver):
    root, _ = tree
    fd = rootfd(root)
    try:
        link = paths.open_in_root(fd, "/abs-etc", os.O_PATH, follow_final=False)
        assert os.readlink("", dir_fd=link) == "/etc"
        os.close(link)
    finally:
        os.close(fd)


def test_make_dirs_through_a_link_to_a_host_path_is_refused_and_touches_nothing(tree, resolver):
    root, host = tree
    fd = rootfd(root)
    changes = rootfs.Changes()
    try:
        # "/to-host" names <host>/etc, which inside the root does not exist: refused.
        with pytest.raises(OSError, match="symlink to a missing directory"):
            rootfs.make_dirs(fd, "/to-host/new/dir", changes)
        assert not (host / "etc/new").exists()
        # "/abs-etc" is the container's own /etc: followed, inside the root.
        os.close(rootfs.make_dirs(fd, "/abs-etc/new", changes))
        assert (root / "etc/new").is_dir() and not (host / "etc/new").exists()
    finally:
        changes.undo()
        os.close(fd)


def test_make_dirs_creates_and_undo_removes(tree, resolver):
    root, _ = tree
    fd = rootfd(root)
    changes = rootfs.Changes()
    try:
        os.close(rootfs.make_dirs(fd, "/lib/x86_64/deeper", changes))
        assert (root / "usr/lib/x86_64/deeper").is_dir()
        assert changes.undo() == []
        assert not (root / "usr/lib/x86_64").exists()
    finally:
        os.close(fd)


@pytest.mark.parametrize("name,kind", [("abs-etc", "a symlink"), ("real", "a directory"),
                                       ("fifo", "a FIFO"), ("sock", "a socket")])
def test_mount_targets_of_the_wrong_type_are_refused(tree, resolver, name, kind):
    root, _ = tree
    fd = rootfd(root)
    try:
        with pytest.raises(OSError) as err:
            rootfs.ensure_file(fd, f"/{name}", rootfs.Changes())
        assert kind in str(err.value)
    finally:
        os.close(fd)


def test_ensure_file_creates_an_empty_file_and_keeps_an_existing_one(tree, resolver):
    root, _ = tree
    fd = rootfd(root)
    changes = rootfs.Changes()
    try:
        os.close(rootfs.ensure_file(fd, "/lib/libcuda.so.1", changes))
        assert (root / "usr/lib/libcuda.so.1").stat().st_size == 0
        os.close(rootfs.ensure_file(fd, "/etc/secret", changes))
        assert (root / "etc/secret").read_text() == "container file"
        changes.undo()
        assert not (root / "usr/lib/libcuda.so.1").exists() and (root / "etc/secret").exists()
    finally:
        os.close(fd)


def test_relink_is_undone(tmp_path):
    (tmp_path / "lib.so.1").symlink_to("old")
    parent = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    changes = rootfs.Changes()
    os.unlink(tmp_path / "lib.so.1")
    os.symlink("new", tmp_path / "lib.so.1")
    changes.add_relink(parent, "lib.so.1", "old")
    os.close(parent)
    assert changes.undo() == []
    assert os.readlink(tmp_path / "lib.so.1") == "old"


def test_very_deep_paths(tmp_path, resolver):
    deep = "/" + "/".join(["d"] * 300)
    fd = rootfd(tmp_path)
    changes = rootfs.Changes()
    try:
        os.close(rootfs.make_dirs(fd, deep, changes))
        assert real(paths.open_in_root(fd, deep)).endswith("/d/d/d")
        changes.undo()
        assert not (tmp_path / "d").exists()
    finally:
        os.close(fd)


@pytest.mark.parametrize("path,exists", [
    ("/abs-etc/secret", True),          # the container's /etc/secret
    ("/rel-up/secret", True),
    ("/chain1/er", True),
    ("/to-host/secret", False),         # a host path spelled absolutely: looked up inside, not there
    ("/dangling", False),
    ("/loop1", False),
    ("/etc/secret/below-a-file", False),
])
def test_exists_in_root_answers_as_open_in_root_does(tree, resolver, path, exists):
    """The planning side's question, asked without openat2 (no ctypes in the hook process):
    the same answer as the resolver the worker uses."""
    root, _ = tree
    fd = rootfd(root)
    try:
        assert paths.exists_in_root(fd, path) is exists
        try:
            os.close(paths.open_in_root(fd, path))
            opened = True
        except OSError:
            opened = False
        assert opened is exists
    finally:
        os.close(fd)


def test_replaced_is_undone_to_the_old_file_and_forget_drops_the_copy(tmp_path):
    (tmp_path / "ld.so.cache").write_bytes(b"image's own")
    parent = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        for keep in (False, True):
            changes = rootfs.Changes()
            changes.add_replaced(parent, "ld.so.cache", rootfs.set_aside(parent, "ld.so.cache"))
            rootfs.replace_file(parent, "ld.so.cache", b"ours")
            if keep:
                changes.forget()
                assert os.listdir(tmp_path) == ["ld.so.cache"]
                assert (tmp_path / "ld.so.cache").read_bytes() == b"ours"
            else:
                assert changes.undo() == []
                assert os.listdir(tmp_path) == ["ld.so.cache"]
                assert (tmp_path / "ld.so.cache").read_bytes() == b"image's own"
        os.unlink(tmp_path / "ld.so.cache")
        changes = rootfs.Changes()  # nothing to set aside: undo removes ours
        changes.add_replaced(parent, "ld.so.cache", rootfs.set_aside(parent, "ld.so.cache"))
        rootfs.replace_file(parent, "ld.so.cache", b"ours")
        assert changes.undo() == [] and os.listdir(tmp_path) == []
        (tmp_path / "ld.so.cache").mkdir()
        with pytest.raises(IsADirectoryError):
            rootfs.set_aside(parent, "ld.so.cache")
    finally:
        os.close(parent)


def test_a_path_onto_another_mount_is_refused_when_it_must_stay_on_one(tmp_path, resolver):
    """Write paths stay on one mount: down into a mount point, or through a link that leads
    onto one (here the host's procfs, below the host's /), fails with EXDEV before that
    filesystem is asked anything; the same path resolves when crossing is allowed."""
    (tmp_path / "to-proc").symlink_to("/proc/self")
    root = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        for path in ("/proc/self/status", f"{tmp_path}/to-proc/status", "/proc"):
            with pytest.raises(paths.OtherMountError) as refused:
                paths.open_in_root(root, path, same_mount=True)
            assert refused.value.errno == errno.EXDEV and refused.value.filename == path
            assert not paths.exists_in_root(root, path)
            os.close(paths.open_in_root(root, path))
        os.close(paths.open_in_root(root, str(tmp_path), same_mount=True))
        with pytest.raises(paths.OtherMountError) as refused:
            rootfs.make_dirs(root, f"{tmp_path}/to-proc/new", rootfs.Changes())
        assert refused.value.filename == f"{tmp_path}/to-proc"
    finally:
        os.close(root)


def test_beneath_refuses_what_would_leave_the_directory(tree, resolver):
    """RESOLVE_BENEATH, for a directory that is not the container's root (its /dev): an
    absolute link or a '..' above it fails instead of restarting from it."""
    root, _ = tree
    fd = os.open(root / "real", os.O_PATH | os.O_DIRECTORY)
    (root / "real" / "abs").symlink_to("/etc")
    try:
        os.close(paths.open_in_root(fd, "/deep/er", beneath=True))
        for path in ("/abs/secret", "/../etc/secret", "/deep/../../etc"):
            with pytest.raises(OSError) as refused:
                paths.open_in_root(fd, path, beneath=True)
            assert refused.value.errno == errno.EXDEV, path
    finally:
        os.close(fd)


def test_an_entry_that_is_a_mount_point_is_never_stated(tmp_path):
    root = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(paths.OtherMountError):
            rootfs.lstat_here(root, "proc", "/proc")
        with pytest.raises(paths.OtherMountError):
            rootfs.set_aside(root, "proc", "/proc")
        assert stat.S_ISDIR(rootfs.lstat_here(root, "usr").st_mode)
    finally:
        os.close(root)



def test_replace_file_syncs_only_a_durable_file(tmp_path, monkeypatch):
    """Installed config files reach the disk before their rename; a container's ld cache,
    written anew on each start, is not synced (an fsync there is a journal commit of the
    rootfs's disk on the start path)."""
    synced = []
    monkeypatch.setattr(rootfs.os, "fsync", lambda fd: synced.append(fd))
    parent = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        rootfs.replace_file(parent, "config.toml", b"durable")
        assert len(synced) == 1
        rootfs.replace_file(parent, "ld.so.cache", b"per start", durable=False)
        assert len(synced) == 1 and (tmp_path / "ld.so.cache").read_bytes() == b"per start"
    finally:
        os.close(parent)
