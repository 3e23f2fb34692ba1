"""The health daemon: `gpuhook prepare` on request, with NVML kept loaded.

Without persistence mode, loading NVML (nvmlInit) can take seconds, and with health.mode =
fallback every GPU start (and stop) loads it in the hook. In Kubernetes the device plugin's
PreStartContainer leaves stamps so the hook skips its GPUs. Where there is no kubelet
(podman, Docker), `gpuhook plugin --standalone` runs this daemon: it holds one NVML session
for its lifetime and answers the hook over a root-only unix socket (`health.daemon-socket`,
default <state-dir>/health.sock). The hook sends the GPUs it would check; the daemon runs
`prepare` (check, kill proven orphans, reset when needed, check again, stamp what is fine)
and answers. The hook then claims the fresh stamps and loads no NVML. When the daemon is
absent, slow (`DAEMON_TIMEOUT`) or says no, the hook does its own checks: the daemon can
only save time, never let a dirty GPU through or fail a start by itself (docs/health.md).

One JSON line each way, bounded: {"op": "prepare", "gpus": [UUID, ...], "container": ID} ->
{"ok": true, "stamped": [...]} or {"ok": false, "error": "..."}.

The hook's side (`ask`) is on every GPU start with health on, so it imports what a bare
interpreter already has: the built-in `_socket`, not `socket` (which pulls in `enum` and
`selectors`), and no `threading`; together about 10 ms per start (benchmarks/, group daemon).
"""

import os
import stat

from gpuhook import cache, fastjson

MAX_REQUEST = 64 << 10
DAEMON_TIMEOUT = 5.0  # seconds the hook waits for an answer at most (and never past its deadline)


def socket_path(config) -> str:
    return config.health.daemon_socket or f"{config.state_dir}/health.sock"


def _trusted_socket(path: str) -> bool:
    """Only a socket root made, in a directory only root can write, is asked: anything else
    could answer "clean" for a dirty GPU."""
    try:
        st = os.lstat(path)
        parent = os.lstat(os.path.dirname(path) or ".")
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and cache.trusted(st) and stat.S_ISDIR(parent.st_mode) and cache.trusted(parent)


def ask(config, uuids: list, container: str, timeout: float) -> tuple:
    """(stamped UUIDs, why) from the daemon; ([], reason) when it cannot help."""
    path = socket_path(config)
    if not _trusted_socket(path):
        return [], "no health daemon"
    import _socket  # built in: socket.py's wrapper costs milliseconds of imports (module docstring)

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.05, min(timeout, DAEMON_TIMEOUT)))
            sock.connect(path)
            sock.sendall((fastjson.dumps({"op": "prepare", "gpus": list(uuids), "container": container}) + "\n")
                         .encode())
            data = _read_line(sock)
        finally:
            sock.close()
        answer = fastjson.loads(data)
    except (OSError, ValueError) as err:
        return [], f"health daemon did not answer: {getattr(err, 'strerror', None) or err}"[:200]
    if not isinstance(answer, dict):
        return [], "health daemon answered nonsense"
    stamped = [u for u in answer.get("stamped", []) if u in uuids]
    return stamped, "prepared by the health daemon" if answer.get("ok") else str(answer.get("error", ""))[:300]


def _read_line(sock) -> bytes:
    """One message: bytes up to a newline, the peer closing, or MAX_REQUEST (either side)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


class Daemon:
    """Serve `prepare` on the socket until `stop` is set."""

    def __init__(self, config):
        import threading

        self.config = config
        self.path = socket_path(config)
        self.stop = threading.Event()
        self.session = None

    def run(self) -> None:
        import socket
        import threading

        from gpuhook import nvml
        from gpuhook.errors import GpuhookError

        try:
            self.session = nvml.Session(nvml.library_path(self.config))
            self.session.open()  # held: every run's own session nests in it, nvmlInit stays done
        except GpuhookError:
            self.session = None  # the checks will say what is wrong with NVML
        cache.ensure_dir(os.path.dirname(self.path))
        if os.path.lexists(self.path):
            os.unlink(self.path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            server.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        server.listen(64)
        server.settimeout(0.5)
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        finally:
            server.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self.session is not None:
                self.session.close()

    def _serve(self, conn) -> None:
        from gpuhook.discover import is_uuid
        from gpuhook.errors import GpuhookError
        from gpuhook.health import engine

        with conn:
            conn.settimeout(5)
            try:
                request = fastjson.loads(_read_line(conn))
                uuids = request["gpus"]
                if request.get("op") != "prepare" or not isinstance(uuids, list) or not all(map(is_uuid, uuids)):
                    raise ValueError("not a prepare request")
            except (OSError, ValueError, KeyError, TypeError):
                return
            stamped, error = [], None
            try:
                engine.prepare(uuids, self.config, self.config.health.deadline_seconds)
                stamped = list(uuids)
            except GpuhookError as err:
                error = err.one_line()
                report = getattr(err, "report", None)
                stamped = [g.uuid for g in report.gpus if g.ok] if report is not None else []
            answer = {"ok": error is None, "stamped": stamped}
            if error:
                answer["error"] = error
            try:
                conn.sendall((fastjson.dumps(answer) + "\n").encode())
            except OSError:
                pass
