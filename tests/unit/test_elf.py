"""gpuhook.discover.elf on literal ELF files built here byte by byte (System V ABI layouts), and the
host ldconfig lookup (gpuhook.discover.driverfiles.find_ldconfig) on literal distribution trees."""

import os
import struct

import pytest

from gpuhook.discover import elf
from gpuhook.discover import driverfiles as discover

X86_64, I386, AARCH64 = 62, 3, 183


def elf_bytes(bits=64, interpreter=False, soname=None, machine=X86_64, e_type=elf.ET_DYN) -> bytes:
    """A minimal ELF file: one PT_LOAD mapping the whole file at address 0, PT_INTERP if asked,
    and a PT_DYNAMIC whose DT_STRTAB/DT_SONAME name `soname`."""
    wide = bits == 64
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    phnum = 2 + bool(interpreter)
    strtab_at = ehsize + phentsize * phnum
    strings = b"\0" + (soname.encode() + b"\0" if soname else b"") + b"/lib64/ld-linux-x86-64.so.2\0"
    interp_at = strtab_at + (1 + len(soname) + 1 if soname else 1)
    dynamic_at = strtab_at + len(strings)
    entries = [(elf.DT_STRTAB, strtab_at)] + ([(elf.DT_SONAME, 1)] if soname else []) + [(elf.DT_NULL, 0)]
    dynamic = b"".join(struct.pack("<qQ" if wide else "<iI", tag, value) for tag, value in entries)
    total = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1, 1]) + bytes(9)
    if wide:
        header = ident + struct.pack("<HHIQQQIHHHHHH", e_type, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, phnum,
                                     0, 0, 0)
    else:
        header = ident + struct.pack("<HHIIIIIHHHHHH", e_type, machine, 1, 0, ehsize, 0, 0, ehsize, phentsize, phnum,
                                     0, 0, 0)

    def phdr(p_type, offset, size):
        if wide:
            return struct.pack("<IIQQQQQQ", p_type, 5, offset, offset, offset, size, size, 8)
        return struct.pack("<IIIIIIII", p_type, offset, offset, offset, size, size, 5, 4)

    phdrs = phdr(elf.PT_LOAD, 0, total) + phdr(elf.PT_DYNAMIC, dynamic_at, len(dynamic))
    if interpreter:
        phdrs += phdr(elf.PT_INTERP, interp_at, len(b"/lib64/ld-linux-x86-64.so.2\0"))
    return header + phdrs + strings + dynamic


def write(path, data: bytes, mode=0o755):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("bits", [64, 32])
def test_a_shared_librarys_soname_class_and_machine(tmp_path, bits):
    machine = X86_64 if bits == 64 else I386
    info = elf.read(write(tmp_path / "libcuda.so.580.159.04", elf_bytes(bits, soname="libcuda.so.1", machine=machine)))
    assert info == elf.ElfFile(bits, machine, "dyn", False, "libcuda.so.1")
    assert elf.bits_on(info, "x86_64") == bits and elf.bits_on(info, "aarch64") is None


def test_static_and_dynamic_programs(tmp_path):
    static = elf.read(write(tmp_path / "ldconfig", elf_bytes(e_type=elf.ET_EXEC)))
    dynamic = elf.read(write(tmp_path / "true", elf_bytes(interpreter=True)))
    assert (static.kind, static.static, static.soname) == ("exec", True, None)
    assert (dynamic.kind, dynamic.static) == ("dyn", False)


@pytest.mark.parametrize("data,why", [
    (b"#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi \"$@\"\n", "a script"),
    (b"", "not an ELF file"),
    (b"\x7fELF\x02\x01\x01", "truncated"),
    (elf_bytes()[:100], "truncated"),
    (elf_bytes(e_type=1), "neither a program nor a shared library"),  # ET_REL: an object file
])
def test_what_is_not_a_readable_elf_file_says_why(tmp_path, data, why):
    with pytest.raises(elf.NotElf, match=why):
        elf.read(write(tmp_path / "f", data))


def test_a_soname_outside_every_segment_reads_as_none(tmp_path):
    data = bytearray(elf_bytes(soname="libx.so.1"))
    data[64 + 32:64 + 40] = b"\0" * 8  # PT_LOAD's p_filesz: the segment maps no bytes of the file
    assert elf.read(write(tmp_path / "libx.so.1", bytes(data))).soname is None


STATIC = elf_bytes(e_type=elf.ET_EXEC)
DYNAMIC = elf_bytes(interpreter=True)
UBUNTU_WRAPPER = b"#!/bin/sh\nexec /sbin/ldconfig.real \"$@\"\n"


@pytest.mark.parametrize("tree,found", [
    ({"sbin/ldconfig": STATIC}, "/sbin/ldconfig"),  # Debian
    ({"sbin/ldconfig": UBUNTU_WRAPPER, "sbin/ldconfig.real": STATIC}, "/sbin/ldconfig.real"),  # Ubuntu
    ({"usr/sbin/ldconfig": STATIC}, "/usr/sbin/ldconfig"),  # RHEL, Fedora (no /sbin link here)
    ({"usr/bin/ldconfig": STATIC}, "/usr/bin/ldconfig"),  # Arch, Fedora 42
    ({"sbin/ldconfig": DYNAMIC, "usr/sbin/ldconfig": STATIC}, "/usr/sbin/ldconfig"),
])
def test_the_hosts_static_ldconfig_is_found_where_each_distribution_puts_it(tmp_path, tree, found):
    for name, data in tree.items():
        write(tmp_path / name, data)
    result = discover.find_ldconfig("", root=str(tmp_path))
    assert result.path == str(tmp_path) + found and result.problem is None


def test_without_one_on_the_host_the_driver_containers_own_is_taken(tmp_path):
    write(tmp_path / "host/sbin/ldconfig", b"#!/bin/sh\n# musl: nothing to do\n")
    write(tmp_path / "driver/sbin/ldconfig", UBUNTU_WRAPPER)
    write(tmp_path / "driver/sbin/ldconfig.real", STATIC)
    result = discover.find_ldconfig("", driver_root=str(tmp_path / "driver"), root=str(tmp_path / "host"))
    assert result.path == str(tmp_path / "driver/sbin/ldconfig.real") and "ldconfig.real" in result.note


def test_no_static_ldconfig_anywhere_is_one_problem_with_a_hint(tmp_path):
    write(tmp_path / "sbin/ldconfig", UBUNTU_WRAPPER)
    result = discover.find_ldconfig("", root=str(tmp_path))
    assert result.path is None
    assert "no static ldconfig on this host" in result.problem and "not an ELF binary" in result.problem
    assert "libc-bin" in result.hint


def test_a_configured_wrapper_gives_way_to_its_real_sibling_and_nothing_else(tmp_path):
    wrapper = write(tmp_path / "sbin/ldconfig", UBUNTU_WRAPPER)
    write(tmp_path / "sbin/ldconfig.real", STATIC)
    result = discover.find_ldconfig(wrapper)
    assert result.path == wrapper + ".real" and "not a static ELF binary" in result.note
    assert discover.find_ldconfig(wrapper + ".real").path == wrapper + ".real"
    os.unlink(wrapper + ".real")
    refused = discover.find_ldconfig(wrapper)
    assert refused.path is None and "is not an ELF binary" in refused.problem
    dynamic = write(tmp_path / "bin/ldconfig", DYNAMIC)
    assert "dynamically linked" in discover.find_ldconfig(dynamic).problem
    assert "No such file" in discover.find_ldconfig(str(tmp_path / "nope")).problem
