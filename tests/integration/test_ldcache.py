"""The ld.so.cache reader, checked against glibc's own `ldconfig -p` on real caches."""

import re
import subprocess
import pytest
from gpuhook.discover import ldcache
from conftest import require


def ldconfig_p(path):
    out = subprocess.run(["ldconfig", "-p", "-C", path], capture_output=True, text=True, check=True).stdout
    return {(m.group(1), m.group(2)) for m in re.finditer(r"^\s+(\S+) \(.*\) => (\S+)$", out, re.M)}


@pytest.mark.parametrize("which", ["host", "simulated"])
def test_reader_agrees_with_ldconfig(which, request):
    if which == "host":
        path = "/etc/ld.so.cache"
    else:
        sim = request.getfixturevalue("sim_host")
        path = f"{sim['directory']}/driver/etc/ld.so.cache"
    require(subprocess.run(["which", "ldconfig"], capture_output=True).returncode == 0, "needs ldconfig")
    ours = {(e.soname, e.path) for e in ldcache.read(path)}
    assert ours == ldconfig_p(path)
    assert ours


def test_simulated_cache_has_64_bit_flags(sim_host):
    entries = ldcache.read(f"{sim_host['directory']}/driver/etc/ld.so.cache")
    cuda = [e for e in entries if e.soname == "libcuda.so.1"]
    assert cuda and cuda[0].arch_flags == ldcache.ARCH_FLAGS["x86_64"]
