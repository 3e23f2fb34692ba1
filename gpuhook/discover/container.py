"""What the image offers: its library directories and whether it is a glibc image.

Read from the container's rootfs before it is pivoted to, every path resolved inside it
(gpuhook.kernel.paths); nothing of the image is run or trusted beyond existing.
"""

import os

from gpuhook.driver import MULTIARCH
from gpuhook.record import record


class ContainerFacts(record("ContainerFacts", "lib64 lib32 glibc")):
    """What the plan needs to know about the image: its library dirs, and whether it is a
    glibc image (has an ld cache, ld.so.conf or glibc's loader) whose ld cache to update."""

    __slots__ = ()


GLIBC_MARKERS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/lib64/ld-linux-x86-64.so.2",
                 "/lib/ld-linux-aarch64.so.1", "/lib64/ld64.so.2")


def container_facts(rootfs: str, config, machine: str | None = None) -> ContainerFacts:
    """Read the image (never follow its symlinks out of it) for the plan.

    Debian-family images (an /etc/debian_version, or the multiarch dir already there) use
    /usr/lib/<multiarch>; everything else /usr/lib64 (and /usr/lib for 32-bit). An image
    without glibc (busybox, distroless static) has no ld cache to update: NVIDIA's toolkit
    skips ldconfig there too.
    """
    from gpuhook.errors import InputError
    from gpuhook.kernel.paths import exists_in_root

    machine = machine or os.uname().machine
    multiarch = MULTIARCH.get(machine, f"{machine}-linux-gnu")
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise InputError(f"container rootfs {rootfs}: {err.strerror}") from err

    def exists(path):
        return exists_in_root(root, path)

    try:
        glibc = any(exists(p) for p in GLIBC_MARKERS)
        if config.container_lib_dir:
            lib64, lib32 = config.container_lib_dir, "/usr/lib/i386-linux-gnu"
        elif exists("/etc/debian_version") or exists(f"/usr/lib/{multiarch}"):
            lib64, lib32 = f"/usr/lib/{multiarch}", "/usr/lib/i386-linux-gnu"
        else:
            lib64, lib32 = "/usr/lib64", "/usr/lib"
    finally:
        os.close(root)
    return ContainerFacts(lib64, lib32, glibc)
