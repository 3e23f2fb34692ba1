"""The Linux system calls Python's os module lacks (3.11): setns, mount, umount2, openat2,
prctl, and the new mount API (open_tree, mount_setattr, move_mount).

Thin ctypes wrappers, nothing else: each raises OSError with the errno and the call named,
so callers translate it once into a gpuhook error. Only the GPU path imports this module.
"""

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)

SIGKILL = 9  # as signal.SIGKILL, without importing signal (and enum) on the hook's path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_REC = 0x4000
MS_PRIVATE = 0x40000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000

MNT_DETACH = 0x2

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECUREBITS = 28
# SECBIT_NOROOT | SECBIT_NO_SETUID_FIXUP | SECBIT_KEEP_CAPS off, each with its lock bit:
# uid 0 gets no capabilities from execve (include/uapi/linux/securebits.h).
SECURE_NOROOT_LOCKED = 0x01 | 0x02 | 0x04 | 0x08
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# These have the same number on every architecture (added after the syscall table unification).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442

AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 1
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
_SYSCALL_NUMBERS = {"x86_64": {"bpf": 321, "pivot_root": 155, "capset": 126},
                    "aarch64": {"bpf": 280, "pivot_root": 41, "capset": 91}}


def syscall_number(name: str) -> int:
    machine = os.uname().machine
    try:
        return _SYSCALL_NUMBERS[machine][name]
    except KeyError:
        raise OSError(38, f"{name}: unsupported architecture {machine}") from None


def _check(result: int, call: str, *what) -> int:
    if result < 0:
        err = ctypes.get_errno()
        detail = " ".join(str(w) for w in what if w)
        raise OSError(err, f"{call}{' ' + detail if detail else ''}: {os.strerror(err)}")
    return result


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def _b(path):
    return None if path is None else os.fsencode(path)


def mount(source, target, fstype, flags: int, data=None) -> None:
    result = _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data))
    _check(result, "mount", target)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(ctypes.c_long(syscall_number("pivot_root")), _b(new_root), _b(put_old)), "pivot_root")


def prctl(option: int, arg2: int = 0) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), "prctl", option)


def drop_bounding_set() -> None:
    """The first half of leaving this process, and whatever it executes, with no capability at
    all, even as uid 0 (capabilities(7), "Capabilities and execution of programs by root"):
    empty bounding and ambient sets, SECBIT_NOROOT locked. It changes nothing this process
    may do until it executes a program: the ldconfig sandbox takes it while it waits for its
    rootfs (gpuhook.apply.ldsandbox), `drop_held_capabilities` just before the exec."""
    cap = 0
    while True:  # dropping the bounding set needs CAP_SETPCAP, which the effective set keeps
        if _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), 0, 0, 0) < 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                break
            _check(-1, "prctl PR_CAPBSET_DROP", cap)
        cap += 1
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    prctl(PR_SET_SECUREBITS, SECURE_NOROOT_LOCKED)


def drop_held_capabilities() -> None:
    """The second half (after `drop_bounding_set`): empty effective, permitted and inheritable
    sets, and no_new_privs."""
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}, all zero
    _check(_libc.syscall(ctypes.c_long(syscall_number("capset")), header, data), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def sethostname(name: bytes) -> None:
    _check(_libc.sethostname(name, ctypes.c_size_t(len(name))), "sethostname")


def umount2(target, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), "umount2", target)


def prctl_set_pdeathsig(sig: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0), "prctl")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    how = _OpenHow(flags, mode, resolve)
    result = _libc.syscall(
        ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd), _b(path),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )
    return _check(result, "openat2", path)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _syscall(number: int, *args) -> int:
    return _libc.syscall(ctypes.c_long(number), *args)


def open_tree_clone(fd: int, recursive: bool = False) -> int:
    """A detached copy of the mount at `fd` (a bind mount not attached anywhere yet), with
    its submounts when `recursive`. The mount must be in the caller's mount namespace."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    return _check(_syscall(SYS_OPEN_TREE, ctypes.c_int(fd), b"", ctypes.c_uint(flags)), "open_tree")


def mount_setattr(fd: int, attr_set: int, recursive: bool = False, propagation: int = 0) -> None:
    """Set mount attributes (MOUNT_ATTR_*) and optionally the propagation type (MS_PRIVATE)
    on the mount at `fd` (and its submounts when `recursive`), e.g. a detached tree."""
    attr = _MountAttr(attr_set, 0, propagation, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    result = _syscall(SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(flags),
                      ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(result, "mount_setattr")


def move_mount(from_fd: int, to_fd: int) -> None:
    """Attach the mount at `from_fd` on the file or directory at `to_fd`."""
    flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
    result = _syscall(SYS_MOVE_MOUNT, ctypes.c_int(from_fd), b"", ctypes.c_int(to_fd), b"", ctypes.c_uint(flags))
    _check(result, "move_mount")


def fd_path(fd: int) -> str:
    """The magic link that names an open fd; mount(2) and chroot(2) follow it to the object."""
    return f"/proc/self/fd/{fd}"
