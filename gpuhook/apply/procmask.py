"""The worker's mask over the container's /proc/driver/nvidia, and its undo.

NVIDIA's driver shows every GPU of the host under /proc/driver/nvidia, and its `params` let a
process with the right capability make device nodes (ModifyDeviceFiles). The container gets
a read-only tmpfs there instead, holding a copy of `params` with ModifyDeviceFiles: 0,
`version`, `registry`, the capability files of its own MIG devices (read by the hook on the
host side: gpuhook.apply.run.read_proc_files) and read-only binds of its own GPUs' directories
only. The tmpfs is recorded in the target's mounts (gpuhook.apply.mounts.Mounts) by its fd, so
undo finds it wherever it is by then; it lands only on the container's own procfs, on a mount
that does not propagate.
"""

import errno
import os

from gpuhook.apply.target import ALWAYS_ANSWERS
from gpuhook.kernel import linux, mountinfo, paths
from gpuhook.plan.records import ProcMask


def mask_proc(target, files: dict) -> None:
    """The step "mask /proc/driver/nvidia": `files` are the mask's contents by relative path."""
    try:
        point = paths.open_in_root(target.root, ProcMask.target, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        target.notes.append(f"container /proc has no driver/nvidia (no NVIDIA kernel module, e.g. a "
                            f"simulated host): {ProcMask.target} not masked")
        return
    gpu_fds = []
    try:
        for bus in target.plan.proc_mask.gpu_buses:
            gpu_fds.append((bus, paths.open_in_root(
                target.root, f"{ProcMask.target}/gpus/{bus}", os.O_PATH | os.O_DIRECTORY)))
        mount = mountinfo.mount_id(point)
        entry = target.mount_entry(mount)
        if mount != target.root_mount and (entry is None or entry.fstype not in ALWAYS_ANSWERS):
            raise paths.OtherMountError(errno.EXDEV, "is on a volume, not the container's procfs", ProcMask.target)
        target.refuse_shared(mount, ProcMask.target)
        linux.mount("tmpfs", linux.fd_path(point), "tmpfs",
                    linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, "mode=0555,size=1m")
        target.mounts.add(ProcMask.target)
        top = paths.open_in_root(target.root, ProcMask.target, os.O_RDONLY | os.O_DIRECTORY)
        if os.fstat(top).st_dev == os.fstat(point).st_dev:
            os.close(top)
            raise OSError(16, "changed under us while mounting", ProcMask.target)
        target.mounts.made[-1] = (ProcMask.target, os.dup(top))  # undo by fd, wherever it is by then
        try:
            _fill(top, files)
            if gpu_fds:
                os.mkdir("gpus", 0o555, dir_fd=top)
                for bus, fd in gpu_fds:
                    os.mkdir(f"gpus/{bus}", 0o555, dir_fd=top)
                    _bind_gpu_dir(target, fd, f"{ProcMask.target}/gpus/{bus}")
            linux.mount(None, linux.fd_path(top), None,
                        linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC,
                        "mode=0555,size=1m")
        finally:
            os.close(top)
        target.count += 1
    finally:
        os.close(point)
        for _, fd in gpu_fds:
            os.close(fd)


def _fill(top: int, files: dict) -> None:
    """Write the mask's files into its fresh tmpfs `top` (capabilities/gpu0/mig/...: their
    directories made on the way)."""
    for name, text in files.items():
        parts = name.split("/")
        for depth in range(1, len(parts)):
            try:
                os.mkdir("/".join(parts[:depth]), 0o555, dir_fd=top)
            except FileExistsError:
                pass
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444, dir_fd=top)
        try:
            os.write(fd, text.encode("utf-8", "surrogateescape"))
        finally:
            os.close(fd)


def _bind_gpu_dir(target, source: int, path: str) -> None:
    """The container's own /proc/driver/nvidia/gpus/<bus>, bound into the mask read-only,
    nosuid, nodev, noexec (a bind keeps the source's flags until it is remounted)."""
    dest = paths.open_in_root(target.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
    try:
        linux.mount(linux.fd_path(source), linux.fd_path(dest), None, linux.MS_BIND)
    finally:
        os.close(dest)
    now = paths.open_in_root(target.root, path, os.O_PATH | os.O_DIRECTORY, follow_final=False)
    try:
        src, st = os.fstat(source), os.fstat(now)
        if (st.st_dev, st.st_ino) != (src.st_dev, src.st_ino):
            raise OSError(errno.EBUSY, "changed under us while mounting", path)
        linux.mount(None, linux.fd_path(now), None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY |
                    linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    finally:
        os.close(now)
