"""A seccomp filter that refuses a list of system calls, for a process that runs trusted code on
hostile input (the host's ldconfig in its sandbox, gpuhook.apply.ldsandbox).

Namespaces, capabilities and rlimits leave some of the kernel shared with a process that is
still uid 0 of the host (attacker pass 13):

- the kernel's keyrings are per uid of the user namespace: root's user and persistent
  keyrings, and every runtime's session keyrings (`_ses.<container>`), are open to any process
  of host uid 0, capabilities or not (B1: a compromised ldconfig read a host secret, wrote it
  into the container's ld cache, planted keys in root's and another container's keyrings);
- rlimits are per process, RLIMIT_NPROC does not bind the host's root user, and memfd and
  SysV shared memory count against no address space: a compromised ldconfig forked 31,578
  processes (host forks failed) and held 1.9 GiB in memfds until the hook's deadline (B2).

`deny` builds a classic BPF program that returns EPERM for each of the named calls, for any
call of another ABI than the kernel's own (i386 or x32 on x86_64), and allows everything else;
`install` loads it (no_new_privs must be set: gpuhook.kernel.linux.drop_held_capabilities).
A filter outlives execve: it is the last thing installed before the exec.

System call numbers are per architecture: x86_64 from asm/unistd_64.h, aarch64 from
asm-generic/unistd.h (tests/unit/test_seccomp.py compares them with the headers where they
are installed). gpuhook runs on these two; elsewhere `deny` raises OSError (ENOSYS).
"""

import ctypes
import os
import struct

from gpuhook.kernel import linux

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
EPERM = 1
X32_SYSCALL_BIT = 0x40000000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR_OFFSET, ARCH_OFFSET = 0, 4
# classic BPF opcodes (linux/filter.h, linux/bpf_common.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# call -> (x86_64 number, aarch64 number); None where that architecture has no such call
# (aarch64 has no fork, vfork or inotify_init: clone and inotify_init1 do their work)
_CALLS = {
    "fork": (57, None),
    "vfork": (58, None),
    "clone": (56, 220),
    "clone3": (435, 435),
    "unshare": (272, 97),
    "setns": (308, 268),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "keyctl": (250, 219),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "userfaultfd": (323, 282),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "prctl": (157, 167),
    "semget": (64, 190),
    "msgget": (68, 186),
    "mq_open": (240, 180),
    "io_setup": (206, 0),
    "inotify_init": (253, None),
    "inotify_init1": (294, 26),
    "fanotify_init": (300, 262),
    "flock": (73, 32),
    "sysinfo": (99, 179),
    "sync": (162, 81),
    "syncfs": (306, 267),
    "fcntl": (72, 25),
}
NUMBERS = {machine: {name: pair[i] for name, pair in _CALLS.items() if pair[i] is not None}
           for i, machine in enumerate(("x86_64", "aarch64"))}

# What the host's ldconfig never calls and a compromised one must not (attacker passes 13 and
# 14): new processes or threads (it is one process: no fork bomb, and its 512 MiB address space
# is all the memory it has), new namespaces (a user namespace of its own would let it mount
# tmpfs without a size limit), the keyrings, memory outside its address space or counted host-
# wide (memfd, SysV shm, semaphores and message queues, POSIX queues, AIO contexts, io_uring,
# userfaultfd), host-wide quotas of root (inotify, fanotify), locks and leases on the host's
# driver files it sees (flock here, fcntl's lock and lease commands in LDCONFIG_DENIED_ARGS),
# other processes' memory, BPF and perf, the mount API, sockets (its network namespace has none
# to reach; a socket file in the image would still take a connect), prctl's PR_SET_PDEATHSIG
# (dropping it let it outlive the hook), the host's uptime, process count and memory (sysinfo),
# and a host-wide sync.
F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE = 6, 7, 37, 38, 1024
PR_SET_PDEATHSIG = 1
# call -> (argument index, values refused): fcntl may still read flags, not lock or lease;
# prctl may still read (capability bounding set, no_new_privs), not drop its parent-death signal
LDCONFIG_DENIED_ARGS = {"fcntl": (1, (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE)),
                        "prctl": (0, (PR_SET_PDEATHSIG,))}
LDCONFIG_DENIED = tuple(name for name in _CALLS if name not in LDCONFIG_DENIED_ARGS)
ARGS_OFFSET = 16  # seccomp_data.args[0]; each argument is 8 bytes, its low half first (little-endian)


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def deny(names, machine: str | None = None, args: dict | None = None) -> bytes:
    """The filter program (struct sock_filter[] as bytes) that refuses `names` with EPERM on
    `machine` (default: this one's), and the calls of `args` (name -> (argument index,
    values)) whose argument is one of those values (compared on its low 32 bits); names this
    architecture has no call for are skipped."""
    machine = machine or os.uname().machine
    if machine not in AUDIT_ARCH:
        raise OSError(38, f"seccomp: unsupported architecture {machine}")  # ENOSYS
    table = NUMBERS[machine]
    numbers = sorted({table[name] for name in names if name in table})
    refuse = (RET_K, None, None, SECCOMP_RET_ERRNO | EPERM)
    # (code, jt, jf, k) with "R" for a jump to the final refusal, resolved below
    program = [(LD_W_ABS, 0, 0, ARCH_OFFSET),
               (JEQ_K, 1, 0, AUDIT_ARCH[machine]),  # the kernel's own ABI: go on
               refuse,  # i386 (int 0x80) on x86_64, aarch32 on aarch64: other numbers, refused
               (LD_W_ABS, 0, 0, NR_OFFSET)]
    if machine == "x86_64":  # x32 calls carry this bit: refused whatever their number
        program.append((JGE_K, "R", 0, X32_SYSCALL_BIT))
    program += [(JEQ_K, "R", 0, number) for number in numbers]
    for name, (index, values) in sorted((args or {}).items()):
        if name not in table:
            continue
        block = [(LD_W_ABS, 0, 0, ARGS_OFFSET + 8 * index)]
        block += [(JEQ_K, "R", 0, value) for value in values]
        block.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
        program.append((JEQ_K, 0, len(block), table[name]))  # not this call: past its block
        program += block
    program.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
    program.append(refuse)
    end = len(program) - 1
    out = []
    for at, (code, jt, jf, k) in enumerate(program):
        if jt == "R":
            jt = end - at - 1
            if jt > 255:
                raise ValueError("seccomp: too many calls for one program")
        out.append(_instruction(code, jt or 0, jf or 0, k))
    return b"".join(out)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes) -> None:
    """Load `program` (from `deny`) as this thread's seccomp filter; it holds for whatever this
    process executes. Needs no_new_privs (or CAP_SYS_ADMIN). Raises OSError."""
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _Fprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    linux._check(linux._libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                                   ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl PR_SET_SECCOMP")
