"""Build a container's ld.so.cache with the host's ldconfig, where nothing but the rootfs exists.

The host's ldconfig is trusted code running on hostile data: the image's ld.so.conf, its
library directories and whatever links it planted. Run plainly (`ldconfig -r ROOTFS`), it
runs chrooted as full root, and a chroot does not contain magic links: before pivot_root the
container's /proc/1/root is the runtime's init, whose root is the host's `/`. An image could
then make ldconfig write its aux cache or ld.so.cache into any host directory, read host files
and echo them in its warnings, or read /dev/zero until the host runs out of memory
(docs/ldconfig.md has the whole list and how the vendor's tools handle it).

So ldconfig runs here in a sandbox where those paths do not exist, rather than in one where
they are forbidden:

1. a process forked as pid 1 of a new PID namespace, which takes new network, IPC and UTS
   namespaces at once (the worker forks it before it makes its mounts: `prepare`), then,
   once the worker's mounts are made, a new mount namespace, everything private (nothing
   propagates in or out), and at the end becomes ldconfig: ldconfig is pid 1 of its own PID namespace
   (it sees no other process to signal or trace), has only a loopback that is down (no host
   abstract UNIX socket, no network) and no SysV IPC object or POSIX queue of the host;
2. a read-only, nosuid, nodev, noexec copy of the rootfs holding gpuhook's own mounts (the
   driver's files) and nothing else: every other submount (procfs, sysfs, the runtime's /dev,
   the pod's volumes, which may be filesystems that never answer) is detached, and an empty
   tmpfs (size-limited) is mounted for the one file ldconfig may write;
3. pivot_root into that copy, the old root detached: the host's tree is no longer in the
   namespace, and there is no procfs to leave it by; both are verified from the mount table
   before ldconfig starts;
4. ldconfig itself (opened by the hook on the host before it joined any namespace, executed by
   fd, statically linked so no loader from the image is involved) runs with no capabilities
   at all, no_new_privs, an empty environment, and hard limits on memory, CPU time, file size
   and open files, under the hook's wall-clock deadline, which the worker keeps: it kills
   ldconfig (and with pid 1 its whole namespace) there; a process that does not end after
   its SIGKILL (stuck in the kernel) is not waited for, but reported (`SandboxError.left`);
5. the sandbox hands the worker the output tmpfs's directory fd just before the exec; once
   ldconfig has ended (and its namespaces with it), the worker reads the cache through that
   fd (one regular file, no link followed, size-limited) and the caller installs it into the
   rootfs by directory fd (gpuhook.apply.rootfs.replace_file). ldconfig's output is returned
   for gpuhook's log, never for the container's user.
"""

import _socket  # not socket.py: its enum import costs the hook more than the rest of this step
import array
import os
import resource  # imported here: after the pivot no module can be loaded
import select
import stat
import time

from gpuhook.kernel import child, linux, mountinfo, paths, seccomp

CACHE_LIMIT = 32 << 20  # largest ld.so.cache accepted (a big image's is a few MiB)
OUTPUT_LIMIT = 4096  # bytes of ldconfig's output kept for the log
LIMITS = {  # resource limits of the ldconfig process (setrlimit(2))
    "RLIMIT_AS": 512 << 20,
    "RLIMIT_CPU": 10,
    "RLIMIT_FSIZE": CACHE_LIMIT,
    "RLIMIT_NOFILE": 64,
    "RLIMIT_CORE": 0,
    # Not the runtime's (attacker pass 14): no real-time priority, no raised nice, no locked
    # memory, no POSIX queue bytes, few pending signals (each POSIX timer can queue one).
    "RLIMIT_RTPRIO": 0,
    "RLIMIT_NICE": 0,
    "RLIMIT_MEMLOCK": 0,
    "RLIMIT_MSGQUEUE": 0,
    "RLIMIT_SIGPENDING": 16,
}
HOSTNAME = b"ldconfig"  # its UTS namespace is a copy of the host's: the host's name is not its to see
SPECIAL_FILESYSTEMS = ("proc", "sysfs")  # their magic links and files lead out of any root
OUTPUT_CANDIDATES = ("proc", "dev", "tmp", "run")  # where the output tmpfs can go, in order
CACHE_MAGICS = (b"glibc-ld.so.cache1.1", b"ld.so-1.7.0")
PT_INTERP = 3
DETACH_ROUNDS = 32
UMOUNT_NOFOLLOW = 0x8  # umount2(2): do not follow a final symlink
KILL_GRACE = 0.3  # seconds a killed process gets to end before it counts as stuck in the kernel
GO = b"go "  # the worker's message to a sandbox prepared ahead: the mounts are made (`_go`)
GO_LIMIT = 4 << 20  # bytes of mount points a sandbox accepts with it
READY = b"exec"  # the sandbox's message (with the output directory's fd) just before it executes ldconfig
# The namespaces the sandbox leaves, besides its PID namespace: it is forked as pid 1 of a new
# one (`_fork_in_new_pid_namespace`) and becomes ldconfig, which is therefore pid 1 there: it
# is still the worker's child (killed, with its group, and reaped from there), and when it
# ends the kernel kills whatever it left in that namespace. All but the mount namespace are
# left at once; the mount namespace once the worker's mounts are made (`_await_go`).
NAMESPACES = linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS


