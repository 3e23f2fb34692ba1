"""Paths inside a container's rootfs, resolved without ever leaving it.

Every container path gpuhook touches is resolved by this module (CVE-2024-0132, CVE-2024-0134,
CVE-2025-23359: symlinks in the image redirected a runtime's mounts onto the host). A path
is resolved as if the rootfs were "/": absolute symlinks and ".." stop at the rootfs, as in
a chroot. Results are O_PATH file descriptors, so what was checked is what gets mounted on
(via /proc/self/fd/N); a path string is never re-resolved after the check.

Two resolvers give the same answers: openat2(RESOLVE_IN_ROOT) where the kernel has it (5.6+),
and a component walk over O_NOFOLLOW descriptors elsewhere (RHEL 8's 4.18, for one). Tests
run both. openat2 needs ctypes (gpuhook.kernel.linux), which costs about 3 ms to load; the planning
side only asks `exists_in_root`, which walks, so the hook process does not load ctypes while
the namespace worker (gpuhook.apply.worker) loads it on another core.

Writes stay on one mount (docs/security.md, "Writes only on the rootfs and the runtime's
/dev"): a path resolved `same_mount` never crosses into another mount, neither down into a
mount point nor through a symlink that leads onto one (a pod volume, the runtime's /proc,
/sys or /dev, a stalled network or FUSE filesystem). openat2 does it with RESOLVE_NO_XDEV;
the walk compares each step's mount id with the root's before it asks that step's
filesystem anything (a stat of a stalled FUSE root never returns). Such a path fails with
OtherMountError (EXDEV).

This module only resolves; making, replacing and taking back entries of a rootfs is
gpuhook.apply.rootfs.
"""

import errno
import os
import stat

from gpuhook.kernel.mountinfo import mount_id

MAX_SYMLINKS = 40
_CLOEXEC = os.O_CLOEXEC
_PATH = os.O_PATH | os.O_CLOEXEC

use_openat2 = True  # switched off once if the kernel lacks it, or by tests


def kind_of(mode: int) -> str:
    """Human name of a file type, for error messages."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "an unknown file type"


class OtherMountError(OSError):
    """A path that had to stay on one mount crosses onto another (errno EXDEV); `filename`
    is the container path as far as it was asked for."""


OTHER_MOUNT = "lies on another mount than the container's rootfs (a volume, or the runtime's)"


def other_mount(path: str) -> OtherMountError:
    return OtherMountError(errno.EXDEV, OTHER_MOUNT, path)


def components(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def open_in_root(root_fd: int, path: str, flags: int = os.O_PATH, follow_final: bool = True,
                 same_mount: bool = False, beneath: bool = False) -> int:
    """Open `path` (absolute, container-side) inside the tree at `root_fd`. With
    `same_mount` every step stays on `root_fd`'s mount (OtherMountError otherwise); with
    `beneath` an absolute symlink or a ".." above `root_fd` fails (EXDEV) instead of
    restarting from it (RESOLVE_BENEATH: for a subtree, such as /dev, that is not the
    container's root)."""
    global use_openat2
    rel = "/".join(components(path)) or "."
    if not follow_final:
        flags |= os.O_NOFOLLOW
    if use_openat2:
        from gpuhook.kernel import linux

        resolve = (linux.RESOLVE_BENEATH if beneath else linux.RESOLVE_IN_ROOT) | linux.RESOLVE_NO_MAGICLINKS
        if same_mount:
            resolve |= linux.RESOLVE_NO_XDEV
        for _ in range(16):
            try:
                return linux.openat2(root_fd, rel, flags | _CLOEXEC, 0, resolve)
            except OSError as err:
                if err.errno == errno.EAGAIN:  # a concurrent rename or mount; retry
                    continue
                if err.errno == errno.ENOSYS:
                    use_openat2 = False
                    break
                if err.errno == errno.EXDEV and (same_mount or beneath):
                    raise other_mount(path) from None
                raise OSError(err.errno, os.strerror(err.errno), path) from None
        else:

            raise OSError(errno.EAGAIN, "resolution kept racing with renames", path)
    return _walk(root_fd, path, flags, follow_final, same_mount, beneath)


def exists_in_root(root_fd: int, path: str) -> bool:
    """Whether `path` (absolute, container-side) exists inside the tree at `root_fd` on its
    mount, following its symlinks inside that tree (the component walk: no ctypes). A path
    that leads onto another mount counts as missing: nothing on it is asked anything."""
    try:
        os.close(_walk(root_fd, path, _PATH, True, True, False))
        return True
    except OSError:
        return False


def _walk(root_fd: int, path: str, flags: int, follow_final: bool, same_mount: bool = False,
          beneath: bool = False) -> int:
    """RESOLVE_IN_ROOT (or RESOLVE_BENEATH), and RESOLVE_NO_XDEV when `same_mount`, in user
    space: one O_NOFOLLOW step at a time from `root_fd`."""
    pending = components(path)
    pending.reverse()  # a stack: the next component is last
    cur = os.dup(root_fd)
    parents: list[int] = []
    links = 0
    root_mount = mount_id(root_fd) if same_mount else 0
    try:
        if not pending:
            result, cur = cur, -1
            return _reopen(result, flags) if flags & ~(os.O_PATH | os.O_NOFOLLOW) else result
        while pending:
            name = pending.pop()
            if name == "..":
                if parents:
                    os.close(cur)
                    cur = parents.pop()
                elif beneath:
                    raise other_mount(path)
                continue
            last = not pending
            fd = os.open(name, _PATH | os.O_NOFOLLOW, dir_fd=cur)
            # The mount first: fstat would ask the filesystem mounted there, which may never answer.
            if same_mount and mount_id(fd) != root_mount:
                os.close(fd)
                raise other_mount(path)
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode) and (not last or follow_final):
                target = os.readlink("", dir_fd=fd)
                os.close(fd)
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                if target.startswith("/") and beneath:
                    raise other_mount(path)
                if target.startswith("/"):
                    for p in parents:
                        os.close(p)
                    parents = []
                    os.close(cur)
                    cur = os.dup(root_fd)
                pending.extend(reversed(components(target)))
                if not pending:  # a link to "/" or "."
                    pending.append(".")
                continue
            if last:
                os.close(fd)
                return os.open(name, flags | os.O_NOFOLLOW | _CLOEXEC, dir_fd=cur)
            if not stat.S_ISDIR(mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            parents.append(cur)
            cur = fd
        # The path ended in "..": `cur` is the answer.
        result, cur = cur, -1
        return _reopen(result, flags)
    finally:
        for p in parents:
            os.close(p)
        if cur >= 0:
            os.close(cur)


def _reopen(fd: int, flags: int) -> int:
    if flags & ~(os.O_PATH | os.O_NOFOLLOW) == 0 and flags & os.O_PATH:
        return fd
    try:
        return os.open(".", (flags & ~os.O_NOFOLLOW) | _CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def split(path: str) -> tuple[str, str]:
    parts = components(path)
    if not parts:
        raise OSError(errno.EINVAL, "path has no file name", path)
    return "/" + "/".join(parts[:-1]), parts[-1]


def resolve_host(root: str, path: str) -> str:
    """Host path of `path` under a trusted `root` (a driver root), symlinks kept inside it.

    For reading the driver's own tree only; container paths always go through fds.
    """
    if root == "/":
        return os.path.realpath(path)
    root_fd = os.open(root, _PATH | os.O_DIRECTORY)
    try:
        fd = open_in_root(root_fd, path, os.O_PATH)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)
    return real
