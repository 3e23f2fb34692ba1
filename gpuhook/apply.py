"""The only layer that changes anything: turn a Plan into system calls.

Order, and why:

1. cgroup: allow the devices (host side). runc has applied its own rules before prestart
   hooks run, so we add ours on top and remember what we added.
2. In a forked worker that joins the container's mount namespace (the container's /dev
   tmpfs and its /proc exist only there, docs/reference section 1): device nodes, bind
   mounts (read-only, nosuid, nodev), soname symlinks, the /proc/driver/nvidia mask, and the
   HOST's ldconfig against the rootfs. Every container path is resolved inside the rootfs
   (gpuhook.safepath) and mounted through /proc/self/fd, so what was checked is what gets
   mounted.

Any failure undoes what was done, newest first: mounts, then created files, symlinks and
directories, then our cgroup rules, and the error names the step. The worker reports each
step as it starts, so a deadline names the step that was cut off.
"""

import errno
import os
import stat
import time

from gpuhook import fastjson, linux, mountinfo, safepath
from gpuhook.cgroup import hierarchy
from gpuhook.errors import ApplyError, DeadlineError, GpuhookError, HostError, InputError
from gpuhook.plan import ProcMask

_MS = {"ro": linux.MS_RDONLY, "nosuid": linux.MS_NOSUID, "nodev": linux.MS_NODEV, "noexec": linux.MS_NOEXEC}
_MOUNT_ATTR = {"ro": linux.MOUNT_ATTR_RDONLY, "nosuid": linux.MOUNT_ATTR_NOSUID, "nodev": linux.MOUNT_ATTR_NODEV,
               "noexec": linux.MOUNT_ATTR_NOEXEC}
# open_tree/mount_setattr/move_mount (Linux 5.12+): a bind mount gets its read-only and
# nosuid flags before it is attached, and stays reachable by fd for undo. Older kernels fall
# back to mount(MS_BIND) + remount. Switched off once ENOSYS is seen, or by tests.
use_new_mount_api = True
# The worker's own deadline is this much shorter than the hook's, so it can clean up itself.
CLEANUP_MARGIN = 1.0
PROGRESS_BYTES = 4096
PROC_ROOT_INO = 1  # the root directory of every procfs instance (fs/proc/root.c)


class Outcome:
    def __init__(self, cgroup_mode: str, rules_added: list, notes: list, steps: int, ldconfig_output: str = "",
                 cgroup_directory: str = ""):
        self.cgroup_mode = cgroup_mode
        self.cgroup_directory = cgroup_directory
        self.rules_added = rules_added
        self.notes = notes
        self.steps = steps
        self.ldconfig_output = ldconfig_output  # for gpuhook's log only


def _flags(options) -> int:
    flags = 0
    for option in options:
        flags |= _MS[option]
    return flags