class SandboxError(Exception):
    """ldconfig could not be run safely or did not build a cache. `output` is what ldconfig
    printed (for gpuhook's log only)."""

    def __init__(self, message: str, output: str = "", left=()):
        super().__init__(message)
        self.output = output
        self.left = list(left)  # processes left stuck in the kernel, described for the log


def require_static(fd: int, name: str) -> None:
    """Refuse an ldconfig that is not a statically linked ELF binary: inside the container's
    root a dynamic one would load the image's dynamic loader, and a script the image's shell."""
    head = os.pread(fd, 64, 0)
    if head[:4] != b"\x7fELF" or len(head) < 64:
        raise SandboxError(f"host ldconfig {name} is not an ELF binary; gpuhook runs only a static ldconfig")
    little = head[5] == 1
    order = "little" if little else "big"
    if head[4] != 2:  # ELFCLASS64
        raise SandboxError(f"host ldconfig {name} is not a 64-bit ELF binary")
    phoff = int.from_bytes(head[32:40], order)
    phentsize = int.from_bytes(head[54:56], order)
    phnum = int.from_bytes(head[56:58], order)
    if phentsize < 4 or phnum > 256:
        raise SandboxError(f"host ldconfig {name} has a malformed ELF header")
    table = os.pread(fd, phentsize * phnum, phoff)
    for i in range(phnum):
        if int.from_bytes(table[i * phentsize:i * phentsize + 4], order) == PT_INTERP:
            raise SandboxError(f"host ldconfig {name} is dynamically linked; in the container's root it would "
                               f"load the image's loader (use the distribution's static /sbin/ldconfig)")


class Prepared:
    """A sandbox forked ahead of the mounts it is to hold (`prepare`): pid 1 of its own PID
    namespace, out of the host's network, IPC and UTS namespaces, its bounding set empty,
    waiting on `channel` for `build_cache` to hand it the rootfs. `end` takes it back unused."""

    def __init__(self, pid: int, channel, output: int):
        self.pid = pid
        self.channel = channel  # the worker's end: the go goes out, READY (or why not) comes back
        self.output = output  # the read end of ldconfig's stdout and stderr

    def end(self) -> list:
        """Kill and reap a sandbox that will not be used (the start failed before its ld
        cache, or ends); returns what was left stuck in the kernel, described for the log."""
        self.channel.close()
        if self.output >= 0:
            os.close(self.output)
            self.output = -1
        return [] if child.kill_group(self.pid, KILL_GRACE) else [_stuck("the ldconfig sandbox", self.pid)]


