"""The bpf(2) calls behind cgroup v2 device grants, over ctypes.

Only what a device grant needs: list the programs attached to a cgroup (PROG_QUERY), open
one by id (PROG_GET_FD_BY_ID), read its name, tag and translated instructions
(OBJ_GET_INFO_BY_FD), load a new one (PROG_LOAD), and swap it in (PROG_ATTACH with
BPF_F_REPLACE, PROG_DETACH). Struct layouts follow include/uapi/linux/bpf.h; the kernel
accepts a shorter attribute than its own and treats the rest as zero, so each command gets
a structure with just the fields it uses.

Like gpuhook.kernel.linux, every failure is an OSError carrying the errno and the command's name;
gpuhook.apply.cgroup.v2 turns them into one gpuhook error. Imported only on the GPU path.
"""

import ctypes
import errno
import os

from gpuhook.kernel import linux
from gpuhook.record import record

PROG_LOAD = 5
PROG_ATTACH = 8
PROG_DETACH = 9
PROG_GET_FD_BY_ID = 13
OBJ_GET_INFO_BY_FD = 15
PROG_QUERY = 16
_COMMAND_NAMES = {PROG_LOAD: "BPF_PROG_LOAD", PROG_ATTACH: "BPF_PROG_ATTACH", PROG_DETACH: "BPF_PROG_DETACH",
                  PROG_GET_FD_BY_ID: "BPF_PROG_GET_FD_BY_ID", OBJ_GET_INFO_BY_FD: "BPF_OBJ_GET_INFO_BY_FD",
                  PROG_QUERY: "BPF_PROG_QUERY"}

PROG_TYPE_CGROUP_DEVICE = 15
ATTACH_CGROUP_DEVICE = 6
F_QUERY_EFFECTIVE = 1
F_ALLOW_MULTI = 2
F_REPLACE = 4

LICENSE = b"Apache-2.0"
# A failed load is retried with a verifier log this big; a smaller one can turn a long but
# valid verification into ENOSPC (docs/runtime-facts.md §5).
LOG_SIZE = 1 << 20
INSN_SIZE = 8

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64


class _LoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", _u32), ("insn_cnt", _u32), ("insns", _u64), ("license", _u64),
                ("log_level", _u32), ("log_size", _u32), ("log_buf", _u64), ("kern_version", _u32),
                ("prog_flags", _u32), ("prog_name", ctypes.c_char * 16), ("prog_ifindex", _u32),
                ("expected_attach_type", _u32)]


class _AttachAttr(ctypes.Structure):
    _fields_ = [("target_fd", _u32), ("attach_bpf_fd", _u32), ("attach_type", _u32),
                ("attach_flags", _u32), ("replace_bpf_fd", _u32)]


