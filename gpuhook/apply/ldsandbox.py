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

1. a new mount namespace, everything private (nothing propagates in or out), and new PID,
   network, IPC and UTS namespaces: ldconfig is pid 1 of its own PID namespace (it sees no
   other process to signal or trace), has only a loopback that is down (no host abstract
   UNIX socket, no network) and no SysV IPC object or POSIX queue of the host;
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
   and open files, under the hook's wall-clock deadline; a process that does not end after
   its SIGKILL (stuck in the kernel) is not waited for, but reported (`SandboxError.left`);
5. the cache it built is read from the tmpfs by fd, checked, and handed back; the caller
   installs it into the rootfs by directory fd (gpuhook.apply.rootfs.replace_file). ldconfig's output is returned for gpuhook's
   log, never for the container's user.
"""

import os
import resource  # imported here: after the pivot no module can be loaded
import select
import stat
import time

from gpuhook import fastjson
from gpuhook.kernel import paths
from gpuhook.apply.order import write_all
from gpuhook.kernel import child, linux, mountinfo

CACHE_LIMIT = 32 << 20  # largest ld.so.cache accepted (a big image's is a few MiB)
OUTPUT_LIMIT = 4096  # bytes of ldconfig's output kept for the log
LIMITS = {  # resource limits of the ldconfig process (setrlimit(2))
    "RLIMIT_AS": 512 << 20,
    "RLIMIT_CPU": 10,
    "RLIMIT_FSIZE": CACHE_LIMIT,
    "RLIMIT_NOFILE": 64,
    "RLIMIT_CORE": 0,
}
SPECIAL_FILESYSTEMS = ("proc", "sysfs")  # their magic links and files lead out of any root
OUTPUT_CANDIDATES = ("proc", "dev", "tmp", "run")  # where the output tmpfs can go, in order
CACHE_MAGICS = (b"glibc-ld.so.cache1.1", b"ld.so-1.7.0")
PT_INTERP = 3
DETACH_ROUNDS = 32
UMOUNT_NOFOLLOW = 0x8  # umount2(2): do not follow a final symlink
KILL_GRACE = 0.3  # seconds a killed process gets to end before it counts as stuck in the kernel
KILL_MARGIN = 0.3 + 2 * KILL_GRACE  # the sandbox stops ldconfig itself this long before the deadline
# The namespaces the sandbox leaves. After unshare(CLONE_NEWPID) the sandbox itself stays in
# the caller's PID namespace; the next process it forks, ldconfig, is pid 1 of the new one:
# it is still this process's child (killed, with its group, and reaped from here), and when
# it ends the kernel kills whatever it left in that namespace.
NAMESPACES = (linux.CLONE_NEWNS | linux.CLONE_NEWPID | linux.CLONE_NEWNET | linux.CLONE_NEWIPC
              | linux.CLONE_NEWUTS)


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


def build_cache(rootfs: str, root_fd: int, ldconfig_fd: int, directories, deadline: float,
                new_mount_api: bool = True, own_mounts=frozenset()) -> tuple:
    """(cache bytes, ldconfig's output) for the rootfs at `rootfs` (open as `root_fd`).

    Runs in the container's mount namespace (the hook's worker); raises SandboxError. Without
    `new_mount_api` (kernels before 5.12) the read-only copy is made with mount(2).
    `own_mounts` are the mount points (as /proc/self/mountinfo shows them) of the mounts
    gpuhook made in the rootfs: the only submounts the copy keeps.
    """
    memfd = os.memfd_create("gpuhook-ld.so.cache", os.MFD_CLOEXEC)
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the sandbox: never returns
            code = 1
            try:
                os.close(read_end)
                code = _sandbox(rootfs, root_fd, ldconfig_fd, list(directories), deadline, memfd, write_end,
                                new_mount_api, frozenset(own_mounts))
            finally:
                os._exit(code)
        os.close(write_end)
        write_end = -1
        report = _collect(pid, read_end, deadline)
        if not report.get("ok"):
            raise SandboxError(report.get("error") or "ldconfig sandbox failed", report.get("output", ""),
                               report.get("left") or ())
        size = report.get("size", 0)
        data = os.pread(memfd, size, 0) if size else b""
        if not data.startswith(CACHE_MAGICS):
            raise SandboxError("host ldconfig did not write an ld.so.cache", report.get("output", ""))
        return data, report.get("output", "")
    finally:
        os.close(memfd)
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def _collect(pid: int, read_end: int, deadline: float) -> dict:
    """The sandbox's report; at the deadline the sandbox is killed (and not waited for
    beyond KILL_GRACE: it may be stuck in the kernel)."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            stuck = not child.kill_group(pid, KILL_GRACE)
            raise SandboxError("host ldconfig did not finish before the deadline; killed",
                               left=[_stuck("the ldconfig sandbox", pid)] if stuck else ())
        ready, _, _ = select.select([read_end], [], [], left)
        if not ready:
            continue
        data = os.read(read_end, 65536)
        if not data:
            break
        chunks.append(data)
        if sum(map(len, chunks)) > 1 << 20:
            break
    stuck = not child.kill_group(pid, KILL_GRACE)
    try:
        report = fastjson.loads(b"".join(chunks))
    except ValueError:
        report = None
    if not isinstance(report, dict):
        raise SandboxError("the ldconfig sandbox died", left=[_stuck("the ldconfig sandbox", pid)] if stuck else ())
    if stuck:
        report["left"] = list(report.get("left") or ()) + [_stuck("the ldconfig sandbox", pid)]
    return report


