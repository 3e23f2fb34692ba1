"""The decision log: one JSON object per line, appended with a single write(2).

A line is written with O_APPEND in one write call, so lines from concurrent hooks never
interleave. Logging is best effort by contract: a missing directory, a full disk or a
read-only file never fails a container start; the error is swallowed (and counted in the
returned flag so tests can see it).
"""

from gpuhook import fastjson
import os
import stat
import time


def k8s_names(annotations: dict) -> dict:
    """Pod, namespace and container names when the runtime passed Kubernetes annotations."""
    keys = {
        "pod": ("io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name"),
        "namespace": ("io.kubernetes.pod.namespace", "io.kubernetes.cri.sandbox-namespace"),
        "container_name": ("io.kubernetes.container.name", "io.kubernetes.cri.container-name"),
    }
    found = {}
    for name, candidates in keys.items():
        for key in candidates:
            if annotations.get(key):
                found[name] = annotations[key]
                break
    return found


def _private_dir(path: str) -> bool:
    """The log's directory must not be writable by other users (who could swap the file)."""
    st = os.stat(os.path.dirname(path) or ".")
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def write(path: str, record: dict) -> bool:
    """Append `record` to the log at `path`; True if it was written."""
    if not path:
        return False
    line = dict(time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), pid=os.getpid())
    line.update(record)
    try:
        data = (fastjson.dumps(line, default=str) + "\n").encode()
        # Non-blocking: a FIFO put where the log goes must not stall the start.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o640)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not _private_dir(path):
                return False  # a FIFO, another user's file, or a directory anyone can write to
            return os.write(fd, data) == len(data)
        finally:
            os.close(fd)
    except (OSError, ValueError, TypeError):
        return False
