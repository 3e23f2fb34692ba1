"""A FUSE filesystem whose backend stops answering: the stalled pod volume of the tests.

Run as a process of its own (`StalledFuse`): it opens /dev/fuse, mounts it and answers the
kernel's INIT, then reads requests and answers only those `answer` allows; every other request
is read and never answered. A process making such a request waits in the kernel; once it is
sent SIGKILL it waits uninterruptibly (state D) until the request is answered or the
connection is aborted (fs/fuse/dev.c, request_wait_answer). Stopping the server closes
/dev/fuse, which aborts the connection (fuse_dev_release): every waiting request ends with
ENOTCONN and the waiters go on (and die, if they were killed). The mount is then lazily
unmounted. The protocol structures are those of include/uapi/linux/fuse.h (7.31).

Modes:
- "dir": the root is a directory; GETATTR of it is answered (runtimes stat a bind source),
  nothing else (a lookup in it hangs);
- "file": the root is a regular file holding what the file it is mounted over held (its
  `size` bytes); GETATTR, OPEN, READ, FLUSH and RELEASE are answered for processes in the
  server's own mount namespace only (the host: gpuhook's discovery, which reads an ELF
  header), nothing for any other (a container's namespace: gpuhook's worker).
"""

import ctypes
import os
import struct
import subprocess
import sys
import time

FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_INIT, FUSE_INTERRUPT, FUSE_BATCH_FORGET = 1, 2, 3, 26, 36, 42
FUSE_OPEN, FUSE_READ, FUSE_RELEASE, FUSE_FLUSH = 14, 15, 18, 25
READ_IN = struct.Struct("<QQI")  # fh offset size (the start of struct fuse_read_in)
NO_REPLY = {FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT}
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec mode nlink uid gid rdev blksize flags
MS_NOSUID, MS_NODEV = 0x2, 0x4


def _answer_init(fd: int, unique: int) -> None:
    # major, minor, max_readahead, flags, max_background, congestion_threshold, max_write,
    # time_gran, max_pages, map_alignment, flags2, then reserved words (64 bytes in all)
    body = struct.pack("<IIIIHHIIHHI28x", 7, 31, 0, 0, 16, 12, 1 << 20, 1, 32, 0, 0)
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)


def _answer_attr(fd: int, unique: int, mode: int, size: int) -> None:
    now = int(time.time())
    attr = ATTR.pack(1, size, (size + 511) // 512, now, now, now, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)
    body = struct.pack("<QII", 0, 0, 0) + attr  # attr_valid 0: every stat asks again
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)


def _answer(fd: int, unique: int, body: bytes = b"") -> None:
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)


def serve(mountpoint: str, mode: str, size: int) -> None:
    content = b""
    if mode == "file":
        with open(mountpoint, "rb") as f:
            content = f.read(size)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    rootmode = "100644" if mode == "file" else "40755"
    options = f"fd={fd},rootmode={rootmode},user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"stalledfs", mountpoint.encode(), b"fuse.stalledfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
                  options) != 0:
        sys.exit(f"mount: {os.strerror(ctypes.get_errno())}")
    own_ns = os.readlink("/proc/self/ns/mnt")
    print("ready", flush=True)
    while True:
        try:
            data = os.read(fd, (1 << 20) + 8192)
        except OSError:
            return  # the connection was aborted
        _, opcode, unique, nodeid, _, _, pid, _, _ = IN_HEADER.unpack_from(data)
        if opcode == FUSE_INIT:
            _answer_init(fd, unique)
        elif opcode == FUSE_GETATTR and nodeid == 1:
            try:
                same_ns = os.readlink(f"/proc/{pid}/ns/mnt") == own_ns
            except OSError:
                same_ns = True
            if mode == "dir":
                _answer_attr(fd, unique, 0o40755, 0)
            elif same_ns:
                _answer_attr(fd, unique, 0o100644, size)
        elif mode == "file" and opcode in (FUSE_OPEN, FUSE_READ, FUSE_FLUSH, FUSE_RELEASE) and nodeid == 1:
            try:
                same_ns = os.readlink(f"/proc/{pid}/ns/mnt") == own_ns
            except OSError:
                same_ns = opcode in (FUSE_FLUSH, FUSE_RELEASE)  # sent as the file closes, pid may be gone
            if not same_ns:
                continue
            if opcode == FUSE_OPEN:
                _answer(fd, unique, struct.pack("<QII", 0, 0, 0))  # fh, open_flags, padding
            elif opcode == FUSE_READ:
                _, offset, count = READ_IN.unpack_from(data, IN_HEADER.size)
                _answer(fd, unique, content[offset:offset + count])
            else:
                _answer(fd, unique)
        # everything else is read and never answered: the backend has stopped


class StalledFuse:
    """The server as a child process, mounted at `mountpoint` until `stop`."""

    def __init__(self, mountpoint, mode: str = "dir", size: int = 0):
        self.mountpoint = str(mountpoint)
        self.process = subprocess.Popen([sys.executable, "-I", __file__, self.mountpoint, mode, str(size)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            raise RuntimeError(f"stalled FUSE did not mount: {self.process.stderr.read().decode(errors='replace')}")

    def stop(self) -> None:
        """Abort the connection (the server's /dev/fuse closes with it), so nothing stays
        waiting on it, then detach the mount."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        subprocess.run(["umount", "-l", self.mountpoint], capture_output=True, check=False)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