def prepare(rootfs: str, root_fd: int, ldconfig_fd: int, directories, deadline: float) -> Prepared:
    """Fork the sandbox for the rootfs at `rootfs` (open as `root_fd`) now, before the worker
    makes the mounts it will hold: the fork, the forked process's first steps and the
    namespaces that need nothing of the rootfs (about 1.5 ms here) then run beside the
    worker's mounts instead of after them. The sandbox waits for `build_cache`, at most until
    `deadline`. Raises OSError (the worker then forks one when it builds the cache)."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    read_end = write_end = -1
    try:
        read_end, write_end = os.pipe()  # ldconfig's stdout and stderr
        pid = _fork_in_new_pid_namespace()
        if pid == 0:  # the sandbox: becomes ldconfig, or ends
            code = 1
            try:
                ours.close()
                os.close(read_end)
                code = _sandbox(rootfs, root_fd, ldconfig_fd, list(directories), theirs, write_end, deadline)
            finally:
                os._exit(code)
    except BaseException:
        ours.close()
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        theirs.close()
    os.close(write_end)
    return Prepared(pid, ours, read_end)


def build_cache(rootfs: str, root_fd: int, ldconfig_fd: int, directories, deadline: float,
                new_mount_api: bool = True, own_mounts=frozenset(), prepared: Prepared | None = None) -> tuple:
    """(cache bytes, ldconfig's output) for the rootfs at `rootfs` (open as `root_fd`).

    Runs in the container's mount namespace (the hook's worker); raises SandboxError. Without
    `new_mount_api` (kernels before 5.12) the read-only copy is made with mount(2).
    `own_mounts` are the mount points (as /proc/self/mountinfo shows them) of the mounts
    gpuhook made in the rootfs: the only submounts the copy keeps.

    The sandbox is forked as pid 1 of a new PID namespace (`prepare`: ahead, by the worker, or
    here), sets itself up (`_sandbox`) and becomes ldconfig: one fork of this Python process,
    not two (a fork here costs ~0.6 ms and the forked process's first steps as much again).
    It takes its mount namespace only when this hands it `own_mounts` (the go): a copy of the
    container's, with every mount gpuhook made by then. Before it executes ldconfig it hands
    this process its output tmpfs (a directory fd, over the channel); this process reads
    ldconfig's output, waits for it under the deadline and then reads the cache it wrote.
    """
    if prepared is None:
        try:
            prepared = prepare(rootfs, root_fd, ldconfig_fd, directories, deadline)
        except OSError as err:
            raise SandboxError(_describe(err)) from None
    pid, read_end, out_fd = prepared.pid, prepared.output, -1
    prepared.output = -1
    try:
        try:
            _go(prepared.channel, new_mount_api, own_mounts)
        except OSError as err:  # no memfd (EMFILE, ENOMEM): the waiting sandbox is ended, and reaped
            stuck = not child.kill_group(pid, KILL_GRACE)
            raise SandboxError(_describe(err), left=[_stuck("the ldconfig sandbox", pid)] if stuck else ()) from None
        out_fd = _ready(prepared.channel, pid, deadline)
        # Stopped a little before the deadline, so that a kill and its grace end by then.
        result = child.wait_for(pid, read_end, deadline - KILL_GRACE, OUTPUT_LIMIT)
        read_end = -1
        output = result.output.decode("utf-8", "replace")
        if result.timed_out:
            raise SandboxError("host ldconfig did not finish before the deadline; killed", output,
                               [_stuck("host ldconfig", pid)] if result.stuck else ())
        if result.status != 0:
            how = f"was killed by signal {-result.status}" if result.status < 0 else f"exited with {result.status}"
            raise SandboxError(f"host ldconfig {how} (its output is in gpuhook's log)", output)
        data = _hand_back(out_fd, output)
        if not data.startswith(CACHE_MAGICS):
            raise SandboxError("host ldconfig did not write an ld.so.cache", output)
        return data, output
    finally:
        prepared.channel.close()
        for fd in (read_end, out_fd):
            if fd >= 0:
                os.close(fd)


def _go(channel, new_mount_api: bool, own_mounts) -> None:
    """Hand the waiting sandbox what it needs of the mounts made: whether to copy the rootfs
    with the new mount API, and `own_mounts` in a memfd (any number of them fits). A
    sandbox that died meanwhile is not written to: `_ready` reads why, or its end."""
    memfd = os.memfd_create("gpuhook-ldconfig-mounts", os.MFD_CLOEXEC)
    try:
        view = memoryview(b"\0".join(os.fsencode(point) for point in sorted(own_mounts)))
        while view:
            view = view[os.write(memfd, view):]
        channel.sendmsg([GO + (b"1" if new_mount_api else b"0")],
                        [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [memfd]))])
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        os.close(memfd)


def _await_go(channel, deadline: float):
    """In the sandbox: (new mount API, own mounts) from the worker's go (`_go`), or None when
    the worker took it back (end of file). Waits until `deadline` at most."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([channel], [], [], left)[0]:
        raise SandboxError("the ldconfig sandbox got no rootfs before the deadline")
    fds = array.array("i")
    data, ancdata, flags, _ = channel.recvmsg(16, _socket.CMSG_SPACE(2 * fds.itemsize), _socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        if not data and not fds:
            return None
        if data not in (GO + b"0", GO + b"1") or len(fds) != 1 or flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC):
            raise SandboxError("the ldconfig sandbox got a malformed request")
        raw, at = [], 0
        while True:
            chunk = os.pread(fds[0], 1 << 16, at)
            if not chunk:
                break
            at += len(chunk)
            if at > GO_LIMIT:
                raise SandboxError("the ldconfig sandbox got too many mounts")
            raw.append(chunk)
    finally:
        for fd in fds:
            os.close(fd)
    return data.endswith(b"1"), frozenset(os.fsdecode(point) for point in b"".join(raw).split(b"\0") if point)


def _fork_in_new_pid_namespace() -> int:
    """fork(), the child being pid 1 of a new PID namespace. unshare(CLONE_NEWPID) changes only
    where the caller's next children go; that is put back after the fork where it can be (this
    process's /proc shows its namespace, and it holds CAP_SYS_ADMIN over it: not a worker in
    a container's user namespace). Where not, a later fork of the caller fails: the worker
    forks nothing after its sandbox."""
    try:
        mine = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        mine = -1
    try:
        linux.unshare(linux.CLONE_NEWPID)
        pid = os.fork()
        if pid != 0 and mine >= 0:
            try:
                linux.setns(mine, linux.CLONE_NEWPID)
            except OSError:
                pass
        return pid
    finally:
        if mine >= 0:
            os.close(mine)


def _ready(channel, pid: int, deadline: float) -> int:
    """The output tmpfs's directory fd the sandbox sends just before it executes ldconfig; a
    sandbox that fails sends why instead (or dies: end of file), and is killed and reaped."""
    while True:
        left = deadline - KILL_GRACE - time.monotonic()  # a kill and its grace end by the deadline
        if left <= 0:
            error = "host ldconfig did not finish before the deadline; killed"
            break
        if not select.select([channel], [], [], left)[0]:
            continue
        fds = array.array("i")
        data, ancdata, flags, _ = channel.recvmsg(4096, _socket.CMSG_SPACE(2 * fds.itemsize),
                                                  _socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if data == READY and len(fds) == 1 and not flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC):
            return fds[0]
        for fd in fds:
            os.close(fd)
        error = data.decode("utf-8", "replace") if data else "the ldconfig sandbox died"
        break
    stuck = not child.kill_group(pid, KILL_GRACE)
    raise SandboxError(error, left=[_stuck("the ldconfig sandbox", pid)] if stuck else ())


def _stuck(what: str, pid: int) -> str:
    return (f"{what} (pid {pid}) did not end after SIGKILL: it is stuck in the kernel (a filesystem that "
            f"does not answer) and ends when that call returns; it holds no file of the container")


def _sandbox(rootfs, root_fd, ldconfig_fd, directories, channel, output, deadline) -> int:
    """The sandbox process, pid 1 of its PID namespace: leave what needs nothing of the rootfs
    at once, wait for the worker's go (`_await_go`), set up the rest, hand over the output
    directory, become ldconfig. Returns (an exit code) only where that failed, or where the
    worker took it back; never raises."""
    ready = False
    try:
        linux.prctl_set_pdeathsig(linux.SIGKILL)  # kept across the exec: ldconfig is no set-id program
        os.setpgid(0, 0)
        linux.unshare(NAMESPACES & ~linux.CLONE_NEWNS)
        linux.sethostname(HOSTNAME)
        linux.drop_bounding_set()  # nothing it may do changes before the exec (_confine)
        devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # ldconfig's stdin; no /dev in there
        go = _await_go(channel, deadline)
        if go is None:
            return 0
        new_mount_api, own_mounts = go
        # A copy of the container's mount namespace as it is now, gpuhook's mounts made.
        linux.unshare(linux.CLONE_NEWNS)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        # Read again after each change: it shows the live table (proc_pid_mountinfo(5)).
        info = mountinfo.open_table()
        top = _readonly_copy(rootfs, root_fd, info, new_mount_api, own_mounts)
        out_fd, out_dir = _output_dir(top)
        # The copy's path as the mount table shows it: root.path as written may pass through
        # a symlink (runc refuses that, other runtimes need not).
        _verify(top, info, os.readlink(linux.fd_path(top)).rstrip("/"), out_dir, own_mounts)
        os.fchdir(top)
        linux.pivot_root(".", ".")
        linux.umount2(".", linux.MNT_DETACH)
        os.chdir("/")
        for fd in (info, top):
            os.close(fd)
        argv = ["ldconfig", "-X", "-C", f"{out_dir}/ld.so.cache", *directories]
        channel.sendmsg([READY], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [out_fd]))])
        ready = True
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        _confine()
        os.execve(ldconfig_fd, argv, {})
    except BaseException as err:  # noqa: BLE001 - reported to the worker
        message = str(err) if isinstance(err, SandboxError) else _describe(err)
        try:
            if ready:  # the worker waits for ldconfig now: its output is where this goes
                os.write(output, f"cannot run host ldconfig: {message}\n".encode())
            else:
                channel.send(message.encode()[:4000])
        except OSError:
            pass
    return 127 if ready else 1


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"ldconfig sandbox: {err.strerror}"
    return f"ldconfig sandbox: {type(err).__name__}: {err}"


