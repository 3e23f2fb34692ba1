"""The namespace worker: what gpuhook does inside the container's mount namespace.

gpuhook.apply.worker forks a child that runs `serve` here: it waits for its work order (the
part of the plan it carries out, gpuhook.apply.order), opens the host's sources, joins the
container's mount namespace (and user namespace), checks it is the right one, then takes its
steps (`steps`), each in its own module and each recording its undo as it goes:

- device nodes and soname links: gpuhook.apply.nodes;
- bind mounts of the driver's files: gpuhook.apply.mounts;
- the /proc/driver/nvidia mask: gpuhook.apply.procmask;
- the ld cache update: gpuhook.apply.ldconfig.

Every step acts through a gpuhook.apply.target.Target (the rootfs, the runtime's /dev, the
host sources, the two undo journals), each container path resolved inside the rootfs
(gpuhook.kernel.paths). The worker names each step as it starts in shared memory and reports
once through a pipe; any failure undoes everything it did, newest first. After an ok report
it keeps its work only when the parent commits (the parent's cgroup grant ran meanwhile and
may have failed); otherwise it undoes it too.
"""

import errno
import os
import select
import time

from gpuhook import fastjson
from gpuhook.apply import mounts, nodes, procmask
from gpuhook.apply.order import (COMMIT, COMMIT_WAIT, ORDER_LIMIT, Journal, decode_order, read_exactly, set_progress,
                                 write_all)
from gpuhook.apply.target import Target
from gpuhook.kernel import linux
from gpuhook.plan.records import ProcMask


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
    work = Target(plan, deadline, Journal(progress))
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
        if plan.ldcache is not None:
            from gpuhook.apply import ldconfig

            ldconfig.prepare(work)  # its sandbox sets itself up while the steps below run
        for step, action in steps(work, proc_files):
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
        work.keep()
        return 0
    # ABORT (the parent's half of the start failed) or the parent is gone: take it all back.
    _send_quietly(out, {"undone": work.undo()})
    return 0


def steps(target: Target, proc_files: dict):
    """(name, action) of each step the plan asks for, in order: the name is what the worker
    reports (and the hook shows at a deadline), the action carries it out on `target`."""
    plan = target.plan
    for node in plan.nodes:
        yield f"device node {node.path}", lambda n=node: nodes.make_node(target, n)
    for mount in plan.mounts:
        yield f"mount {mount.target}", lambda m=mount: mounts.bind(target, m)
    for link in plan.symlinks:
        yield f"symlink {link.path}", lambda s=link: nodes.make_symlink(target, s)
    if plan.proc_mask is not None:
        yield f"mask {ProcMask.target}", lambda: procmask.mask_proc(target, proc_files)
    if plan.ldcache is not None:
        from gpuhook.apply import ldconfig  # the sandbox's modules only for an image with an ld cache

        yield "ldconfig", lambda: ldconfig.build_cache(target)
        yield f"install {ldconfig.LD_CACHE}", lambda: ldconfig.install_cache(target)


def describe(err: BaseException) -> str:
    """An error as the start's message shows it: the container path it is about (never a
    host path the image steered to), then why."""
    if isinstance(err, OSError) and (err.strerror or err.errno):
        message = err.strerror or os.strerror(err.errno)
        return f"{err.filename}: {message}" if err.filename else message
    return str(err) or type(err).__name__
