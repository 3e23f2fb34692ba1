"""The worker's bind mounts into the container, and their undo.

A host file or directory (a driver library, a program, firmware, an IPC endpoint, a device
node in a user namespace) is bound at its container path: the mount point is made on the
rootfs's own mount or the runtime's /dev (gpuhook.apply.target), and the mount lands only on
a mount that does not propagate (Target.refuse_shared), so nothing reaches the host's mount
table (docs/security.md, the four rules). Two ways, the same result:

- the new mount API (Linux 5.12+): the source is cloned as a detached mount on the host side
  (`clone`, open_tree only clones mounts of the caller's namespace), gets its flags and
  private propagation before it is attached (mount_setattr), then is moved onto the target,
  and stays reachable by fd for undo;
- the classic way: bind, then remount with the flags through a fresh fd of what is now at
  the target, after checking that it is the mount just made.

Every mount made is recorded in `Mounts`, the mount half of the worker's undo (the files it
made are gpuhook.apply.rootfs.Changes): undone newest first, by the mount's own fd where
there is one.
"""

import errno
import os
import stat

from gpuhook.kernel import linux, paths

_MS = {"ro": linux.MS_RDONLY, "nosuid": linux.MS_NOSUID, "nodev": linux.MS_NODEV, "noexec": linux.MS_NOEXEC}
_MOUNT_ATTR = {"ro": linux.MOUNT_ATTR_RDONLY, "nosuid": linux.MOUNT_ATTR_NOSUID, "nodev": linux.MOUNT_ATTR_NODEV,
               "noexec": linux.MOUNT_ATTR_NOEXEC}
# open_tree/mount_setattr/move_mount (Linux 5.12+): a bind mount gets its read-only and
# nosuid flags before it is attached, and stays reachable by fd for undo. Older kernels fall
# back to mount(MS_BIND) + remount. Switched off once ENOSYS is seen, or by tests.
use_new_mount_api = True
OPTIONAL_KINDS = frozenset({"socket", "dir"})  # IPC endpoints: a container works without them


class SharedMountError(OSError):
    """A mount would be attached to a mount that propagates (EPERM); `filename` is the
    container path."""


class Mounts:
    """The mounts the worker made, in the order made: (container path, fd of the mount or
    -1). `undo` takes them back newest first; `forget` keeps them (the commit)."""

    def __init__(self):
        self.made: list = []

    def add(self, path: str, fd: int = -1) -> None:
        self.made.append((path, fd))

    def undo(self, root: int) -> list[str]:
        """Unmount every mount made, newest first: by its fd, wherever it is by then, else
        found again at its path in the rootfs `root`. Returns the problems; never raises."""
        problems = []
        for target, fd in reversed(self.made):
            try:
                if fd >= 0:  # the mount itself, even if something moved it since
                    try:
                        linux.umount2(linux.fd_path(fd), linux.MNT_DETACH)
                    except OSError as err:
                        # EINVAL for the root of a mount held by fd: it is attached nowhere
                        # any more (detached by the runtime, or with a parent): nothing to undo.
                        if err.errno != errno.EINVAL:
                            raise
                else:
                    found = paths.open_in_root(root, target, os.O_PATH, follow_final=False)
                    try:
                        linux.umount2(linux.fd_path(found), linux.MNT_DETACH)
                    finally:
                        os.close(found)
            except OSError as err:
                problems.append(f"cannot unmount {target}: {err.strerror}")
        self.forget()
        return problems

    def forget(self) -> None:
        for _, fd in self.made:
            if fd >= 0:
                os.close(fd)
        self.made.clear()


def _flags(options) -> int:
    flags = 0
    for option in options:
        flags |= _MS[option]
    return flags


def clone(source: int):
    """A detached clone of the mount of the host source `source` (made in the hook's own
    namespace, before the worker joins the container's), or None without the new mount API."""
    global use_new_mount_api
    if not use_new_mount_api:
        return None
    try:
        return linux.open_tree_clone(source)
    except OSError as err:
        if err.errno != errno.ENOSYS:
            raise
        use_new_mount_api = False
        return None