def _readonly_copy(rootfs: str, root_fd: int, info: int, new_mount_api: bool, own_mounts) -> int:
    """Stack a read-only, nosuid, nodev, noexec copy of the rootfs on the rootfs in this
    private namespace, keeping only the submounts gpuhook made (`_detach_foreign`); returns
    an O_PATH fd of its top."""
    want = os.fstat(root_fd)
    here = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if (os.fstat(here).st_dev, os.fstat(here).st_ino) != (want.st_dev, want.st_ino):
            raise SandboxError("the rootfs changed under the ldconfig sandbox")
        attrs = linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NODEV | linux.MOUNT_ATTR_NOEXEC
        below = mountinfo.mount_id(here)
        if new_mount_api:
            tree = linux.open_tree_clone(here, recursive=True)
            try:
                linux.mount_setattr(tree, attrs, recursive=True, propagation=linux.MS_PRIVATE)
                linux.move_mount(tree, here)
            finally:
                os.close(tree)
        else:  # kernels before 5.12: bind, then remount each mount of the copy read-only
            linux.mount(linux.fd_path(here), linux.fd_path(here), None, linux.MS_BIND | linux.MS_REC)
        top = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if mountinfo.mount_id(top) == below or (os.fstat(top).st_dev, os.fstat(top).st_ino) != (want.st_dev, want.st_ino):
            os.close(top)
            raise SandboxError("the read-only copy of the rootfs is not where it was attached")
        _detach_foreign(top, info, own_mounts)
        if not new_mount_api:
            flags = linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV | \
                linux.MS_NOEXEC
            for m in mountinfo.read_subtree(info, mountinfo.mount_id(top)):
                linux.mount(None, m.point, None, flags)
        return top
    finally:
        os.close(here)


