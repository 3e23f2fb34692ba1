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
CLONE_NEWUSER = 0x10000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000

MNT_DETACH = 0x2

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

PR_SET_PDEATHSIG = 1

# These have the same number on every architecture (added after the syscall table unification).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442

AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOVE_MOUNT_T_EMPTY_PATH = 0x40
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
_SYSCALL_NUMBERS = {"x86_64": {"bpf": 321}, "aarch64": {"bpf": 280}}


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


def open_tree_clone(fd: int) -> int:
    """A detached copy of the mount at `fd` (a bind mount not attached anywhere yet)."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_EMPTY_PATH
    return _check(_syscall(SYS_OPEN_TREE, ctypes.c_int(fd), b"", ctypes.c_uint(flags)), "open_tree")


def mount_setattr(fd: int, attr_set: int) -> None:
    """Set mount attributes (MOUNT_ATTR_*) on the mount at `fd`, e.g. a detached tree."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    result = _syscall(SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(AT_EMPTY_PATH),
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
