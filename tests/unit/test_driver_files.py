"""Where discovery takes the driver's programs and libraries from, on literal driver trees:
ELF files only (a shell wrapper is never mounted), the layouts' own dirs, the operator's."""

import os

import pytest
from test_elf import I386, STATIC, elf_bytes, write

from gpuhook.discover import driverfiles as discover
from gpuhook.errors import HostError

VERSION = "580.159.04"
GKE_WRAPPER = b"#!/bin/sh\nexport LD_LIBRARY_PATH=/usr/local/nvidia/lib64\nexec /usr/local/nvidia/bin/nvidia-smi \"$@\"\n"


def test_a_wrapper_script_is_skipped_for_the_real_program_in_the_drivers_own_dir(tmp_path):
    write(tmp_path / "usr/bin/nvidia-smi", GKE_WRAPPER)
    write(tmp_path / "usr/local/nvidia/bin/nvidia-smi", STATIC)
    write(tmp_path / "usr/bin/nvidia-debugdump", STATIC)
    lookup = discover.find_binaries(str(tmp_path))
    found = {f.container_path: f.host_path for f in lookup.found}
    assert found == {"/usr/bin/nvidia-smi": str(tmp_path / "usr/local/nvidia/bin/nvidia-smi"),
                     "/usr/bin/nvidia-debugdump": str(tmp_path / "usr/bin/nvidia-debugdump")}
    assert lookup.skipped == ((str(tmp_path / "usr/bin/nvidia-smi"), "not an ELF file (a script)"),)


def test_only_the_named_bin_dirs_are_searched(tmp_path):
    write(tmp_path / "usr/bin/nvidia-smi", STATIC)
    write(tmp_path / "opt/driver/bin/nvidia-smi", STATIC)
    found = discover.binaries(str(tmp_path), ["/opt/driver/bin"])
    assert [f.host_path for f in found] == [str(tmp_path / "opt/driver/bin/nvidia-smi")]


def test_a_link_out_of_the_driver_root_is_not_followed(tmp_path):
    (tmp_path / "usr/bin").mkdir(parents=True)
    os.symlink("/bin/true", tmp_path / "usr/bin/nvidia-smi")  # means <root>/bin/true, which is missing
    assert discover.binaries(str(tmp_path)) == ()


def lib(tmp_path, directory, name, soname, bits=64):
    return write(tmp_path / directory.lstrip("/") / name,
                 elf_bytes(bits, soname=soname, machine=62 if bits == 64 else I386), 0o644)


def test_libraries_in_a_layout_dir_no_ld_cache_lists(tmp_path):
    """GKE: /usr/local/nvidia/lib64 and lib, files and soname links, and an old version left
    behind; the driver root has no ld cache at all."""
    cuda = lib(tmp_path, "/usr/local/nvidia/lib64", f"libcuda.so.{VERSION}", "libcuda.so.1")
    os.symlink(f"libcuda.so.{VERSION}", tmp_path / "usr/local/nvidia/lib64/libcuda.so.1")
    lib(tmp_path, "/usr/local/nvidia/lib64", "libcuda.so.550.54.15", "libcuda.so.1")
    ml = lib(tmp_path, "/usr/local/nvidia/lib64", f"libnvidia-ml.so.{VERSION}", "libnvidia-ml.so.1")
    gpucomp = lib(tmp_path, "/usr/local/nvidia/lib64", f"libnvidia-gpucomp.so.{VERSION}", f"libnvidia-gpucomp.so.{VERSION}")
    cuda32 = lib(tmp_path, "/usr/local/nvidia/lib", f"libcuda.so.{VERSION}", "libcuda.so.1", bits=32)
    write(tmp_path / "usr/local/nvidia/lib64/libnvidia-cfg.so.1", b"#!/bin/sh\n", 0o644)  # not a library
    lib(tmp_path, "/usr/local/nvidia/lib64", "libfoo.so.1", "libfoo.so.1")  # not the driver's
    found = {(lib_.host_path, lib_.bits): (lib_.sonames, lib_.capability) for lib_ in
             discover.libraries(str(tmp_path), machine="x86_64", version=VERSION)}
    assert found == {
        (cuda, 64): (("libcuda.so.1", "libcuda.so"), "compute"),
        (cuda32, 32): (("libcuda.so.1", "libcuda.so"), "compute"),
        (gpucomp, 64): ((), "compute"),
        (ml, 64): (("libnvidia-ml.so.1",), "utility"),
    }


def test_named_lib_dirs_replace_the_ld_cache(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.cache").write_bytes(b"garbage")  # never read when dirs are named
    ml = lib(tmp_path, "/opt/nvidia/lib", f"libnvidia-ml.so.{VERSION}", "libnvidia-ml.so.1")
    found = discover.libraries(str(tmp_path), machine="x86_64", lib_dirs=["/opt/nvidia/lib"], version=VERSION)
    assert [(lib_.host_path, lib_.sonames) for lib_ in found] == [(ml, ("libnvidia-ml.so.1",))]


def test_without_an_ld_cache_or_a_library_for_this_machine_the_missing_cache_is_the_error(tmp_path):
    lib(tmp_path, "/usr/local/nvidia/lib64", f"libcuda.so.{VERSION}", "libcuda.so.1")  # an x86_64 library
    with pytest.raises(HostError, match="no ld cache at"):
        discover.libraries(str(tmp_path), machine="aarch64", version=VERSION)