def _kept(tree: list, top_id: int, own_mounts) -> set:
    """Ids of the mounts of `tree` (the copy) that stay: its top, gpuhook's own mounts (by
    mount point) and the mounts they sit on."""
    by_id = {m.id: m for m in tree}
    kept = {top_id}
    for m in tree:
        if m.point in own_mounts and m.fstype not in SPECIAL_FILESYSTEMS:
            while m is not None and m.id not in kept:
                kept.add(m.id)
                m = by_id.get(m.parent)
    return kept


def _detach_foreign(top: int, info: int, own_mounts) -> None:
    """Detach every submount of the copy that gpuhook did not make: procfs and sysfs (their
    magic links lead out of any root), the runtime's /dev and the pod's volumes (ldconfig
    need not read them, and a volume's filesystem may never answer). A lazy detach takes
    what is mounted below with it, and asks the detached filesystem nothing."""
    top_id = mountinfo.mount_id(top)
    for _ in range(DETACH_ROUNDS):
        tree = mountinfo.read_subtree(info, top_id)
        kept = _kept(tree, top_id, own_mounts)
        foreign = [m for m in tree if m.id not in kept and m.parent in kept]
        if not foreign:
            return
        # umount2 detaches the topmost mount at a path: where two mounts share a mount point,
        # or a call fails, the next round reads the table again. Otherwise each call took the
        # mount it named, with all below it, and _verify reads the table before the pivot.
        again = len({m.point for m in tree}) != len(tree)
        for m in foreign:
            try:
                linux.umount2(m.point, linux.MNT_DETACH | UMOUNT_NOFOLLOW)
            except OSError:
                again = True  # gone already with a parent, or moved: the next round sees where
        if not again:
            return
    raise SandboxError("cannot detach the container's volumes, /proc and /sys from the ldconfig sandbox")