def _stuck(what: str, pid: int) -> str:
    return (f"{what} (pid {pid}) did not end after SIGKILL: it is stuck in the kernel (a filesystem that "
            f"does not answer) and ends when that call returns; it holds no file of the container")


def _sandbox(rootfs, root_fd, ldconfig_fd, directories, deadline, memfd, out, new_mount_api, own_mounts) -> int:
    """The sandbox process: set up, run ldconfig, hand back the cache. Never raises."""
    report = {"ok": False}
    try:
        linux.prctl_set_pdeathsig(linux.SIGKILL)
        os.setpgid(0, 0)
        linux.unshare(NAMESPACES)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        # Read again after each change: it shows the live table (proc_pid_mountinfo(5)).
        info = mountinfo.open_table()
        devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # ldconfig's stdin; no /dev in there
        top = _readonly_copy(rootfs, root_fd, info, new_mount_api, own_mounts)
        out_fd, out_dir = _output_dir(top)
        # The copy's path as the mount table shows it: root.path as written may pass through
        # a symlink (runc refuses that, other runtimes need not).
        _verify(top, info, os.readlink(linux.fd_path(top)).rstrip("/"), out_dir, own_mounts)
        os.fchdir(top)
        linux.pivot_root(".", ".")
        linux.umount2(".", linux.MNT_DETACH)
        os.chdir("/")
        argv = ["ldconfig", "-X", "-C", f"{out_dir}/ld.so.cache", *directories]
        # Ends a little before the caller's deadline, so this process (not the caller's kill
        # of it) stops ldconfig, with its whole process group.
        timeout = max(0.1, deadline - KILL_MARGIN - time.monotonic())
        result = child.run(argv, timeout, env={}, executable=ldconfig_fd,
                           output_cap=OUTPUT_LIMIT, before_exec=_confine, stdin=devnull)
        report["output"] = result.output.decode("utf-8", "replace")
        if result.stuck:
            report["left"] = [_stuck("host ldconfig", result.pid)]
        if result.timed_out:
            raise SandboxError("host ldconfig did not finish before the deadline; killed")
        if result.status != 0:
            how = f"was killed by signal {-result.status}" if result.status < 0 else f"exited with {result.status}"
            raise SandboxError(f"host ldconfig {how} (its output is in gpuhook's log)")
        report["size"] = _hand_back(out_fd, memfd)
        report["ok"] = True
    except BaseException as err:  # noqa: BLE001 - reported to the worker
        report["error"] = str(err) if isinstance(err, SandboxError) else _describe(err)
    write_all(out, fastjson.dumps(report).encode())
    return 0


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
    """In the ldconfig process just before exec: hard limits, then no capabilities at all."""
    for name, value in LIMITS.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    linux.drop_all_capabilities()


def _hand_back(out_fd: int, memfd: int) -> int:
    """Copy the cache ldconfig wrote into the caller's memfd; returns its size."""
    fd = os.open("ld.so.cache", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=out_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CACHE_LIMIT:
            raise SandboxError("host ldconfig wrote something other than a cache file")
        data = os.read(fd, CACHE_LIMIT + 1)
    finally:
        os.close(fd)
    if len(data) > CACHE_LIMIT:
        raise SandboxError("the ld cache is larger than gpuhook accepts")
    view = memoryview(data)
    while view:
        view = view[os.write(memfd, view):]
    return len(data)
