"""The ld cache reader (gpuhook.discover.ldcache) on a cache a real ldconfig wrote
(tests/data/host-ldcache), and on damaged copies of it."""

import os

import pytest

from gpuhook.discover import ldcache
from gpuhook.errors import HostError

CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "host-ldcache",
                     "ld.so.cache")
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def data() -> bytes:
    with open(CACHE, "rb") as f:
        return f.read()


def test_every_entry_with_its_soname_path_and_x86_64_flags():
    entries = ldcache.read(CACHE)
    assert sorted((e.soname, e.path) for e in entries) == sorted(
        (soname, f"{LIBDIR}/{soname}")
        for soname in ("libnvidia-ml.so.1", "libcuda.so.1", "libnvidia-ptxjitcompiler.so.1", "libGLX_nvidia.so.0"))
    assert {e.arch_flags for e in entries} == {ldcache.ARCH_FLAGS["x86_64"]}


@pytest.mark.parametrize("damage,message", [
    (lambda b: b.replace(ldcache.MAGIC, b"x" * len(ldcache.MAGIC)), "not a glibc ld.so.cache"),
    (lambda b: b[: b.find(ldcache.MAGIC) + 30], "truncated header"),
    (lambda b: b[: b.find(ldcache.MAGIC) + 48 + 30], "claims 4 entries but is only"),
    # The first entry's soname offset pointed past the end of the file.
    (lambda b: b[: b.find(ldcache.MAGIC) + 52] + (1 << 30).to_bytes(4, "little") + b[b.find(ldcache.MAGIC) + 56:],
     "string offset 1073741824 out of range"),
])
def test_a_damaged_cache_is_a_host_error_naming_the_damage(damage, message):
    with pytest.raises(HostError) as caught:
        ldcache.parse(damage(data()), "ld.so.cache")
    assert message in caught.value.one_line()


def test_a_missing_cache_says_what_to_run(tmp_path):
    with pytest.raises(HostError) as caught:
        ldcache.read(str(tmp_path / "ld.so.cache"))
    assert "run ldconfig on the driver root" in caught.value.one_line()
