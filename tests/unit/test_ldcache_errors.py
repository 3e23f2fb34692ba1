"""The ld.so.cache reader, checked against glibc's own `ldconfig -p` on real caches.

The tests of it that need no root; those that do are in tests/integration/test_ldcache.py.
"""

import pytest
from gpuhook.discover import ldcache
from gpuhook.errors import HostError


@pytest.mark.parametrize("data,message", [
    (b"", "not a glibc ld.so.cache"),
    (b"ld.so-1.7.0" + b"\0" * 40, "not a glibc ld.so.cache"),
    (ldcache.MAGIC + b"\0" * 4, "truncated header"),
    (ldcache.MAGIC + (1000).to_bytes(4, "little") + b"\0" * 24, "claims 1000 entries"),
])
def test_damaged_caches_are_errors(data, message):
    with pytest.raises(HostError, match=message):
        ldcache.parse(data, "x")


def test_string_offset_out_of_range_is_an_error():
    header = ldcache.MAGIC + (1).to_bytes(4, "little") + b"\0" * 24
    entry = (3).to_bytes(4, "little") + (9999).to_bytes(4, "little") * 2 + b"\0" * 12
    with pytest.raises(HostError, match="out of range"):
        ldcache.parse(header + entry, "x")


def test_missing_cache_names_the_fix(tmp_path):
    with pytest.raises(HostError) as err:
        ldcache.read(str(tmp_path / "ld.so.cache"))
    assert "run ldconfig" in err.value.one_line()
