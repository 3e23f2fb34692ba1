"""The container the namespace worker works on: its rootfs and /dev, the host sources, and the
two journals that undo its steps.

A `Target` is what every step of the worker (gpuhook.apply.nodes, mounts, procmask,
ldconfig) acts through. It opens the host's sources up front, in the hook's own mount
namespace and with the host's credentials (`open_sources`); checks that the rootfs is the
one the runtime set up in the container's namespace (`check_rootfs`); and finds, or makes,
the directory each entry goes into (`parent`), only on the rootfs's own mount or the
runtime's /dev, never onto another mount: a volume, the runtime's /proc or /sys, a
filesystem that may never answer (docs/security.md, "Writes only on the rootfs and the
runtime's /dev"). Mounts land only where they cannot propagate (`refuse_shared`).

What a step makes is recorded as it is made: files, directories and links in `changes`
(gpuhook.apply.rootfs.Changes, which also tells the hook through the shared journal), mounts
in `mounts` (gpuhook.apply.mounts.Mounts). `undo` takes back both, mounts first, newest
first.
"""

import errno
import os
import stat

from gpuhook.apply import mounts, rootfs
from gpuhook.apply.mounts import SharedMountError
from gpuhook.kernel import mountinfo, paths

# Filesystems that live in kernel memory and always answer: gpuhook may stat an entry that
# is the root of such a mount. Anything else mounted where gpuhook works (a volume: FUSE,
# NFS, another disk) is never asked anything; its filesystem may never answer, and the
# process asking would hang in the kernel where no signal reaches it (docs/security.md).
ALWAYS_ANSWERS = frozenset({"tmpfs", "devtmpfs", "devpts", "proc", "sysfs", "mqueue", "ramfs", "cgroup", "cgroup2"})
DEV = "/dev"
PROC_ROOT_INO = 1  # the root directory of every procfs instance (fs/proc/root.c)


