"""The worker's ld cache update: the host's ldconfig builds the image's cache, which is then
installed, the image's own set aside for undo.

The host's ldconfig never runs on the container's rootfs itself: gpuhook.apply.ldsandbox runs
it in a sandbox that holds nothing but a read-only copy of the rootfs and gpuhook's own
mounts (docs/ldconfig.md), and `install_cache` puts what it built in place by the /etc
directory's fd. The image's own /etc/ld.so.cache is set aside, not overwritten, so the start
can still be undone after this last step (the hook's cgroup grant or health step may fail
meanwhile); the replacement is recorded in the target's gpuhook.apply.rootfs.Changes only
once it has happened.
"""

import errno
import os

from gpuhook.apply import ldsandbox, mounts, rootfs
from gpuhook.kernel import linux, paths

LD_CACHE = "/etc/ld.so.cache"


def prepare(target) -> None:
    """Fork the ldconfig sandbox now, before the worker's mounts (gpuhook.apply.ldsandbox.prepare):
    what it does before it needs them runs beside them. Best effort: without it, `build_cache`
    forks the sandbox itself, and says why when that fails."""
    try:
        target.sandbox = ldsandbox.prepare(target.plan.rootfs, target.root, target.ldconfig_fd,
                                           target.plan.ldcache.directories, target.deadline)
    except OSError:
        target.sandbox = None


def build_cache(target) -> None:
    """The step "ldconfig": build the cache (target.cache) for the plan's library dirs. Its
    output goes to gpuhook's log only (target.ldconfig_output): it can echo file contents,
    which the container's user must not see in the start error."""
    target.parent(LD_CACHE)  # /etc is made (or found) on the rootfs first: an error names it now
    # The sandbox keeps the driver's files gpuhook bound in (libraries, binaries,
    # firmware) and no other mount: not the IPC endpoints, not the device binds. They
    # are named by mount point, as /proc/self/mountinfo shows it: the path of the
    # directory fd the worker resolved, and the file name. (Whatever else sits at such
    # a point lies below gpuhook's mount and is hidden by it.)
    own = set()
    for mount in target.plan.mounts:
        fd = target.dirs.get(paths.split(mount.target)[0]) if mount.kind == "file" else None
        if fd is not None:
            own.add(os.readlink(linux.fd_path(fd)).rstrip("/") + "/" + paths.split(mount.target)[1])
    prepared, target.sandbox = target.sandbox, None
    try:
        target.cache, target.ldconfig_output = ldsandbox.build_cache(
            target.plan.rootfs, target.root, target.ldconfig_fd, target.plan.ldcache.directories, target.deadline,
            mounts.use_new_mount_api, own, prepared)
    except ldsandbox.SandboxError as err:
        target.ldconfig_output = err.output
        target.left += err.left
        raise OSError(errno.EIO, str(err)) from None


def install_cache(target) -> None:
    """The step "install /etc/ld.so.cache": the cache `build_cache` made, in place. Each of
    the set-aside and the replacement is registered for undo only once it has happened."""
    etc, name = target.parent(LD_CACHE)
    backup = rootfs.set_aside(etc, name, LD_CACHE)
    try:
        # Not synced to disk: a container's ld cache is written anew on each of its starts (a
        # restart after a host crash runs this again), and an fsync on the rootfs's disk is a
        # journal commit there: 0.2 ms on this VM, tens of ms on a busy node.
        rootfs.replace_file(etc, name, target.cache, durable=False)
    except OSError as err:
        if backup:
            try:
                os.rename(backup, name, src_dir_fd=etc, dst_dir_fd=etc)
            except OSError:
                target.changes.add_replaced(etc, name, backup, LD_CACHE)  # undo tries again, and says so
        raise OSError(err.errno, err.strerror, LD_CACHE) from None
    target.changes.add_replaced(etc, name, backup, LD_CACHE)
    target.count += 1