def _open_namespace(pid: int, kind: str, what: str):
    """(fd of process `pid`'s namespace `kind`, whether the hook shares it)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HostError(f"container process {pid} is gone") from None
    except OSError as err:
        raise HostError(f"cannot open the {what} namespace of process {pid}: {err.strerror}") from err
    return fd, os.fstat(fd).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino


def open_container_mntns(pid: int) -> int:
    """fd of the container's mount namespace; refuses the hook's own namespace."""
    fd, shared = _open_namespace(pid, "mnt", "mount")
    if shared:
        os.close(fd)
        raise HostError(f"process {pid} shares the hook's mount namespace: it is not a container being created")
    return fd


def open_container_userns(pid: int):
    """fd of the container's user namespace, or None when it shares the hook's."""
    fd, shared = _open_namespace(pid, "user", "user")
    if shared:
        os.close(fd)
        return None
    return fd


def read_proc_files(mask: ProcMask) -> dict:
    """Contents for the masked /proc/driver/nvidia, read on the host side."""
    files = {}
    for name in ("params", "version", "registry"):
        try:
            with open(f"{mask.source_dir}/{name}", "rb") as f:
                data = f.read(1 << 20)
        except FileNotFoundError:
            continue
        except OSError as err:
            raise HostError(f"cannot read {mask.source_dir}/{name}: {err.strerror}") from err
        if name == "params":
            data = _no_device_files(data)
        files[name] = data.decode("utf-8", "surrogateescape")
    for name in mask.capabilities:
        path = f"{mask.source_dir}/capabilities/{name}"
        try:
            with open(path, "rb") as f:
                files[f"capabilities/{name}"] = f.read(1 << 16).decode("utf-8", "surrogateescape")
        except OSError as err:
            raise HostError(f"cannot read {path}: {err.strerror}") from err
    return files


def _no_device_files(params: bytes) -> bytes:
    lines = [b"ModifyDeviceFiles: 0" if line.startswith(b"ModifyDeviceFiles:") else line
             for line in params.splitlines()]
    if not any(line.startswith(b"ModifyDeviceFiles:") for line in lines):
        lines.append(b"ModifyDeviceFiles: 0")
    return b"\n".join(lines) + b"\n"


def run(plan, state, config, deadline: float, record: dict) -> Outcome:
    """Carry out the whole plan: the health step (check and repair the GPUs before the
    container gets them), the container's devices and files (`apply`), then what poststop
    needs: the cgroup v1 grant record (gpuhook.grants) and the health registry entry.
    `record` (the hook's log record) receives the decisions."""
    health = None
    if plan.health is not None:
        # Only now, and only for GPUs: with health off nothing of NVML, threads or
        # gpuhook.health is imported.
        from gpuhook.health import hooks as health

        health.before_start(plan, state, config, deadline, record)
    outcome = apply(plan, deadline)
    if outcome.cgroup_mode == hierarchy.V1 and plan.rules:
        _record_grant(plan, state, config, outcome, record)
    if health is not None:
        health.register_container(plan, state, config, record)
    return outcome


def _record_grant(plan, state, config, outcome, record: dict) -> None:
    """Remember a cgroup v1 grant, so poststop can take it back from a cgroup that outlives
    the container (gpuhook.grants). Best effort, like the health registry: the log says
    when it failed."""
    from gpuhook import grants

    try:
        grants.record(config.state_dir, state.id, plan.pid, outcome.cgroup_directory, plan.rules,
                      outcome.rules_added)
    except (OSError, LookupError) as err:
        record["grant_record"] = f"not recorded: {err}"


def apply(plan, deadline: float) -> Outcome:
    """Carry out `plan` on the running container; raises ApplyError/DeadlineError after undoing."""
    if plan.empty:
        return Outcome("", [], [], 0)
    if plan.pid <= 0:
        raise InputError("state: no container pid; gpuhook runs as a prestart or createRuntime hook")
    ns_fd = open_container_mntns(plan.pid)
    user_fd = None
    try:
        user_fd = open_container_userns(plan.pid) if plan.userns else None
        proc_files = read_proc_files(plan.proc_mask) if plan.proc_mask else {}
        place = hierarchy.placement(plan.pid)
        added = _grant(place, plan.rules)
        try:
            report = _run_worker(plan, ns_fd, user_fd, proc_files, deadline)
        except BaseException as err:
            _undo_grant(place, added, err)
            raise
        return Outcome(place.mode, added, report.get("notes", []), report.get("steps", 0),
                       report.get("ldconfig_output", ""), place.directory)
    finally:
        os.close(ns_fd)
        if user_fd is not None:
            os.close(user_fd)


def _grant(place, rules) -> list:
    if place.mode == hierarchy.V1:
        from gpuhook.cgroup import v1

        added = v1.grant(place.directory, rules)
    else:
        from gpuhook.cgroup import v2

        added = v2.grant(place.directory, rules)
    # systemd re-applies a scope's device list on daemon-reload and would drop what it does
    # not know (issue 3); a refusal undoes the grant, so the start fails with nothing half-done.
    # Only a scope can be systemd's (cgroupfs-driver containers never are): skip the import.
    if not place.cgroup_path.rstrip("/").endswith(".scope"):
        return added
    from gpuhook.cgroup import systemd

    try:
        systemd.Systemd().register(place.cgroup_path, rules)
    except BaseException as err:
        _undo_grant(place, added, err)
        raise
    return added


def _undo_grant(place, added, err: BaseException) -> None:
    """Take back a grant while `err` unwinds; a failed undo is added to err's hint."""
    problems = _revoke(place, added)
    if problems and isinstance(err, GpuhookError):
        err.hint = "; ".join(filter(None, [err.hint, "undo: " + "; ".join(problems)]))


def _revoke(place, added) -> list:
    """Take back a grant; returns the problems (it never raises: it runs while unwinding)."""
    if not added:
        return []
    if place.mode == hierarchy.V1:
        from gpuhook.cgroup import v1

        return v1.revoke(place.directory, added)
    from gpuhook.cgroup import v2

    return v2.revoke(place.directory, added)


def _run_worker(plan, ns_fd: int, user_fd, proc_files: dict, deadline: float) -> dict:
    import mmap

    # The worker reports each step it starts through shared memory (no wake-up of this
    # process per step) and its final result, once, through the pipe.
    progress = mmap.mmap(-1, PROGRESS_BYTES)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            code = _worker(plan, ns_fd, user_fd, proc_files, deadline - CLEANUP_MARGIN, write_end, progress)
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        return _collect(pid, read_end, deadline, progress)
    finally:
        progress.close()


def _set_progress(progress, step: str) -> None:
    data = step.encode("utf-8", "replace")[: PROGRESS_BYTES - 2]
    progress[0:2 + len(data)] = len(data).to_bytes(2, "little") + data


def _get_progress(progress) -> str:
    size = int.from_bytes(progress[0:2], "little")
    return progress[2:2 + size].decode("utf-8", "replace") or "starting"


def _collect(pid: int, read_end: int, deadline: float, progress) -> dict:
    import select

    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            data = os.read(read_end, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(read_end)
    final = None
    if chunks:
        try:
            final = fastjson.loads(b"".join(chunks))
        except ValueError:
            final = None
    last_step = _get_progress(progress)
    if final is None:
        try:
            os.kill(pid, linux.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        if time.monotonic() >= deadline:
            raise DeadlineError(f"hook deadline passed during {last_step}")
        raise ApplyError(last_step, "the namespace worker died")
    os.waitpid(pid, 0)
    if not final.get("ok"):
        problems = final.get("cleanup") or []
        hint = ("cleanup: " + "; ".join(problems)) if problems else None
        err = ApplyError(final.get("step", last_step), final.get("error", "failed"), hint)
        err.detail = final.get("ldconfig_output") or None
        raise err
    return final


def _worker(plan, ns_fd: int, user_fd, proc_files: dict, deadline: float, out: int, progress) -> int:
    """Runs in the forked child; returns its exit code. Never raises."""

    def send(message: dict) -> None:
        data = fastjson.dumps(message).encode()
        while data:
            data = data[os.write(out, data):]

    step = "enter mount namespace"
    work = _Work(plan, deadline)
    try:
        linux.prctl_set_pdeathsig(linux.SIGKILL)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # never hold the runtime's pipes
            os.dup2(devnull, fd)
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
        work.changes.forget()
        work.forget_mounts()
        work.close_sources()
        send({"ok": True, "notes": work.notes, "steps": work.count, "ldconfig_output": work.ldconfig_output})
        return 0
    except BaseException as err:  # noqa: BLE001 - the worker reports everything
        problems = work.undo()
        message = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        if isinstance(err, OSError) and err.filename:
            message = f"{err.filename}: {message}"
        try:
            send({"ok": False, "step": step, "error": message or type(err).__name__, "cleanup": problems,
                  "ldconfig_output": work.ldconfig_output})
        except OSError:
            pass
        return 1


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
        self.shared_checked: set = set()  # mount ids known not to be shared
        self.mount_table = None
        self.dirs: dict = {}  # container dir -> O_PATH fd, resolved (or made) once

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
        self.refuse_shared(parent, target_path)
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
        if mount in self.shared_checked:
            return
        if self.mount_table is None:
            self.mount_table = {m.id: m for m in mountinfo.read()}
        found = self.mount_table.get(mount)
        if found is not None and found.shared:
            raise OSError(errno.EPERM, f"{target_path} is on a shared mount (propagation to other mount "
                                       f"namespaces, the host's included); gpuhook mounts nothing there")
        self.shared_checked.add(mount)

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