class Target:
    """One container rootfs the worker's steps act on, and how to take them back.

    Writes (mkdir, mknod, files and links, renames) are made only on the rootfs's own mount
    and on the runtime's /dev (`_base`); mounts only where they cannot propagate
    (`refuse_shared`), checked on the very mount they are attached to."""

    def __init__(self, plan, deadline, journal=None):
        self.plan = plan
        self.deadline = deadline
        self.root = -1
        self.changes = rootfs.Changes(journal)
        self.mounts = mounts.Mounts()
        self.notes: list[str] = []
        self.count = 0
        self.sources: dict = {}  # host path -> O_PATH fd, opened in the host's namespace
        self.clones: dict = {}  # container path -> detached clone of its source (new mount API)
        self.local: dict = {}  # host path -> the same file opened in the container's namespace
        self.ldconfig_fd = -1
        self.ldconfig_output = ""
        self.cache = b""  # the ld cache ldconfig built, until ldconfig.install_cache puts it in place
        self.sandbox = None  # the ldconfig sandbox forked ahead (gpuhook.apply.ldconfig.prepare), until used
        self.left: list = []  # processes it had to leave stuck in the kernel (for the log)
        self.mount_lines = None  # {mount id: its line} of this namespace's table, as last read
        self.mount_table = {}  # {mount id: MountEntry} of the lines parsed
        self.dirs: dict = {}  # container dir -> O_PATH fd, resolved (or made) once
        self.dir_mounts: dict = {}  # fd in self.dirs -> the id of its mount
        self.unshared: set = set()  # mount ids known not to propagate
        self._root_mount = None
        self.dev = None  # O_PATH fd of the runtime's /dev once looked at (-1: /dev is no mount of its own)

    @property
    def root_mount(self) -> int:
        if self._root_mount is None:
            self._root_mount = mountinfo.mount_id(self.root)
        return self._root_mount

    def mount_entry(self, mount: int):
        """The mount table's line for mount `mount` in this namespace (read again once when
        the cached table does not have it); None when it is not there. Only the lines asked
        for are parsed: before its pivot the container's namespace holds every mount of the
        host (`mountinfo.index`)."""
        if self.mount_lines is None or mount not in self.mount_lines:
            self.mount_lines = mountinfo.index(mountinfo.read_bytes())
            self.mount_table = {}
        entry = self.mount_table.get(mount)
        if entry is None and mount in self.mount_lines:
            try:
                entry = self.mount_table[mount] = mountinfo.MountEntry(self.mount_lines[mount])
            except (ValueError, IndexError):  # no entry (`mountinfo.parse` skips it too)
                return None
        return entry

    def _base(self, path: str) -> tuple:
        """(directory fd, path below it, beneath, its container path) to write `path` under:
        the runtime's /dev for a path in /dev when the runtime mounted one, else the rootfs.
        Resolution from there never leaves that mount (rootfs.make_dirs)."""
        parts = path.split("/")
        if len(parts) > 1 and parts[1] == "dev":
            dev = self.runtime_dev()
            if dev >= 0:
                return dev, "/" + "/".join(parts[2:]), True, DEV
        return self.root, path, False, ""

    def runtime_dev(self) -> int:
        """fd of the container's /dev when it is the runtime's own: the spec mounts a fresh
        tmpfs there (Plan.dev_tmpfs) and there is a tmpfs mounted on the rootfs's /dev.
        -1 when /dev is no mount of its own (then it is part of the rootfs) or not the
        runtime's (a volume bound there: nothing is written into it)."""
        if self.dev is None:
            self.dev = -1
            try:
                fd = paths.open_in_root(self.root, DEV, os.O_PATH | os.O_DIRECTORY, follow_final=False)
            except OSError:
                return -1
            mount = mountinfo.mount_id(fd)
            entry = self.mount_entry(mount) if mount != self.root_mount else None
            if entry is not None and self.plan.dev_tmpfs and entry.fstype == "tmpfs" and \
                    entry.parent == self.root_mount:
                self.dev = fd
            else:
                os.close(fd)
        return self.dev

    def parent(self, path: str) -> tuple:
        """(fd of `path`'s directory, made if missing and then kept open, file name). The
        directory is on the rootfs's mount or the runtime's /dev (OtherMountError else)."""
        parent_path, name = paths.split(path)
        fd = self.dirs.get(parent_path)
        if fd is None:
            base, below, beneath, at = self._base(parent_path)
            fd = self.dirs[parent_path] = rootfs.make_dirs(base, below, self.changes, beneath=beneath, at=at)
            self.dir_mounts[fd] = mountinfo.mount_id(fd)
        return fd, name

    def existing(self, parent: int, name: str, path: str, same_fs=None) -> tuple:
        """(O_PATH fd, lstat, mount id) of the entry `name` that is already in `parent`.
        When it is the root of another mount, that mount's filesystem is asked nothing
        unless it is one that always answers (ALWAYS_ANSWERS) or the filesystem `same_fs`
        (a device number: the host source's own) is; otherwise OtherMountError."""
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            mount = mountinfo.mount_id(fd)
            if mount != self.dir_mounts[parent]:
                entry = self.mount_entry(mount)
                if entry is None or (entry.fstype not in ALWAYS_ANSWERS and entry.dev != same_fs):
                    raise paths.OtherMountError(errno.EXDEV, "is a mount point of a volume, which gpuhook does "
                                                             "not touch", path)
            return fd, os.fstat(fd), mount
        except BaseException:
            os.close(fd)
            raise

    def refuse_shared(self, mount: int, target_path: str) -> None:
        """Refuse to attach anything to mount `mount` when it is shared: a mount attached to
        it would propagate to its peers, the host's mount table among them (a bidirectional
        volume, or rootfsPropagation "shared"). This is the mount the new one lands on: the
        directory's mount for a new mount point, or the volume itself when the target is the
        root of one (a file bound there by the pod). Every mount gpuhook makes stays in the
        container."""
        if mount in self.unshared:
            return
        found = self.mount_entry(mount)
        if found is None or found.shared:
            raise SharedMountError(errno.EPERM, "is on a shared mount (propagation to other mount namespaces, "
                                                "the host's included); gpuhook mounts nothing there", target_path)
        self.unshared.add(mount)

    def open_sources(self) -> None:
        """Open every host file the plan mounts (and the host's ldconfig) up front, in the
        hook's own mount namespace and with the host's credentials. With the new mount API
        each source is also cloned here as a detached mount (open_tree only clones mounts of
        the caller's namespace); the worker attaches the clones inside the container."""
        wanted = [(m.source, m.kind, m.target) for m in self.plan.mounts]
        wanted += [(n.host_path, "device", n.path) for n in self.plan.nodes if n.host_path]
        for path, kind, target in wanted:
            if path not in self.sources:
                flags = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECTORY if kind == "dir" else 0)
                try:
                    self.sources[path] = os.open(path, flags)
                except OSError as err:
                    raise OSError(err.errno, f"host source {path}: {err.strerror}") from None
            tree = mounts.clone(self.sources[path])
            if tree is not None:
                self.clones[target] = tree
        if self.plan.ldcache is not None:
            path = self.plan.ldcache.ldconfig
            try:
                self.ldconfig_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as err:
                raise OSError(err.errno, f"host ldconfig {path}: {err.strerror}") from None
            if not stat.S_ISREG(os.fstat(self.ldconfig_fd).st_mode):
                raise OSError(errno.EINVAL, f"host ldconfig {path} is not a regular file")
            from gpuhook.apply import ldsandbox

            try:
                ldsandbox.require_static(self.ldconfig_fd, path)
            except ldsandbox.SandboxError as err:
                raise OSError(errno.EINVAL, str(err)) from None
        self.host_proc_dev = os.stat("/proc").st_dev

    def local_source(self, path: str) -> int:
        """The host source `path` as seen in the container's namespace (the old mount API
        binds only mounts of the caller's namespace), checked to be the very file opened
        on the host before setns."""
        fd = self.local.get(path)
        if fd is None:
            host = os.fstat(self.sources[path])
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (host.st_dev, host.st_ino):
                os.close(fd)
                raise OSError(errno.EPERM, f"host source {path} is another file in the container's namespace")
            self.local[path] = fd
        return fd

    def check_rootfs(self) -> None:
        """The rootfs we act on must be the one the runtime set up in this namespace: a mount
        point here (runc and crun bind it onto itself, other runtimes mount an overlay there),
        holding the container's own procfs when the spec mounts one. A rootfs planned from a
        config.json the runtime read differently fails this (docs/security.md)."""
        parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root)
        try:
            if mountinfo.mount_id(parent) == mountinfo.mount_id(self.root):
                raise OSError(errno.EPERM, f"rootfs {self.plan.rootfs} is not mounted in the container's namespace: "
                                           f"it is not the root of the container being created")
        finally:
            os.close(parent)
        if not self.plan.proc_in_rootfs:
            return
        try:
            proc = paths.open_in_root(self.root, "/proc", os.O_PATH | os.O_DIRECTORY, follow_final=False)
        except OSError:
            proc = -1
        try:
            ok = proc >= 0 and os.fstat(proc).st_ino == PROC_ROOT_INO and \
                mountinfo.mount_id(proc) != mountinfo.mount_id(self.root)
        finally:
            if proc >= 0:
                os.close(proc)
        if not ok:
            raise OSError(errno.EPERM, f"rootfs {self.plan.rootfs} has no procfs at /proc in the container's "
                                       f"namespace: it is not the root of the container being created")

    def close_sources(self) -> None:
        if self.sandbox is not None:  # forked ahead, not used: the start failed before its ld cache
            self.left += self.sandbox.end()
            self.sandbox = None
        for fd in [*self.sources.values(), *self.dirs.values(), *self.clones.values(), *self.local.values()]:
            os.close(fd)
        self.sources.clear()
        self.dirs.clear()
        self.dir_mounts.clear()
        self.clones.clear()
        self.local.clear()
        if self.ldconfig_fd >= 0:
            os.close(self.ldconfig_fd)
            self.ldconfig_fd = -1
        if self.dev is not None and self.dev >= 0:
            os.close(self.dev)
        self.dev = None

    def keep(self) -> None:
        """The hook committed: keep every change, close what is open."""
        self.changes.forget()
        self.mounts.forget()
        self.close_sources()

    def undo(self) -> list[str]:
        """Take back every step: the mounts, then the files, links and directories, newest
        first. Returns what could not be taken back; never raises."""
        problems = self.mounts.undo(self.root)
        problems += self.changes.undo()
        self.close_sources()
        return problems
