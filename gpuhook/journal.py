"""The decision log: one JSON object per line, appended with a single write(2).

A line is written with O_APPEND in one write call, so lines from concurrent hooks never
interleave. Logging is best effort by contract: a missing directory, a full disk or a
read-only file never fails a container start; the error is swallowed (and counted in the
returned flag so tests can see it).

Every line carries `tag: gpuhook` and, under Kubernetes, the pod's names and UID, and is at
most MAX_LINE_BYTES long: long strings and lists are cut (a 1 MiB annotation must not add
1 MiB per start). A line still too long loses detail in steps, biggest field first, until it
fits: a field is first kept shallow (its scalars, and the scalars of the records in its
lists: a 16-GPU health report keeps each GPU's uuid and status), then dropped; the line then
says what in `truncated`. Only if that fails are just the summary fields kept.
`log-target` sends lines to the file (`log-file`), to syslog/journald through the
`syslog-socket` datagram socket, or both (docs/logging.md).
"""

from gpuhook import fastjson
import os
import stat
import time

TAG = "gpuhook"
MAX_LINE_BYTES = 8192
MAX_STRING = 512  # characters kept of one string value
# Top-level fields kept longer: ldconfig's output (gpuhook.apply.ldsandbox.OUTPUT_LIMIT bytes),
# which is the only record of what it met (attacker pass 13: 512 characters hid most of it).
LONG_STRINGS = {"ldconfig_output": 4096, "detail": 4096}
MAX_ITEMS = 32  # items kept of one list
SUMMARY = ("time", "pid", "tag", "stage", "container", "pod", "namespace", "container_name", "pod_uid", "decision",
           "error", "channel", "gpus", "seconds")
SYSLOG_INFO = 6 | (3 << 3)  # LOG_INFO | LOG_DAEMON
SYSLOG_ERR = 3 | (3 << 3)  # LOG_ERR | LOG_DAEMON
ECHO = [False]  # `gpuhook -v`: every line also goes to stderr


def k8s_names(annotations: dict) -> dict:
    """Pod, namespace, container names and pod UID when the runtime passed Kubernetes
    annotations (kubelet's through CRI-O, containerd's CRI ones)."""
    keys = {
        "pod": ("io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name"),
        "namespace": ("io.kubernetes.pod.namespace", "io.kubernetes.cri.sandbox-namespace"),
        "container_name": ("io.kubernetes.container.name", "io.kubernetes.cri.container-name"),
        "pod_uid": ("io.kubernetes.pod.uid", "io.kubernetes.cri.sandbox-uid"),
    }
    found = {}
    if annotations.get("io.container.manager") == "libpod" or any(k.startswith("io.podman.annotations.")
                                                                   for k in annotations):
        return found  # podman's: the image may have written them (gpuhook.request.oci.Spec.from_podman)
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


def _cut(value, depth: int = 0, limit: int = MAX_STRING):
    """`value` with long strings and lists shortened, and nesting bounded."""
    if isinstance(value, str):
        return value if len(value) <= limit else f"{value[:limit]}...(+{len(value) - limit} chars)"
    if depth > 8:
        return "..."
    if isinstance(value, dict):
        return {str(k)[:MAX_STRING]: _cut(v, depth + 1, LONG_STRINGS.get(k, MAX_STRING) if depth == 0 else MAX_STRING)
                for k, v in list(value.items())[:MAX_ITEMS * 4]}
    if isinstance(value, (list, tuple)):
        items = [_cut(v, depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append(f"...(+{len(value) - MAX_ITEMS} items)")
        return items
    return value


def _shallow(value, depth: int = 0):
    """`value` without its nested detail: a dict keeps its scalars, and, one level down, the
    scalars of the dicts in its lists (and those lists' scalars)."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            if not isinstance(item, (dict, list, tuple)):
                kept[key] = item
            elif depth == 0 and isinstance(item, (list, tuple)):
                kept[key] = [_shallow(v, 1) if isinstance(v, dict) else v for v in item
                             if not isinstance(v, (list, tuple))]
        return kept
    if isinstance(value, (list, tuple)) and depth == 0:
        return [_shallow(v, 1) if isinstance(v, dict) else v for v in value if not isinstance(v, (list, tuple))]
    return value


def _dumps(document) -> bytes:
    return (fastjson.dumps(document, default=str) + "\n").encode()


def line_bytes(log: dict) -> bytes:
    """The bounded JSON line (with its newline) for `log` (see the module docstring)."""
    line = _cut(log)
    data = _dumps(line)
    if len(data) <= MAX_LINE_BYTES:
        return data
    full = len(data)
    # Biggest first: each detail field is made shallow, then, if that is not enough, dropped.
    biggest = [key for _, key in sorted(((len(_dumps(v)), k) for k, v in line.items() if k not in SUMMARY),
                                        reverse=True)]
    shallow, dropped = [], []

    def fits() -> bool:
        what = [f"{', '.join(names)} {how}" for names, how in ((shallow, "kept shallow"), (dropped, "dropped"))
                if names]
        line["truncated"] = f"{full} bytes: {'; '.join(what)}"
        nonlocal data
        data = _dumps(line)
        return len(data) <= MAX_LINE_BYTES

    for key in biggest:
        kept = _shallow(line[key])
        if kept != line[key]:  # something nested to leave out
            line[key] = kept
            shallow.append(key)
            if fits():
                return data
    for key in biggest:
        del line[key]
        dropped.append(key)
        if key in shallow:
            shallow.remove(key)
        if fits():
            return data
    summary = {key: log[key] for key in SUMMARY if key in log}
    summary["truncated"] = f"{len(data)} bytes: only the summary fields are kept"
    data = (fastjson.dumps(_cut(summary), default=str) + "\n").encode()
    if len(data) <= MAX_LINE_BYTES:
        return data
    return (fastjson.dumps({"time": log.get("time"), "tag": TAG, "truncated": "even the summary is too long"})
            + "\n").encode()


def write(path: str, log: dict, target: str = "file", syslog_socket: str = "/dev/log") -> bool:
    """Append the line `log` to the log at `path` (and/or syslog, by `target`); True if written."""
    line = dict(time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), pid=os.getpid(), tag=TAG)
    line.update(log)
    try:
        data = line_bytes(line)
    except (ValueError, TypeError, RecursionError):
        return False
    done = False
    if ECHO[0]:
        import sys

        sys.stderr.write(data.decode("utf-8", "replace"))
    if target in ("syslog", "both"):
        done = _syslog(syslog_socket, data, SYSLOG_ERR if log.get("decision") in ("failed", "internal error")
                       else SYSLOG_INFO)
    if target in ("file", "both") and path:
        done = _append(path, data) or (done and target == "both")
    return done


def _append(path: str, data: bytes) -> bool:
    try:
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
    except OSError:
        return False


def _syslog(socket_path: str, data: bytes, priority: int) -> bool:
    """One RFC 3164-style datagram to the syslog socket (journald reads /dev/log too)."""
    import socket  # only when syslog is configured: not on the default path

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.2)
            sock.sendto(f"<{priority}>{TAG}[{os.getpid()}]: ".encode() + data.rstrip(b"\n"), socket_path)
        return True
    except OSError:
        return False