class _GetIdAttr(ctypes.Structure):
    _fields_ = [("prog_id", _u32), ("next_id", _u32), ("open_flags", _u32)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", _u32), ("info_len", _u32), ("info", _u64)]


class _QueryAttr(ctypes.Structure):
    _fields_ = [("target_fd", _u32), ("attach_type", _u32), ("query_flags", _u32),
                ("attach_flags", _u32), ("prog_ids", _u64), ("prog_cnt", _u32)]


class _ProgInfo(ctypes.Structure):
    # struct bpf_prog_info up to the name; the kernel fills no more than we ask for.
    _fields_ = [("type", _u32), ("id", _u32), ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", _u32),
                ("xlated_prog_len", _u32), ("jited_prog_insns", _u64), ("xlated_prog_insns", _u64),
                ("load_time", _u64), ("created_by_uid", _u32), ("nr_map_ids", _u32), ("map_ids", _u64),
                ("name", ctypes.c_char * 16)]


class ProgramInfo(record("ProgramInfo", "id name tag type code map_count")):
    """An attached program: `code` is its translated instructions (bytes, 8 per insn)."""

    __slots__ = ()


class VerifierError(OSError):
    """PROG_LOAD refused the program; `reason` is the end of the verifier's log."""

    def __init__(self, code: int, reason: str):
        super().__init__(code, f"BPF_PROG_LOAD: {os.strerror(code)}: {reason}")
        self.reason = reason


def _call(command: int, attr) -> int:
    result = _libc.syscall(ctypes.c_long(linux.syscall_number("bpf")), ctypes.c_int(command),
                           ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{_COMMAND_NAMES[command]}: {os.strerror(err)}")
    return result


def query(target_fd: int, effective: bool = False) -> list:
    """Ids of the device programs attached to the cgroup open at `target_fd`.

    With `effective`, the programs that run for it, inherited ones included.
    """
    capacity = 16
    while True:
        ids = (_u32 * capacity)()
        attr = _QueryAttr(target_fd=target_fd, attach_type=ATTACH_CGROUP_DEVICE,
                          query_flags=F_QUERY_EFFECTIVE if effective else 0,
                          prog_ids=ctypes.addressof(ids), prog_cnt=capacity)
        try:
            _call(PROG_QUERY, attr)
        except OSError as err:
            # ENOSPC: more programs than room (one was attached meanwhile); ask again.
            if err.errno == errno.ENOSPC and capacity < 4096:
                capacity *= 4
                continue
            raise
        return list(ids[: attr.prog_cnt])


def open_program(prog_id: int) -> int:
    """An fd for program `prog_id` (close it when done)."""
    return _call(PROG_GET_FD_BY_ID, _GetIdAttr(prog_id=prog_id))


def _info(fd: int, info: _ProgInfo) -> None:
    _call(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))


def program_info(fd: int) -> ProgramInfo:
    """Name, tag and translated instructions of the program open at `fd`."""
    sizes = _ProgInfo()
    _info(fd, sizes)
    length = sizes.xlated_prog_len
    if length == 0:
        # The kernel hides the code from callers without CAP_BPF/CAP_SYS_ADMIN.
        raise OSError(errno.EPERM, "BPF_OBJ_GET_INFO_BY_FD: the program's instructions are not readable")
    code = ctypes.create_string_buffer(length)
    info = _ProgInfo(xlated_prog_len=length, xlated_prog_insns=ctypes.addressof(code))
    _info(fd, info)
    # A program replaced between the two calls could be longer now: read what fits.
    length = min(length, info.xlated_prog_len)
    return ProgramInfo(info.id, info.name.decode("ascii", "replace"), bytes(info.tag).hex(),
                       info.type, code.raw[:length], info.nr_map_ids)


def load(code: bytes, name: str) -> int:
    """Load a cgroup device program; its fd. Raises VerifierError with the reason on refusal.

    The first try runs without a verifier log (fast, and no log size can turn a valid
    program into ENOSPC); only a refusal is repeated with a log to say why.
    """
    text = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(LICENSE)
    attr = _LoadAttr(prog_type=PROG_TYPE_CGROUP_DEVICE, insn_cnt=len(code) // INSN_SIZE,
                     insns=ctypes.addressof(text), license=ctypes.addressof(license_),
                     prog_name=name.encode()[:15], expected_attach_type=ATTACH_CGROUP_DEVICE)
    try:
        return _load(attr)
    except OSError as err:
        first = err
    if first.errno == errno.EPERM and _raise_memlock():
        try:
            return _load(attr)
        except OSError as err:
            first = err
    if first.errno == errno.EPERM:
        raise first  # a capability is missing; the verifier has nothing to say about that
    log = ctypes.create_string_buffer(LOG_SIZE)
    attr.log_level, attr.log_size, attr.log_buf = 1, LOG_SIZE, ctypes.addressof(log)
    try:
        return _load(attr)  # accepted with a log: the first refusal was not the verifier's
    except OSError as err:
        reason = _reason(log.value.decode("utf-8", "replace"))
        if err.errno == errno.ENOSPC and not reason:
            reason = f"the verifier's log is longer than {LOG_SIZE} bytes"
        raise VerifierError(first.errno, reason or "the verifier gave no reason") from None


def _load(attr) -> int:
    # The verifier can be interrupted by a signal and asks to be called again.
    for _ in range(5):
        try:
            return _call(PROG_LOAD, attr)
        except OSError as err:
            if err.errno != errno.EAGAIN:
                raise
    return _call(PROG_LOAD, attr)


def _reason(log: str) -> str:
    """The verifier's complaint: the last lines of its log before its statistics."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    while lines and lines[-1].startswith(("processed ", "verification time", "stack depth")):
        lines.pop()
    return lines[-1] if lines else ""


def _raise_memlock() -> bool:
    """Lift RLIMIT_MEMLOCK (kernels before 5.11 charge programs to it); True if it changed."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        return False  # not allowed to: best effort (docs/runtime-facts.md §5)
    return True


def attach(target_fd: int, prog_fd: int, replace_fd: int | None = None) -> None:
    """Attach a device program to a cgroup next to the others (ALLOW_MULTI); with
    `replace_fd`, atomically in place of that attached program (kernel 5.6+)."""
    flags = F_ALLOW_MULTI | (F_REPLACE if replace_fd is not None else 0)
    _call(PROG_ATTACH, _AttachAttr(target_fd=target_fd, attach_bpf_fd=prog_fd, attach_type=ATTACH_CGROUP_DEVICE,
                                   attach_flags=flags, replace_bpf_fd=replace_fd or 0))


def detach(target_fd: int, prog_fd: int) -> None:
    _call(PROG_DETACH, _AttachAttr(target_fd=target_fd, attach_bpf_fd=prog_fd, attach_type=ATTACH_CGROUP_DEVICE))


def replace_supported(prog_fd: int) -> bool:
    """Whether the kernel knows BPF_F_REPLACE (5.6+).

    Asks with an invalid cgroup fd: a kernel that knows the flag gets past the flag check
    and fails on the fd (EBADF); an older one refuses the flag (EINVAL).
    """
    try:
        _call(PROG_ATTACH, _AttachAttr(target_fd=0xFFFFFFFF, attach_bpf_fd=prog_fd, attach_type=ATTACH_CGROUP_DEVICE,
                                       attach_flags=F_ALLOW_MULTI | F_REPLACE, replace_bpf_fd=prog_fd))
    except OSError as err:
        return err.errno != errno.EINVAL
    return True


def swap(target_fd: int, old_fd: int, new_fd: int, use_replace: bool = True) -> str:
    """Put the program `new_fd` where `old_fd` is attached; returns how ("replace" or
    "attach, detach").

    Without BPF_F_REPLACE (or with `use_replace` False) the new program is attached first
    and the old one detached after: every program must allow an access, so at no moment is
    the cgroup less restricted than before, and a failed detach is undone.
    """
    if use_replace:
        try:
            attach(target_fd, new_fd, replace_fd=old_fd)
            return "replace"
        except OSError as err:
            if err.errno != errno.EINVAL or replace_supported(new_fd):
                raise
    attach(target_fd, new_fd)
    try:
        detach(target_fd, old_fd)
    except OSError:
        try:
            detach(target_fd, new_fd)
        except OSError:
            pass  # both attached: the old rules still hold, since every program must allow
        raise
    return "attach, detach"
