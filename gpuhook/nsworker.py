"""The namespace worker: what gpuhook does inside the container's mount namespace.

gpuhook.workerproc forks a child that runs `serve` here: it waits for its work order (the
part of the plan it carries out), opens the host's sources, joins the container's mount
namespace (and user namespace), checks it is the right one, then makes the device nodes,
bind mounts, symlinks, the /proc/driver/nvidia mask and the ld cache update, each container
path resolved inside the rootfs (gpuhook.safepath). It names each step as it starts in
shared memory and reports once through a pipe; any failure undoes everything it did, newest
first. After an ok report it keeps its work only when the parent commits (the parent's
cgroup grant ran meanwhile and may have failed); otherwise it undoes it too.
"""

import errno
import os
import stat
import time

from gpuhook import fastjson, linux, mountinfo, safepath, workerproc
from gpuhook.actions import ProcMask, decode_order

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


def _set_progress(progress, step: str) -> None:
    data = step.encode("utf-8", "replace")[: workerproc.PROGRESS_BYTES - 2]
    progress[0:2 + len(data)] = len(data).to_bytes(2, "little") + data


def serve(orders: int, out: int, progress, parent: int) -> int:
    """The forked worker's life (gpuhook.workerproc.start): wait for the order on `orders`,
    carry it out, report on `out`, then commit or undo as `orders` says. Returns the exit
    code; never raises."""
    try:
        linux.prctl_set_pdeathsig(linux.SIGKILL)
        if os.getppid() != parent:  # the hook ended before the line above: nobody to serve
            return 0
        size = _read_exactly(orders, 8)
        if len(size) < 8:
            return 0  # the start needed no worker
        data = _read_exactly(orders, min(int.from_bytes(size, "little"), workerproc.ORDER_LIMIT))
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


