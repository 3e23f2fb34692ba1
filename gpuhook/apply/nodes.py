"""The worker's device nodes and soname links in the container, each recorded for undo.

A device node is made with mknod in the container's own /dev (the runtime's tmpfs, or the
rootfs), or, in a user namespace, where a node on the container's /dev could not be opened,
the host's node is bound there instead (as runc does for its own devices). A soname link is
made in the image's library directory; a link the image already has by that name is
re-pointed atomically and its old target remembered. Every entry made is recorded in the
target's gpuhook.apply.rootfs.Changes, so a failed start takes it back; an entry that is
already exactly what the plan wants is left alone (the hook ran before, or the spec made it).
"""

import errno
import os
import stat

from gpuhook.apply import mounts
from gpuhook.kernel import paths


def make_node(target, node) -> None:
    """The step "device node <path>": a character device (a plan's DeviceNode)."""
    if node.host_path:
        bind_device(target, node)
        return
    parent, name = target.parent(node.path)
    want = os.makedev(node.major, node.minor)
    try:
        os.mknod(name, stat.S_IFCHR | node.mode, want, dir_fd=parent)
    except FileExistsError:
        fd, st, _ = target.existing(parent, name, node.path)
        os.close(fd)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return  # already there (the hook ran before, or the spec made it)
        numbers = f" {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else ""
        raise OSError(17, f"exists and is {paths.kind_of(st.st_mode)}{numbers}", node.path) from None
    target.changes.add("file", parent, name, node.path)
    os.chown(name, node.uid, node.gid, dir_fd=parent, follow_symlinks=False)
    target.count += 1


def bind_device(target, node) -> None:
    """The host's node bind-mounted at the container's path (user namespaces)."""
    st = os.fstat(target.sources[node.host_path])
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(node.major, node.minor):
        raise OSError(errno.EINVAL, f"host node {node.host_path} is not the character device "
                                    f"{node.major}:{node.minor}")
    mounts.bind_source(target, node.host_path, st, node.path, "file", ("nosuid", "noexec"))


def make_symlink(target, link) -> None:
    """The step "symlink <path>": a soname link (a plan's Symlink)."""
    parent, name = target.parent(link.path)
    try:
        os.symlink(link.target, name, dir_fd=parent)
        target.changes.add("file", parent, name, link.path)
    except FileExistsError:
        fd, st, _ = target.existing(parent, name, link.path)
        os.close(fd)
        if not stat.S_ISLNK(st.st_mode):
            raise OSError(17, f"exists and is {paths.kind_of(st.st_mode)}", link.path) from None
        old = os.readlink(name, dir_fd=parent)
        if old == link.target:
            return
        # The image has its own link by that name (a stub or an older driver's): point
        # it at the host driver, atomically, and remember the old target.
        temp = f".{name}.gpuhook"
        os.symlink(link.target, temp, dir_fd=parent)
        try:
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as err:
            os.unlink(temp, dir_fd=parent)
            raise OSError(err.errno, err.strerror, link.path) from None
        target.changes.add_relink(parent, name, old, link.path)
    target.count += 1
