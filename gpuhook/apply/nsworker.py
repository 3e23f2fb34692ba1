"""The namespace worker: what gpuhook does inside the container's mount namespace.

gpuhook.apply.worker forks a child that runs `serve` here: it waits for its work order (the
part of the plan it carries out), opens the host's sources, joins the container's mount
namespace (and user namespace), checks it is the right one, then makes the device nodes,
bind mounts, symlinks, the /proc/driver/nvidia mask and the ld cache update, each container
path resolved inside the rootfs (gpuhook.kernel.paths). It names each step as it starts in
shared memory and reports once through a pipe; any failure undoes everything it did, newest
first. After an ok report it keeps its work only when the parent commits (the parent's
cgroup grant ran meanwhile and may have failed); otherwise it undoes it too.
"""

import errno
import os
import select
import stat
import time

from gpuhook import fastjson
from gpuhook.apply import rootfs
from gpuhook.kernel import paths
from gpuhook.apply.order import (COMMIT, COMMIT_WAIT, ORDER_LIMIT, Journal, decode_order, read_exactly, set_progress,
                                 write_all)
from gpuhook.kernel import linux, mountinfo
from gpuhook.plan.records import ProcMask

_MS = {"ro": linux.MS_RDONLY, "nosuid": linux.MS_NOSUID, "nodev": linux.MS_NODEV, "noexec": linux.MS_NOEXEC}
_MOUNT_ATTR = {"ro": linux.MOUNT_ATTR_RDONLY, "nosuid": linux.MOUNT_ATTR_NOSUID, "nodev": linux.MOUNT_ATTR_NODEV,
               "noexec": linux.MOUNT_ATTR_NOEXEC}
# open_tree/mount_setattr/move_mount (Linux 5.12+): a bind mount gets its read-only and
# nosuid flags before it is attached, and stays reachable by fd for undo. Older kernels fall
# back to mount(MS_BIND) + remount. Switched off once ENOSYS is seen, or by tests.
use_new_mount_api = True
PROC_ROOT_INO = 1  # the root directory of every procfs instance (fs/proc/root.c)


def _flags(options) -> int:
    flags = 0
    for option in options:
        flags |= _MS[option]
    return flags


def serve(orders: int, out: int, progress, parent: int) -> int:
    """The forked worker's life (gpuhook.apply.worker.start): wait for the order on `orders`,
    carry it out, report on `out`, then commit or undo as `orders` says. Returns the exit
    code; never raises."""
    try:
        linux.prctl_set_pdeathsig(linux.SIGKILL)
        if os.getppid() != parent:  # the hook ended before the line above: nobody to serve
            return 0
        size = read_exactly(orders, 8)
        if len(size) < 8:
            return 0  # the start needed no worker
        data = read_exactly(orders, min(int.from_bytes(size, "little"), ORDER_LIMIT))
        order, mntns, userns, proc_files, deadline = decode_order(data)
    except BaseException as err:  # noqa: BLE001 - nothing done yet: say why and end
        _send_quietly(out, {"ok": False, "step": "read the work order", "error": f"{type(err).__name__}: {err}"})
        return 1
    ns_fd = user_fd = -1
    try:
        try:
            ns_fd = _open_same_namespace(order.pid, "mnt", mntns)
            if userns is not None:
                user_fd = _open_same_namespace(order.pid, "user", userns)
        except OSError as err:
            _send_quietly(out, {"ok": False, "step": "enter mount namespace", "error": err.strerror or str(err)})
            return 1
        return run(order, ns_fd, None if user_fd < 0 else user_fd, proc_files, deadline, out, progress, orders)
    finally:
        for fd in (ns_fd, user_fd):
            if fd >= 0:
                os.close(fd)


def _open_same_namespace(pid: int, kind: str, expected) -> int:
    """fd of process `pid`'s namespace `kind`, which must be the one the parent opened and
    checked (the pid could name another process by now)."""
    fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if [st.st_dev, st.st_ino] != list(expected):
        os.close(fd)
        raise OSError(errno.ESRCH, f"process {pid} is no longer the container the hook checked")
    return fd


