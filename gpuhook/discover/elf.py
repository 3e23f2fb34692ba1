"""What an ELF file says about itself, read from its headers without loading it.

Discovery uses it to tell the driver's real programs and libraries from the shell wrappers
some layouts put in front of them (docs/driver-layouts.md), to read a library's soname where
no ld cache lists it, and to find a statically linked ldconfig. Everything is bounded: a
header of 64 bytes, at most MAX_PHNUM program headers, a dynamic section of at most
MAX_DYNAMIC bytes and a soname of at most MAX_SONAME bytes. Layouts: the System V ABI's
"ELF header", "Program header" and "Dynamic section" (elf(5)).
"""

import os

from gpuhook.record import record

MAGIC = b"\x7fELF"
ELFCLASS32, ELFCLASS64 = 1, 2
ELFDATA2LSB = 1
ET_EXEC, ET_DYN = 2, 3
PT_LOAD, PT_DYNAMIC, PT_INTERP = 1, 2, 3
DT_NULL, DT_STRTAB, DT_SONAME = 0, 5, 14
MAX_PHNUM = 256
MAX_DYNAMIC = 64 << 10
MAX_SONAME = 256
# e_machine values (elf.h) for the machines gpuhook runs on.
MACHINES = {"x86_64": 62, "aarch64": 183, "ppc64le": 21}
EM_386 = 3


class ElfFile(record("ElfFile", "bits machine kind interpreter soname")):
    """An ELF file's facts: `bits` 32 or 64, `machine` its e_machine, `kind` "exec" or
    "dyn" (a PIE or a shared library), `interpreter` whether it names a dynamic loader
    (PT_INTERP: a statically linked program has none), `soname` its DT_SONAME or None."""

    __slots__ = ()

    @property
    def static(self) -> bool:
        return not self.interpreter


class NotElf(ValueError):
    """The file is not an ELF file gpuhook can read (a script, a truncated or odd file)."""


def read_fd(fd: int) -> ElfFile:
    """The facts of the ELF file open as `fd`; raises NotElf, or OSError on a read error."""
    head = os.pread(fd, 64, 0)
    if head[:4] != MAGIC:
        raise NotElf("not an ELF file" + (" (a script)" if head[:2] == b"#!" else ""))
    if len(head) < 52 or head[4] not in (ELFCLASS32, ELFCLASS64):
        raise NotElf("a truncated or unknown ELF header")
    bits = 64 if head[4] == ELFCLASS64 else 32
    order = "little" if head[5] == ELFDATA2LSB else "big"

    def field(data: bytes, offset: int, size: int) -> int:
        return int.from_bytes(data[offset:offset + size], order)

    e_type, machine = field(head, 16, 2), field(head, 18, 2)
    if e_type not in (ET_EXEC, ET_DYN):
        raise NotElf("an ELF file that is neither a program nor a shared library")
    if bits == 64:
        if len(head) < 64:
            raise NotElf("a truncated ELF header")
        phoff, phentsize, phnum = field(head, 32, 8), field(head, 54, 2), field(head, 56, 2)
    else:
        phoff, phentsize, phnum = field(head, 28, 4), field(head, 42, 2), field(head, 44, 2)
    minimum = 56 if bits == 64 else 32
    if phentsize < minimum or phnum > MAX_PHNUM:
        raise NotElf("a malformed ELF program header table")
    table = os.pread(fd, phentsize * phnum, phoff)
    if len(table) < phentsize * phnum:
        raise NotElf("a truncated ELF program header table")
    loads, dynamic, interpreter = [], None, False
    for i in range(phnum):
        entry = table[i * phentsize:(i + 1) * phentsize]
        if bits == 64:
            p_type, offset, vaddr, filesz = field(entry, 0, 4), field(entry, 8, 8), field(entry, 16, 8), field(entry, 32, 8)
        else:
            p_type, offset, vaddr, filesz = field(entry, 0, 4), field(entry, 4, 4), field(entry, 8, 4), field(entry, 16, 4)
        if p_type == PT_INTERP:
            interpreter = True
        elif p_type == PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (offset, filesz)
    soname = _soname(fd, bits, field, dynamic, loads) if dynamic else None
    return ElfFile(bits, machine, "exec" if e_type == ET_EXEC else "dyn", interpreter, soname)


def _soname(fd: int, bits: int, field, dynamic: tuple, loads: list):
    """DT_SONAME: an offset into the string table DT_STRTAB names by virtual address."""
    offset, size = dynamic
    data = os.pread(fd, min(size, MAX_DYNAMIC), offset)
    step = 16 if bits == 64 else 8
    half = step // 2
    strtab = soname = None
    for i in range(0, len(data) - step + 1, step):
        tag, value = field(data, i, half), field(data, i + half, half)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = value
        elif tag == DT_SONAME:
            soname = value
    if strtab is None or soname is None:
        return None
    for vaddr, file_offset, filesz in loads:  # the string table's file offset, from its segment
        if vaddr <= strtab < vaddr + filesz:
            raw = os.pread(fd, MAX_SONAME, file_offset + strtab - vaddr + soname)
            name = raw.split(b"\0", 1)[0]
            if not name or len(name) == len(raw):
                return None
            return name.decode("utf-8", "replace")
    return None


def read(path: str) -> ElfFile:
    """`read_fd` of the file at `path` (followed if a symlink; never blocks on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)


def bits_on(info: ElfFile, machine: str) -> int | None:
    """64 or 32 when `info` runs on `machine` (os.uname().machine) as a 64-bit or a 32-bit
    (compat32: i386 on x86_64) binary, None for another machine's file."""
    native = MACHINES.get(machine)
    if info.bits == 64 and info.machine == native:
        return 64
    if info.bits == 32 and machine == "x86_64" and info.machine == EM_386:
        return 32
    return None