def bind(target, mount) -> None:
    """The step "mount <path>": bind a host file or directory (a plan's BindMount). An IPC
    endpoint (a socket, the MPS directory) that cannot be placed safely (its path leads onto
    a volume, or it would propagate) is left out with a note: the container works without
    it. Anything else fails the start."""
    src_st = os.fstat(target.sources[mount.source])
    if mount.kind == "file" and not stat.S_ISREG(src_st.st_mode):
        raise OSError(errno.EINVAL, f"host source {mount.source} is {paths.kind_of(src_st.st_mode)}")
    if mount.kind not in OPTIONAL_KINDS:
        bind_source(target, mount.source, src_st, mount.target, mount.kind, mount.options)
        return
    mark = target.changes.mark()
    try:
        bind_source(target, mount.source, src_st, mount.target, mount.kind, mount.options)
    except (paths.OtherMountError, SharedMountError) as err:
        problems = target.changes.undo(since=mark)  # the directories made on the way, if any
        target.notes.append(f"{mount.target} not mounted: {err.filename or mount.target} {err.strerror}"
                            + (f" ({'; '.join(problems)})" if problems else ""))


def bind_source(target, source: str, src_st, target_path: str, kind: str, options) -> None:
    """Bind the host file `source` (opened as target.sources[source]) at `target_path` in
    the rootfs with `options`. The target is made on the rootfs's mount (or the runtime's
    /dev); one that is already there may be a mount point, and is then the mount the new
    one is attached to: it must not propagate either (Target.refuse_shared)."""
    parent, name = target.parent(target_path)
    point = _new_mount_point(target, parent, name, kind, target_path)
    if point is None:  # something is there already: ours from an earlier run, or in the way
        point, st, mount = target.existing(parent, name, target_path, same_fs=src_st.st_dev)
        try:
            if (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino):
                return  # mounted already (the hook ran before)
            wanted = stat.S_ISDIR if kind == "dir" else stat.S_ISREG
            if not wanted(st.st_mode):
                raise OSError(errno.EEXIST, f"exists and is {paths.kind_of(st.st_mode)}", target_path)
            target.refuse_shared(mount, target_path)
        except BaseException:
            os.close(point)
            raise
    else:
        target.refuse_shared(target.dir_mounts[parent], target_path)
    try:
        if not _attach(target, point, target_path, options):
            _bind_and_remount(target, target.local_source(source), src_st, point, target_path, options)
    finally:
        os.close(point)
    target.count += 1


def _attach(target, point: int, target_path: str, options) -> bool:
    """Attach the detached clone of the source made on the host, its flags set and its
    propagation private first, on `point`; False without the new mount API."""
    global use_new_mount_api
    tree = target.clones.pop(target_path, None)
    if tree is None:
        return False
    try:
        attrs = 0
        for option in options:
            attrs |= _MOUNT_ATTR[option]
        linux.mount_setattr(tree, attrs, propagation=linux.MS_PRIVATE)
        linux.move_mount(tree, point)
    except OSError as err:
        if err.errno != errno.ENOSYS:  # open_tree without mount_setattr (5.2-5.11)
            os.close(tree)
            raise OSError(err.errno, os.strerror(err.errno), target_path) from None
        os.close(tree)
        use_new_mount_api = False
        return False
    target.mounts.add(target_path, tree)
    return True


def _bind_and_remount(target, src: int, src_st, point: int, target_path: str, options) -> None:
    """The classic way: bind, then remount with `options` through a fresh fd of what is
    now at the target, after checking that it is the mount we just made."""
    linux.mount(linux.fd_path(src), linux.fd_path(point), None, linux.MS_BIND)
    target.mounts.add(target_path)
    now = paths.open_in_root(target.root, target_path, os.O_PATH, follow_final=False)
    try:
        st = os.fstat(now)
        if (st.st_dev, st.st_ino) != (src_st.st_dev, src_st.st_ino):
            raise OSError(errno.EBUSY, "changed under us while mounting", target_path)
        linux.mount(None, linux.fd_path(now), None, linux.MS_PRIVATE)
        linux.mount(None, linux.fd_path(now), None, linux.MS_BIND | linux.MS_REMOUNT | _flags(options))
    finally:
        os.close(now)


def _new_mount_point(target, parent: int, name: str, kind: str, path: str):
    """fd of a mount point made now (nothing can be mounted on it yet), or None if the
    name exists. The usual case, and the cheapest: one call makes and opens it."""
    try:
        if kind == "dir":
            os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        else:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=parent)
    except FileExistsError:
        return None
    target.changes.add("dir" if kind == "dir" else "file", parent, name, path)
    return fd