def _output_dir(top: int) -> tuple:
    """(fd, container path) of a fresh, size-limited tmpfs in the copy: the only place ldconfig
    can write. Mounted on the first of OUTPUT_CANDIDATES the image has as a directory."""
    for name in OUTPUT_CANDIDATES:
        try:
            below = paths.open_in_root(top, "/" + name, os.O_PATH | os.O_DIRECTORY, follow_final=False)
        except OSError:
            continue
        try:
            linux.mount("tmpfs", linux.fd_path(below), "tmpfs", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC,
                        f"size={CACHE_LIMIT * 2},nr_inodes=64,mode=0700")
            fd = paths.open_in_root(top, "/" + name, os.O_RDONLY | os.O_DIRECTORY, follow_final=False)
            if os.fstat(fd).st_dev == os.fstat(below).st_dev or os.listdir(fd):
                os.close(fd)
                raise SandboxError("the ldconfig output directory changed while it was mounted")
            return fd, "/" + name
        finally:
            os.close(below)
    raise SandboxError("the rootfs has none of /proc, /dev, /tmp, /run as a directory for the ld cache")


def _verify(top: int, info: int, rootfs: str, out_dir: str, own_mounts) -> None:
    """What the sandbox will hold after the pivot (the copy at `top` and what is mounted
    below it; nothing else can mount in this private namespace): no procfs or sysfs, no mount
    but the rootfs's, gpuhook's own and the one output tmpfs, and everything read-only but
    that tmpfs. Checked before the pivot, as a mountinfo opened earlier shows only mounts
    reachable from the root it was opened under."""
    outputs = 0
    top_id = mountinfo.mount_id(top)
    tree = mountinfo.read_subtree(info, top_id)
    kept = _kept(tree, top_id, own_mounts)
    for m in tree:
        if m.fstype in SPECIAL_FILESYSTEMS:
            raise SandboxError(f"a {m.fstype} mount is still in the ldconfig sandbox")
        if m.point == rootfs + out_dir and m.fstype == "tmpfs" and b"rw" in m.options and m.parent == top_id:
            outputs += 1
        elif b"ro" not in m.options:
            raise SandboxError("a writable mount is still in the ldconfig sandbox")
        elif m.id not in kept:
            raise SandboxError("a mount gpuhook did not make is still in the ldconfig sandbox")
    if outputs != 1:
        raise SandboxError("the ldconfig sandbox has no single output directory")


def _confine() -> None:
    """In the ldconfig process just before exec: hard limits, no capabilities at all, then the
    seccomp filter (gpuhook.kernel.seccomp.LDCONFIG_DENIED: no process, namespace, keyring or
    memory outside its address space; attacker pass 13, B1, B2)."""
    for name, value in LIMITS.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    linux.drop_held_capabilities()  # the bounding set went while it waited (_sandbox)
    seccomp.install(seccomp.deny(seccomp.LDCONFIG_DENIED, args=seccomp.LDCONFIG_DENIED_ARGS))


def _hand_back(out_fd: int, output: str) -> bytes:
    """The cache ldconfig wrote in the output tmpfs (`out_fd`, its directory), read once
    ldconfig has ended: a regular file of at most CACHE_LIMIT bytes, nothing else."""
    try:
        fd = os.open("ld.so.cache", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=out_fd)
    except OSError:
        raise SandboxError("host ldconfig did not write an ld.so.cache", output) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CACHE_LIMIT:
            raise SandboxError("host ldconfig wrote something other than a cache file", output)
        data = os.read(fd, CACHE_LIMIT + 1)
    finally:
        os.close(fd)
    if len(data) > CACHE_LIMIT:
        raise SandboxError("the ld cache is larger than gpuhook accepts", output)
    return data
