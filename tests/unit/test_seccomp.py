"""gpuhook.kernel.seccomp: the deny-list filter the host's ldconfig runs under."""

import os
import re

import pytest

from gpuhook.kernel import linux, seccomp

HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}


@pytest.mark.parametrize("machine", sorted(seccomp.NUMBERS))
def test_the_numbers_are_the_kernel_headers(machine):
    """Each architecture's table against its header (skipped where the header is not installed:
    linux-libc-dev, which scripts/setup's gcc brings)."""
    path = HEADERS[machine]
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed")
    with open(path) as f:
        defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", f.read())}
    for name, number in seccomp.NUMBERS[machine].items():
        assert defined.get(name) == number, (machine, name)


def _in_child(action) -> int:
    """The errno of `action` (0: it worked) in a forked child under the ldconfig filter."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.close(read_end)
            linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
            seccomp.install(seccomp.deny(seccomp.LDCONFIG_DENIED, args=seccomp.LDCONFIG_DENIED_ARGS))
            try:
                action()
                err = 0
            except OSError as error:
                err = error.errno
            os.write(write_end, str(err).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    data = os.read(read_end, 100).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    return int(data)


@pytest.mark.skipif(os.uname().machine not in seccomp.AUDIT_ARCH, reason="no table for this architecture")
def test_denied_calls_fail_with_eperm_and_others_work():
    assert _in_child(lambda: os.memfd_create("x")) == 1
    assert _in_child(lambda: linux.unshare(0x10000000)) == 1  # CLONE_NEWUSER
    assert _in_child(lambda: os.fork()) == 1
    assert _in_child(lambda: os.close(os.open("/dev/null", os.O_RDONLY))) == 0
    assert _in_child(lambda: linux.prctl_set_pdeathsig(0)) == 1  # it would outlive the hook


def _locks(command: int):
    import fcntl

    def action():
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            fcntl.fcntl(fd, fcntl.F_GETFL)  # reading flags stays allowed
            if command == -1:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            else:
                fcntl.fcntl(fd, command, 0)
        finally:
            os.close(fd)
    return action


@pytest.mark.skipif(os.uname().machine not in seccomp.AUDIT_ARCH, reason="no table for this architecture")
@pytest.mark.parametrize("command", [-1, seccomp.F_SETLEASE, seccomp.F_SETLK, seccomp.F_OFD_SETLK])
def test_locks_and_leases_are_refused_fcntl_flags_are_not(command):
    """A compromised ldconfig took a lease and locks on the host's driver files it sees
    (attacker pass 14): flock, and fcntl's lock and lease commands, are refused."""
    assert _in_child(_locks(command)) == 1


def test_a_program_jumps_past_every_check_to_the_refusal():
    """Classic BPF: jt of check i skips the checks after it and the allow (8 bytes each)."""
    program = seccomp.deny(["keyctl", "add_key"], "x86_64")
    codes = [program[i:i + 8] for i in range(0, len(program), 8)]
    assert len(codes) == 4 + 3 + 2  # head, the x32 bit and two numbers, allow and refuse
    assert [c[2] for c in codes[4:7]] == [3, 2, 1]
    with pytest.raises(OSError):
        seccomp.deny(["keyctl"], "ppc64le")
