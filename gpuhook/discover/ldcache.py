"""Reader for glibc's /etc/ld.so.cache: where the host's driver libraries are.

Only the "new" format is read (``glibc-ld.so.cache1.1``, written by every glibc since 2.32
and, behind the old header, by older ones). Layout, from glibc's sysdeps/generic/dl-cache.h:
a 48-byte header (magic, version, nlibs, len_strings, flags, extension offset), then nlibs
24-byte entries {int32 flags; uint32 key; uint32 value; uint32 osversion; uint64 hwcap},
where key (the soname) and value (the path) are offsets of NUL-terminated strings counted
from the start of the new header.
"""


from gpuhook.errors import HostError
from gpuhook.record import record

MAGIC = b"glibc-ld.so.cache1.1"
_HEADER = 48
_ENTRY = 24

FLAG_ELF_LIBC6 = 0x0003
FLAG_TYPE_MASK = 0x00FF
FLAG_ARCH_MASK = 0xFF00
# Architecture bits of 64-bit entries, by `uname -m`; 0 means "no arch bits" (e.g. i386).
ARCH_FLAGS = {
    "x86_64": 0x0300,
    "aarch64": 0x0A00,
    "ppc64le": 0x0500,
    "i386": 0x0000,
}


class Entry(record("Entry", "soname path flags")):
    __slots__ = ()

    @property
    def arch_flags(self) -> int:
        return self.flags & FLAG_ARCH_MASK


def parse(data: bytes, where: str = "ld.so.cache") -> list[Entry]:
    """All ELF libc6 entries of a cache file, in cache order."""
    base = data.find(MAGIC)
    if base < 0:
        raise HostError(f"{where}: not a glibc ld.so.cache (no {MAGIC.decode()} header)")
    if len(data) < base + _HEADER:
        raise HostError(f"{where}: truncated header")
    nlibs = int.from_bytes(data[base + 20 : base + 24], "little")
    if base + _HEADER + nlibs * _ENTRY > len(data):
        raise HostError(f"{where}: claims {nlibs} entries but is only {len(data)} bytes")

    def string_at(offset: int) -> str:
        start = base + offset
        end = data.find(b"\0", start)
        if offset <= 0 or start >= len(data) or end < 0:
            raise HostError(f"{where}: string offset {offset} out of range")
        return data[start:end].decode("utf-8", "surrogateescape")

    entries = []
    pos = base + _HEADER
    for _ in range(nlibs):
        flags = int.from_bytes(data[pos : pos + 4], "little", signed=True)
        key = int.from_bytes(data[pos + 4 : pos + 8], "little")
        value = int.from_bytes(data[pos + 8 : pos + 12], "little")
        pos += _ENTRY
        if flags & FLAG_TYPE_MASK != FLAG_ELF_LIBC6:
            continue
        entries.append(Entry(string_at(key), string_at(value), flags))
    return entries


def read(path: str) -> list[Entry]:
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except FileNotFoundError:
        raise HostError(f"no ld cache at {path}", "run ldconfig on the driver root") from None
    except OSError as err:
        raise HostError(f"cannot read ld cache {path}: {err.strerror}") from err
    return parse(data, path)
