"""Entries of a container's rootfs made, replaced and taken back, each on the rootfs's own mount.

The namespace worker (gpuhook.apply.nsworker) creates the directories, files and links a
start needs inside the rootfs through these functions, each path resolved inside the rootfs
by gpuhook.kernel.paths, never crossing onto another mount (docs/security.md, "Writes only
on the rootfs and the runtime's /dev"). `Changes` remembers every change, newest last, so a
failed start takes all of it back; the image's own files are set aside, never overwritten,
until the commit.
"""

import errno
import os
import stat

from gpuhook.kernel.mountinfo import mount_id
from gpuhook.kernel.paths import OtherMountError, components, kind_of, open_in_root, other_mount, split

_CLOEXEC = os.O_CLOEXEC
_PATH = os.O_PATH | os.O_CLOEXEC


class Changes:
    """What an apply created inside a rootfs, so a failure can take it all back.

    `journal`, when given, hears of every change as it is made and of every one undone
    (`add(kind, path, parent_fd, name, extra)` returns a token for `undone(token)`; `clear()`
    at the commit): the namespace worker keeps it in memory its parent can read, so what a
    worker killed or stuck in the kernel leaves behind is known exactly (gpuhook.apply.leftovers)."""

    def __init__(self, journal=None):
        # (kind, parent dir fd, name, extra, journal token): kind is dir, file, relink or
        # replaced; extra is a relink's old target, a replacement's set-aside copy
        self.entries: list[tuple] = []
        self.journal = journal

    def _append(self, kind: str, parent_fd: int, name: str, extra: str, path: str) -> None:
        self.entries.append((kind, os.dup(parent_fd), name, extra, None))
        if self.journal is not None:
            try:
                token = self.journal.add(kind, path or name, parent_fd, name, extra)
            except (OSError, ValueError):  # never at the cost of the undo entry itself
                token = None
            self.entries[-1] = (kind, self.entries[-1][1], name, extra, token)

    def add(self, kind: str, parent_fd: int, name: str, path: str = "") -> None:
        """`name` (container path `path`) was created in the directory `parent_fd`."""
        self._append(kind, parent_fd, name, "", path)

    def add_relink(self, parent_fd: int, name: str, old_target: str, path: str = "") -> None:
        """`name` was a symlink to `old_target` that we re-pointed."""
        self._append("relink", parent_fd, name, old_target, path)

    def add_replaced(self, parent_fd: int, name: str, backup: str, path: str = "") -> None:
        """`name` was replaced; `backup` is what it was, set aside (`set_aside`), or "" when
        there was nothing. Undo puts the old one back; forget drops it. Call it once the
        replacement is in place (`replace_file` returned), never before."""
        self._append("replaced", parent_fd, name, backup, path)

    def mark(self) -> int:
        """A point to `undo` back to (`undo(since=...)`)."""
        return len(self.entries)

    def undo(self, since: int = 0) -> list[str]:
        """Remove what was created (after `since`), newest first. Returns problems, never raises."""
        problems = []
        while len(self.entries) > since:
            kind, parent, name, extra, token = self.entries.pop()
            try:
                if kind == "dir":
                    os.rmdir(name, dir_fd=parent)
                elif kind == "relink":
                    temp = f".{name}.gpuhook"
                    os.symlink(extra, temp, dir_fd=parent)
                    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
                elif kind == "replaced" and extra:
                    os.rename(extra, name, src_dir_fd=parent, dst_dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
                if token is not None:
                    self.journal.undone(token)
            except OSError as err:
                problems.append(f"could not remove {name}: {err.strerror}")
            finally:
                os.close(parent)
        return problems

    def forget(self) -> None:
        """Keep everything: close the directory fds, drop what `set_aside` kept."""
        while self.entries:
            kind, parent, _, backup, _ = self.entries.pop()
            if kind == "replaced" and backup:
                try:
                    os.unlink(backup, dir_fd=parent)
                except OSError:
                    pass  # a stray hidden copy of the image's old file: untidy, harmless
            os.close(parent)
        if self.journal is not None:
            self.journal.clear()


def lstat_here(dir_fd: int, name: str, shown: str = ""):
    """lstat of `name` in the directory open as `dir_fd`; an entry that is the root of
    another mount (a file or directory a volume was bound on) is refused with
    OtherMountError before its filesystem is asked anything. `shown` names it in errors."""
    fd = os.open(name, _PATH | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        if mount_id(fd) != mount_id(dir_fd):
            raise OtherMountError(errno.EXDEV, "is a mount point (a volume, or the runtime's)", shown or name)
        return os.fstat(fd)
    finally:
        os.close(fd)


def set_aside(dir_fd: int, name: str, shown: str = "") -> str:
    """Rename the file or symlink `name` (never followed) in the directory open as `dir_fd`
    to a fresh hidden name there, so a replacement can be undone (Changes.add_replaced);
    returns that name, or "" when `name` does not exist. A mount point there is refused."""
    try:
        st = lstat_here(dir_fd, name, shown)
    except FileNotFoundError:
        return ""
    if stat.S_ISDIR(st.st_mode):
        raise OSError(errno.EISDIR, "is a directory", shown or name)
    backup = f".{name}.gpuhook-old-{os.urandom(6).hex()}"
    os.rename(name, backup, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return backup


def make_dirs(root_fd: int, path: str, changes: Changes, mode: int = 0o755, beneath: bool = False,
              at: str = "") -> int:
    """O_PATH fd of directory `path` in the root, creating missing components; every
    component stays on the root's mount (OtherMountError otherwise: nothing is made on
    another mount). `beneath` resolves as open_in_root does; `at` is the container path of
    `root_fd` when it is not the container's root (/dev), for errors and the journal."""
    parts = components(path)
    if ".." in parts:
        raise OSError(errno.EINVAL, "'..' is not allowed in a planned path", at + path)
    cur = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            # Resolve each prefix from the root itself, so an absolute symlink on the way
            # means what it means to the container.
            prefix = "/" + "/".join(parts[: i + 1])
            try:
                nxt = open_in_root(root_fd, prefix, os.O_PATH | os.O_DIRECTORY, same_mount=True, beneath=beneath)
            except OtherMountError:
                raise other_mount(at + prefix) from None
            except FileNotFoundError:
                try:
                    os.mkdir(name, mode, dir_fd=cur)
                except FileExistsError:
                    raise OSError(errno.ENOENT, "is a symlink to a missing directory", at + prefix) from None
                changes.add("dir", cur, name, at + prefix)
                nxt = os.open(name, _PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cur)
            except NotADirectoryError:
                raise OSError(errno.ENOTDIR, "exists and is not a directory", at + prefix) from None
            os.close(cur)
            cur = nxt
        result, cur = cur, -1
        return result
    finally:
        if cur >= 0:
            os.close(cur)


def _ensure(root_fd: int, path: str, changes: Changes, create, is_kind, parent_fd=None) -> int:
    """O_PATH fd of `path`, made by `create(name, parent_fd)` if missing; whatever is there
    must pass `is_kind(mode)`, and its final component is never followed. `parent_fd`, if
    given, is the already-resolved parent directory (kept open)."""
    parent_path, name = split(path)
    parent = make_dirs(root_fd, parent_path, changes) if parent_fd is None else parent_fd
    try:
        try:
            create(name, parent)
            changes.add("dir" if is_kind is stat.S_ISDIR else "file", parent, name, path)
        except FileExistsError:
            pass
        fd = os.open(name, _PATH | os.O_NOFOLLOW, dir_fd=parent)
        st = os.fstat(fd)
        if not is_kind(st.st_mode):
            os.close(fd)
            raise OSError(errno.EEXIST, f"exists and is {kind_of(st.st_mode)}", path)
        return fd
    finally:
        if parent_fd is None:
            os.close(parent)


def ensure_file(root_fd: int, path: str, changes: Changes, mode: int = 0o644, parent_fd=None) -> int:
    """O_PATH fd of the regular file `path` (created empty if missing): a bind-mount target.

    A symlink, directory, FIFO, socket or device at `path` is refused, never followed.
    """
    def create(name, parent):
        os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | _CLOEXEC, mode, dir_fd=parent))

    return _ensure(root_fd, path, changes, create, stat.S_ISREG, parent_fd)


def ensure_dir(root_fd: int, path: str, changes: Changes, parent_fd=None) -> int:
    """O_PATH fd of directory `path` (created if missing); its final component must not be a symlink."""
    return _ensure(root_fd, path, changes, lambda name, parent: os.mkdir(name, 0o755, dir_fd=parent),
                   stat.S_ISDIR, parent_fd)


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = 0o644, owner=None, durable: bool = True) -> None:
    """Replace `name` in the directory open as `dir_fd` with `data`, atomically: a temporary
    file made O_EXCL|O_NOFOLLOW in that directory, `mode` and `owner` ((uid, gid) or None)
    set by fd, then renameat. Nothing is resolved by path, so a link planted in the
    directory is replaced, never followed. `durable`: the data reaches the disk (fsync)
    before the rename; a file that every container start writes anew need not."""
    tmp = f".{name}.gpuhook-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