def _send(out: int, message: dict) -> None:
    write_all(out, (fastjson.dumps(message) + "\n").encode())


def _send_quietly(out: int, message: dict) -> None:
    """_send for a message the hook may no longer be there to read."""
    try:
        _send(out, message)
    except OSError:
        pass


def run(plan, ns_fd: int, user_fd, proc_files: dict, deadline: float, out: int, progress, decisions: int) -> int:
    """Carry out `plan` (an Order, or a Plan: the same fields) in the container's mount
    namespace `ns_fd`; report on `out`; after an ok report keep the work only on COMMIT from
    `decisions`. Returns the exit code; never raises."""
    step = "enter mount namespace"
    work = _Work(plan, deadline, Journal(progress))
    try:
        os.umask(0)
        # Host files (and the host's ldconfig) are opened here, in the hook's own mount
        # namespace: after setns a path like /sbin/ldconfig means whatever that namespace has
        # there, which for a process that already pivoted is the image's (docs/security.md).
        step = "open host sources"
        work.open_sources()
        host_root = os.stat("/")
        linux.setns(ns_fd, linux.CLONE_NEWNS)
        os.chdir("/")
        step = "check the container's namespace"
        here = os.stat("/")
        if (here.st_dev, here.st_ino) != (host_root.st_dev, host_root.st_ino):
            raise OSError(errno.EPERM, f"process {plan.pid} has already pivoted into its own root (a stale or "
                                       f"wrong pid): gpuhook acts only on a container being created")
        step = "open rootfs"
        try:
            work.root = os.open(plan.rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise OSError(err.errno, f"rootfs {plan.rootfs} is not a directory in the container's namespace")
        work.check_rootfs()
        if user_fd is not None:
            # Everything from here on runs as the container's root: files it creates belong
            # to the container, and the mount namespace (owned by its user namespace) lets
            # that root mount. Host files were opened above, with the host's credentials.
            step = "enter user namespace"
            linux.setns(user_fd, linux.CLONE_NEWUSER)
            try:
                os.setgroups([])
            except PermissionError:
                pass  # setgroups is denied in this namespace: the group list stays as it is
            os.setresgid(0, 0, 0)
            os.setresuid(0, 0, 0)
        for step, action in work.steps(proc_files):
            set_progress(progress, step)
            if time.monotonic() > deadline:
                raise TimeoutError("deadline passed")
            action()
        step = "wait for the hook's commit"
        set_progress(progress, step)
        _send(out, {"ok": True, "notes": work.notes, "steps": work.count, "ldconfig_output": work.ldconfig_output})
    except BaseException as err:  # noqa: BLE001 - the worker reports everything
        problems = work.undo()
        _send_quietly(out, {"ok": False, "step": step, "error": describe(err), "cleanup": problems,
                            "ldconfig_output": work.ldconfig_output, "left": work.left})
        return 1
    try:
        # The hook commits before its own deadline or not at all (its backstop ends it by
        # then, gpuhook.hook.FINAL_GRACE): a hook that is still alive but cannot act past
        # that (stuck in the kernel) gets no wait without bound either.
        last = deadline + COMMIT_WAIT - time.monotonic()
        decision = os.read(decisions, 1) if select.select([decisions], [], [], max(0.0, last))[0] else b""
    except OSError:
        decision = b""
    if decision == COMMIT:
        work.changes.forget()
        work.forget_mounts()
        work.close_sources()
        return 0
    # ABORT (the parent's half of the start failed) or the parent is gone: take it all back.
    _send_quietly(out, {"undone": work.undo()})
    return 0


# Filesystems that live in kernel memory and always answer: gpuhook may stat an entry that
# is the root of such a mount. Anything else mounted where gpuhook works (a volume: FUSE,
# NFS, another disk) is never asked anything; its filesystem may never answer, and the
# process asking would hang in the kernel where no signal reaches it (docs/security.md).
ALWAYS_ANSWERS = frozenset({"tmpfs", "devtmpfs", "devpts", "proc", "sysfs", "mqueue", "ramfs", "cgroup", "cgroup2"})
OPTIONAL_KINDS = frozenset({"socket", "dir"})  # IPC endpoints: a container works without them
DEV = "/dev"
LD_CACHE = "/etc/ld.so.cache"


class SharedMountError(OSError):
    """A mount would be attached to a mount that propagates (EPERM); `filename` is the
    container path."""


def describe(err: BaseException) -> str:
    """An error as the start's message shows it: the container path it is about (never a
    host path the image steered to), then why."""
    if isinstance(err, OSError) and (err.strerror or err.errno):
        message = err.strerror or os.strerror(err.errno)
        return f"{err.filename}: {message}" if err.filename else message
    return str(err) or type(err).__name__


class _Work:
    """The worker's steps over one container rootfs, and how to take them back.

    Writes (mkdir, mknod, files and links, renames) are made only on the rootfs's own mount
    and on the runtime's /dev (`_base`); mounts only where they cannot propagate
    (`refuse_shared`), checked on the very mount they are attached to."""

    def __init__(self, plan, deadline, journal=None):
        self.plan = plan
        self.deadline = deadline
        self.root = -1
        self.changes = rootfs.Changes(journal)
        self.mounted: list = []  # (container path, fd of the mount or -1), in the order made
        self.notes: list[str] = []
        self.count = 0
        self.sources: dict = {}  # host path -> O_PATH fd, opened in the host's namespace
        self.clones: dict = {}  # container path -> detached clone of its source (new mount API)
        self.local: dict = {}  # host path -> the same file opened in the container's namespace
        self.ldconfig_fd = -1
        self.ldconfig_output = ""
        self.cache = b""  # the ld cache ldconfig built, until install_cache puts it in place
        self.left: list = []  # processes it had to leave stuck in the kernel (for the log)
        self.mount_table = None
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
        the cached table does not have it); None when it is not there."""
        if self.mount_table is None or mount not in self.mount_table:
            self.mount_table = {m.id: m for m in mountinfo.read()}
        return self.mount_table.get(mount)

    def _base(self, path: str) -> tuple:
        """(directory fd, path below it, beneath, its container path) to write `path` under:
        the runtime's /dev for a path in /dev when the runtime mounted one, else the rootfs.
        Resolution from there never leaves that mount (safepath.make_dirs)."""
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

    def open_sources(self) -> None:
        """Open every host file the plan mounts (and the host's ldconfig) up front, in the
        hook's own mount namespace and with the host's credentials. With the new mount API
        each source is also cloned here as a detached mount (open_tree only clones mounts of
        the caller's namespace); the worker attaches the clones inside the container."""
        global use_new_mount_api
        wanted = [(m.source, m.kind, m.target) for m in self.plan.mounts]
        wanted += [(n.host_path, "device", n.path) for n in self.plan.nodes if n.host_path]
        for path, kind, target in wanted:
            if path not in self.sources:
                flags = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECTORY if kind == "dir" else 0)
                try:
                    self.sources[path] = os.open(path, flags)
                except OSError as err:
                    raise OSError(err.errno, f"host source {path}: {err.strerror}") from None
            if use_new_mount_api:
                try:
                    self.clones[target] = linux.open_tree_clone(self.sources[path])
                except OSError as err:
                    if err.errno != errno.ENOSYS:
                        raise
                    use_new_mount_api = False
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

    def steps(self, proc_files):
        plan = self.plan
        for node in plan.nodes:
            yield f"device node {node.path}", lambda n=node: self.node(n)
        for mount in plan.mounts:
            yield f"mount {mount.target}", lambda m=mount: self.bind(m)
        for link in plan.symlinks:
            yield f"symlink {link.path}", lambda s=link: self.symlink(s)
        if plan.proc_mask is not None:
            yield f"mask {ProcMask.target}", lambda: self.mask_proc(proc_files)
        if plan.ldcache is not None:
            yield "ldconfig", self.ldconfig
            yield f"install {LD_CACHE}", self.install_cache

    def node(self, node) -> None:
        if node.host_path:
            self.bind_device(node)
            return
        parent, name = self.parent(node.path)
        want = os.makedev(node.major, node.minor)
        try:
            os.mknod(name, stat.S_IFCHR | node.mode, want, dir_fd=parent)
        except FileExistsError:
            fd, st, _ = self.existing(parent, name, node.path)
            os.close(fd)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
                return  # already there (the hook ran before, or the spec made it)
            numbers = f" {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else ""
            raise OSError(17, f"exists and is {paths.kind_of(st.st_mode)}{numbers}", node.path) from None
        self.changes.add("file", parent, name, node.path)
        os.chown(name, node.uid, node.gid, dir_fd=parent, follow_symlinks=False)
        self.count += 1

    def bind_device(self, node) -> None:
        """The host's node bind-mounted at the container's path (user namespaces)."""
        st = os.fstat(self.sources[node.host_path])
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(node.major, node.minor):
            raise OSError(errno.EINVAL, f"host node {node.host_path} is not the character device "
                                        f"{node.major}:{node.minor}")
        self._bind(node.host_path, st, node.path, "file", ("nosuid", "noexec"))

    def bind(self, mount) -> None:
        """Bind a host file or directory. An IPC endpoint (a socket, the MPS directory) that
        cannot be placed safely (its path leads onto a volume, or it would propagate) is
        left out with a note: the container works without it. Anything else fails the start."""
        src_st = os.fstat(self.sources[mount.source])
        if mount.kind == "file" and not stat.S_ISREG(src_st.st_mode):
            raise OSError(errno.EINVAL, f"host source {mount.source} is {paths.kind_of(src_st.st_mode)}")
        if mount.kind not in OPTIONAL_KINDS:
            self._bind(mount.source, src_st, mount.target, mount.kind, mount.options)
            return
        mark = self.changes.mark()
        try:
            self._bind(mount.source, src_st, mount.target, mount.kind, mount.options)
        except (paths.OtherMountError, SharedMountError) as err:
            problems = self.changes.undo(since=mark)  # the directories made on the way, if any
            self.notes.append(f"{mount.target} not mounted: {err.filename or mount.target} {err.strerror}"
                              + (f" ({'; '.join(problems)})" if problems else ""))

    def _bind(self, source: str, src_st, target_path: str, kind: str, options) -> None:
        """Bind the host file `source` (opened as self.sources[source]) at `target_path` in
        the rootfs with `options`. The target is made on the rootfs's mount (or the runtime's
        /dev); one that is already there may be a mount point, and is then the mount the new
        one is attached to: it must not propagate either (`refuse_shared`)."""
        parent, name = self.parent(target_path)
        target = self._new_mount_point(parent, name, kind, target_path)
        if target is None:  # something is there already: ours from an earlier run, or in the way
            target, st, mount = self.existing(parent, name, target_path, same_fs=src_st.st_dev)
            try:
                if (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino):
                    return  # mounted already (the hook ran before)
                wanted = stat.S_ISDIR if kind == "dir" else stat.S_ISREG
                if not wanted(st.st_mode):
                    raise OSError(errno.EEXIST, f"exists and is {paths.kind_of(st.st_mode)}", target_path)
                self.refuse_shared(mount, target_path)
            except BaseException:
                os.close(target)
                raise
        else:
            self.refuse_shared(self.dir_mounts[parent], target_path)
        try:
            if not self._attach(target, target_path, options):
                self._bind_and_remount(self.local_source(source), src_st, target, target_path, options)
        finally:
            os.close(target)
        self.count += 1

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

    def _attach(self, target: int, target_path: str, options) -> bool:
        """Attach the detached clone of the source made on the host, its flags set and its
        propagation private first, on `target`; False without the new mount API."""
        global use_new_mount_api
        tree = self.clones.pop(target_path, None)
        if tree is None:
            return False
        try:
            attrs = 0
            for option in options:
                attrs |= _MOUNT_ATTR[option]
            linux.mount_setattr(tree, attrs, propagation=linux.MS_PRIVATE)
            linux.move_mount(tree, target)
        except OSError as err:
            if err.errno != errno.ENOSYS:  # open_tree without mount_setattr (5.2-5.11)
                os.close(tree)
                raise OSError(err.errno, os.strerror(err.errno), target_path) from None
            os.close(tree)
            use_new_mount_api = False
            return False
        self.mounted.append((target_path, tree))
        return True

    def _bind_and_remount(self, src: int, src_st, target: int, target_path: str, options) -> None:
        """The classic way: bind, then remount with `options` through a fresh fd of what is
        now at the target, after checking that it is the mount we just made."""
        linux.mount(linux.fd_path(src), linux.fd_path(target), None, linux.MS_BIND)
        self.mounted.append((target_path, -1))
        now = paths.open_in_root(self.root, target_path, os.O_PATH, follow_final=False)
        try:
            st = os.fstat(now)
            if (st.st_dev, st.st_ino) != (src_st.st_dev, src_st.st_ino):
                raise OSError(errno.EBUSY, "changed under us while mounting", target_path)
            linux.mount(None, linux.fd_path(now), None, linux.MS_PRIVATE)
            linux.mount(None, linux.fd_path(now), None, linux.MS_BIND | linux.MS_REMOUNT | _flags(options))
        finally:
            os.close(now)

    def _new_mount_point(self, parent: int, name: str, kind: str, path: str):
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
        self.changes.add("dir" if kind == "dir" else "file", parent, name, path)
        return fd

    def symlink(self, link) -> None:
        parent, name = self.parent(link.path)
        try:
            os.symlink(link.target, name, dir_fd=parent)
            self.changes.add("file", parent, name, link.path)
        except FileExistsError:
            fd, st, _ = self.existing(parent, name, link.path)
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
            self.changes.add_relink(parent, name, old, link.path)
        self.count += 1

    def mask_proc(self, files: dict) -> None:
        try:
            target = paths.open_in_root(self.root, ProcMask.target, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            self.notes.append(f"container /proc has no driver/nvidia (no NVIDIA kernel module, e.g. a "
                              f"simulated host): {ProcMask.target} not masked")
            return
        gpu_fds = []
        try:
            for bus in self.plan.proc_mask.gpu_buses:
                gpu_fds.append((bus, paths.open_in_root(
                    self.root, f"{ProcMask.target}/gpus/{bus}", os.O_PATH | os.O_DIRECTORY)))
            mount = mountinfo.mount_id(target)
            entry = self.mount_entry(mount)
            if mount != self.root_mount and (entry is None or entry.fstype not in ALWAYS_ANSWERS):
                raise paths.OtherMountError(errno.EXDEV, "is on a volume, not the container's procfs",
                                               ProcMask.target)
            self.refuse_shared(mount, ProcMask.target)
            linux.mount("tmpfs", linux.fd_path(target), "tmpfs",
                        linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, "mode=0555,size=1m")
            self.mounted.append((ProcMask.target, -1))
            top = paths.open_in_root(self.root, ProcMask.target, os.O_RDONLY | os.O_DIRECTORY)
            if os.fstat(top).st_dev == os.fstat(target).st_dev:
                os.close(top)
                raise OSError(16, "changed under us while mounting", ProcMask.target)
            self.mounted[-1] = (ProcMask.target, os.dup(top))  # undo by fd, wherever it is by then
            try:
                for name, text in files.items():
                    parts = name.split("/")
                    for depth in range(1, len(parts)):  # capabilities/gpu0/mig/...: a fresh tmpfs
                        try:
                            os.mkdir("/".join(parts[:depth]), 0o555, dir_fd=top)
                        except FileExistsError:
                            pass
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444, dir_fd=top)
                    try:
                        os.write(fd, text.encode("utf-8", "surrogateescape"))
                    finally:
                        os.close(fd)
                if gpu_fds:
                    os.mkdir("gpus", 0o555, dir_fd=top)
                    for bus, fd in gpu_fds:
                        os.mkdir(f"gpus/{bus}", 0o555, dir_fd=top)
                        self._bind_gpu_dir(fd, f"{ProcMask.target}/gpus/{bus}")
                linux.mount(None, linux.fd_path(top), None,
                            linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC,
                            "mode=0555,size=1m")
            finally:
                os.close(top)
            self.count += 1
        finally:
            os.close(target)
            for _, fd in gpu_fds:
                os.close(fd)

    def _bind_gpu_dir(self, source: int, path: str) -> None:
        """The container's own /proc/driver/nvidia/gpus/<bus>, bound into the mask read-only,
        nosuid, nodev, noexec (a bind keeps the source's flags until it is remounted)."""
        dest = paths.open_in_root(self.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
        try:
            linux.mount(linux.fd_path(source), linux.fd_path(dest), None, linux.MS_BIND)
        finally:
            os.close(dest)
        now = paths.open_in_root(self.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
        try:
            src, st = os.fstat(source), os.fstat(now)
            if (st.st_dev, st.st_ino) != (src.st_dev, src.st_ino):
                raise OSError(errno.EBUSY, "changed under us while mounting", path)
            linux.mount(None, linux.fd_path(now), None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY |
                        linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
        finally:
            os.close(now)

    def ldconfig(self) -> None:
        """The host's ldconfig builds the cache in a sandbox that holds nothing but a
        read-only copy of the rootfs and gpuhook's own mounts (gpuhook.apply.ldsandbox); the cache
        is installed by `install_cache`. Its output goes to gpuhook's log only: it can echo
        file contents, which the container's user must not see in the start error."""
        from gpuhook.apply import ldsandbox

        self.parent(LD_CACHE)  # /etc is made (or found) on the rootfs first: an error names it now
        # The sandbox keeps the driver's files gpuhook bound in (libraries, binaries,
        # firmware) and no other mount: not the IPC endpoints, not the device binds. They
        # are named by mount point, as /proc/self/mountinfo shows it: the path of the
        # directory fd the worker resolved, and the file name. (Whatever else sits at such
        # a point lies below gpuhook's mount and is hidden by it.)
        own = set()
        for mount in self.plan.mounts:
            fd = self.dirs.get(paths.split(mount.target)[0]) if mount.kind == "file" else None
            if fd is not None:
                own.add(os.readlink(linux.fd_path(fd)).rstrip("/") + "/" + paths.split(mount.target)[1])
        try:
            self.cache, self.ldconfig_output = ldsandbox.build_cache(
                self.plan.rootfs, self.root, self.ldconfig_fd, self.plan.ldcache.directories, self.deadline,
                use_new_mount_api, own)
        except ldsandbox.SandboxError as err:
            self.ldconfig_output = err.output
            self.left += err.left
            raise OSError(errno.EIO, str(err)) from None

    def install_cache(self) -> None:
        """Put the cache `ldconfig` built in place, by the /etc directory fd. The image's own
        cache is set aside, not overwritten: the start can still be undone after this last
        step (the parent's grant may fail meanwhile). Each is registered for undo only once
        it has happened."""
        etc, name = self.parent(LD_CACHE)
        backup = rootfs.set_aside(etc, name, LD_CACHE)
        try:
            rootfs.replace_file(etc, name, self.cache)
        except OSError as err:
            if backup:
                try:
                    os.rename(backup, name, src_dir_fd=etc, dst_dir_fd=etc)
                except OSError:
                    self.changes.add_replaced(etc, name, backup, LD_CACHE)  # undo tries again, and says so
            raise OSError(err.errno, err.strerror, LD_CACHE) from None
        self.changes.add_replaced(etc, name, backup, LD_CACHE)
        self.count += 1

    def undo(self) -> list[str]:
        problems = []
        for target, fd in reversed(self.mounted):
            try:
                if fd >= 0:  # the mount itself, even if something moved it since
                    linux.umount2(linux.fd_path(fd), linux.MNT_DETACH)
                else:
                    found = paths.open_in_root(self.root, target, os.O_PATH, follow_final=False)
                    try:
                        linux.umount2(linux.fd_path(found), linux.MNT_DETACH)
                    finally:
                        os.close(found)
            except OSError as err:
                problems.append(f"cannot unmount {target}: {err.strerror}")
        self.forget_mounts()
        problems += self.changes.undo()
        self.close_sources()
        return problems

    def forget_mounts(self) -> None:
        for _, fd in self.mounted:
            if fd >= 0:
                os.close(fd)
        self.mounted.clear()