def _read_exactly(fd: int, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _send(out: int, message: dict) -> None:
    workerproc.write_all(out, (fastjson.dumps(message) + "\n").encode())


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
    work = _Work(plan, deadline)
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
            _set_progress(progress, step)
            if time.monotonic() > deadline:
                raise TimeoutError("deadline passed")
            action()
        step = "wait for the hook's commit"
        _set_progress(progress, step)
        _send(out, {"ok": True, "notes": work.notes, "steps": work.count, "ldconfig_output": work.ldconfig_output})
    except BaseException as err:  # noqa: BLE001 - the worker reports everything
        problems = work.undo()
        message = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        if isinstance(err, OSError) and err.filename:
            message = f"{err.filename}: {message}"
        _send_quietly(out, {"ok": False, "step": step, "error": message or type(err).__name__, "cleanup": problems,
                            "ldconfig_output": work.ldconfig_output})
        return 1
    try:
        decision = os.read(decisions, 1)
    except OSError:
        decision = b""
    if decision == workerproc.COMMIT:
        work.changes.forget()
        work.forget_mounts()
        work.close_sources()
        return 0
    # ABORT (the parent's half of the start failed) or the parent is gone: take it all back.
    _send_quietly(out, {"undone": work.undo()})
    return 0


class _Work:
    """The worker's steps over one container rootfs, and how to take them back."""

    def __init__(self, plan, deadline):
        self.plan = plan
        self.deadline = deadline
        self.root = -1
        self.changes = safepath.Changes()
        self.mounted: list = []  # (container path, fd of the mount or -1), in the order made
        self.notes: list[str] = []
        self.count = 0
        self.sources: dict = {}  # host path -> O_PATH fd, opened in the host's namespace
        self.clones: dict = {}  # container path -> detached clone of its source (new mount API)
        self.local: dict = {}  # host path -> the same file opened in the container's namespace
        self.ldconfig_fd = -1
        self.ldconfig_output = ""
        self.mount_table = None
        self.dirs: dict = {}  # container dir -> O_PATH fd, resolved (or made) once
        self.unshared_dirs: set = set()  # fds in self.dirs whose mount is known not to be shared

    def parent(self, path: str) -> tuple:
        """(fd of `path`'s directory, made if missing and then kept open, file name)."""
        parent_path, name = safepath.split(path)
        fd = self.dirs.get(parent_path)
        if fd is None:
            fd = self.dirs[parent_path] = safepath.make_dirs(self.root, parent_path, self.changes)
        return fd, name

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
            from gpuhook import ldsandbox

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
            proc = safepath.open_in_root(self.root, "/proc", os.O_PATH | os.O_DIRECTORY, follow_final=False)
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
        self.clones.clear()
        self.local.clear()
        if self.ldconfig_fd >= 0:
            os.close(self.ldconfig_fd)
            self.ldconfig_fd = -1

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

    def node(self, node) -> None:
        if node.host_path:
            self.bind_device(node)
            return
        parent, name = self.parent(node.path)
        want = os.makedev(node.major, node.minor)
        try:
            os.mknod(name, stat.S_IFCHR | node.mode, want, dir_fd=parent)
        except FileExistsError:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
                return  # already there (the hook ran before, or the spec made it)
            numbers = f" {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else ""
            raise OSError(17, f"exists and is {safepath.kind_of(st.st_mode)}{numbers}", node.path) from None
        self.changes.add("file", parent, name)
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
        src_st = os.fstat(self.sources[mount.source])
        if mount.kind == "file" and not stat.S_ISREG(src_st.st_mode):
            raise OSError(errno.EINVAL, f"host source {mount.source} is {safepath.kind_of(src_st.st_mode)}")
        self._bind(mount.source, src_st, mount.target, mount.kind, mount.options)

    def _bind(self, source: str, src_st, target_path: str, kind: str, options) -> None:
        """Bind the host file `source` (opened as self.sources[source]) at `target_path` in
        the rootfs with `options`."""
        parent, name = self.parent(target_path)
        if parent not in self.unshared_dirs:  # one check per directory (its fd stays open)
            self.refuse_shared(parent, target_path)
            self.unshared_dirs.add(parent)
        target = self._new_mount_point(parent, name, kind)
        if target is None:  # something is there already: ours from an earlier run, or in the way
            if self._already_mounted(target_path, src_st):
                return
            ensure = safepath.ensure_dir if kind == "dir" else safepath.ensure_file
            target = ensure(self.root, target_path, self.changes, parent_fd=parent)
        try:
            if not self._attach(target, target_path, options):
                self._bind_and_remount(self.local_source(source), src_st, target, target_path, options)
        finally:
            os.close(target)
        self.count += 1

    def refuse_shared(self, parent: int, target_path: str) -> None:
        """Refuse to mount into a directory whose mount is shared: a mount made there would
        propagate to its peers, the host's mount table among them (a bidirectional volume,
        or rootfsPropagation "shared"). Every mount gpuhook makes stays in the container."""
        mount = mountinfo.mount_id(parent)
        if self.mount_table is None:
            self.mount_table = {m.id: m for m in mountinfo.read()}
        found = self.mount_table.get(mount)
        if found is not None and found.shared:
            raise OSError(errno.EPERM, f"{target_path} is on a shared mount (propagation to other mount "
                                       f"namespaces, the host's included); gpuhook mounts nothing there")

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
                raise
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
        now = safepath.open_in_root(self.root, target_path, os.O_PATH, follow_final=False)
        try:
            st = os.fstat(now)
            if (st.st_dev, st.st_ino) != (src_st.st_dev, src_st.st_ino):
                raise OSError(errno.EBUSY, "changed under us while mounting", target_path)
            linux.mount(None, linux.fd_path(now), None, linux.MS_PRIVATE)
            linux.mount(None, linux.fd_path(now), None, linux.MS_BIND | linux.MS_REMOUNT | _flags(options))
        finally:
            os.close(now)

    def _new_mount_point(self, parent: int, name: str, kind: str):
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
        self.changes.add("dir" if kind == "dir" else "file", parent, name)
        return fd

    def _already_mounted(self, target: str, src_st) -> bool:
        try:
            fd = safepath.open_in_root(self.root, target, os.O_PATH, follow_final=False)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            return (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino)
        finally:
            os.close(fd)

    def symlink(self, link) -> None:
        parent, name = self.parent(link.path)
        try:
            os.symlink(link.target, name, dir_fd=parent)
            self.changes.add("file", parent, name)
        except FileExistsError:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode):
                raise OSError(17, f"exists and is {safepath.kind_of(st.st_mode)}", link.path) from None
            old = os.readlink(name, dir_fd=parent)
            if old == link.target:
                return
            # The image has its own link by that name (a stub or an older driver's): point
            # it at the host driver, atomically, and remember the old target.
            temp = f".{name}.gpuhook"
            os.symlink(link.target, temp, dir_fd=parent)
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            self.changes.add_relink(parent, name, old)
        self.count += 1

    def mask_proc(self, files: dict) -> None:
        try:
            target = safepath.open_in_root(self.root, ProcMask.target, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            self.notes.append(f"container /proc has no driver/nvidia (no NVIDIA kernel module, e.g. a "
                              f"simulated host): {ProcMask.target} not masked")
            return
        gpu_fds = []
        try:
            for bus in self.plan.proc_mask.gpu_buses:
                gpu_fds.append((bus, safepath.open_in_root(
                    self.root, f"{ProcMask.target}/gpus/{bus}", os.O_PATH | os.O_DIRECTORY)))
            self.refuse_shared(target, ProcMask.target)
            linux.mount("tmpfs", linux.fd_path(target), "tmpfs",
                        linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, "mode=0555,size=1m")
            self.mounted.append((ProcMask.target, -1))
            top = safepath.open_in_root(self.root, ProcMask.target, os.O_RDONLY | os.O_DIRECTORY)
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
        dest = safepath.open_in_root(self.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
        try:
            linux.mount(linux.fd_path(source), linux.fd_path(dest), None, linux.MS_BIND)
        finally:
            os.close(dest)
        now = safepath.open_in_root(self.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
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
        read-only copy of the rootfs (gpuhook.ldsandbox); the cache is installed here, by
        the /etc directory fd. Its output goes to gpuhook's log only: it can echo file
        contents, which the container's user must not see in the start error."""
        from gpuhook import ldsandbox

        etc = safepath.make_dirs(self.root, "/etc", self.changes)
        try:
            try:
                cache, self.ldconfig_output = ldsandbox.build_cache(
                    self.plan.rootfs, self.root, self.ldconfig_fd, self.plan.ldcache.directories, self.deadline,
                    use_new_mount_api)
            except ldsandbox.SandboxError as err:
                self.ldconfig_output = err.output
                raise OSError(errno.EIO, str(err)) from None
            # The image's own cache is set aside, not overwritten: the start can still be
            # undone after this last step (the parent's grant may fail meanwhile).
            self.changes.add_replaced(etc, "ld.so.cache", safepath.set_aside(etc, "ld.so.cache"))
            safepath.replace_file(etc, "ld.so.cache", cache)
        finally:
            os.close(etc)
        self.count += 1

    def undo(self) -> list[str]:
        problems = []
        for target, fd in reversed(self.mounted):
            try:
                if fd >= 0:  # the mount itself, even if something moved it since
                    linux.umount2(linux.fd_path(fd), linux.MNT_DETACH)
                else:
                    found = safepath.open_in_root(self.root, target, os.O_PATH, follow_final=False)
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
