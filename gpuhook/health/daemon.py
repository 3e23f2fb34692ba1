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

At a stop that needs NVML (docs/health.md, "After a stop"), the hook sends {"op": "release",
"container": ID}; the daemon cleans up after the container (registry entries of that id whose
init is gone, and only those) and answers {"ok": true, "decision": "...", "health": {...}}.

A reset needs every NVML session closed, the daemon's too (docs/health.md, Resetting): a
gpuhook process about to reset sends {"op": "close-nvml", "seconds": S}; the daemon closes
its sessions, answers {"ok": true} and opens them again when the asker closes the connection
(or after S seconds, 60 at most).

The hook's side (`ask`) is on every GPU start with health on, so it imports what a bare
interpreter already has: the built-in `_socket`, not `socket` (which pulls in `enum` and
`selectors`), and no `threading`; together about 10 ms per start (benchmarks/, group daemon).
"""

import os
import stat

from gpuhook import cache, fastjson

MAX_REQUEST = 64 << 10
DAEMON_TIMEOUT = 5.0  # seconds the hook waits for an answer at most (and never past its deadline)
MAX_CLOSED_SECONDS = 60.0  # longest a close-nvml request keeps the daemon's NVML closed

# The pid of a process serving as the daemon: its own resets close its NVML in-process.
SERVING_PID = [0]


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
    answer, why = _request(config, {"op": "prepare", "gpus": list(uuids), "container": container},
                           min(timeout, DAEMON_TIMEOUT))
    if answer is None:
        return [], why
    stamped = [u for u in answer.get("stamped", []) if u in uuids]
    return stamped, "prepared by the health daemon" if answer.get("ok") else str(answer.get("error", ""))[:300]


def release(config, entry, timeout: float) -> tuple:
    """(answer, why): the daemon's cleanup after the gone container of registry entry
    `entry` ({"decision", "health", maybe "error"}), or (None, why) when there is no daemon to
    do it. A daemon that took the request but did not answer within `timeout` keeps working
    on it: the answer then says it was left to the daemon."""
    if SERVING_PID[0] == os.getpid():
        return None, "this process is the health daemon"
    answer, why = _request(config, {"op": "release", "container": entry.id}, timeout)
    if answer is None:
        if why.startswith("health daemon did not answer: timed out"):
            return {"decision": "cleanup left to the health daemon (no answer in time)"}, why
        return None, why
    return answer, "cleaned up by the health daemon"


def _request(config, message: dict, timeout: float) -> tuple:
    """(answer dict, "") or (None, why) for one request to the daemon."""
    path = socket_path(config)
    if not _trusted_socket(path):
        return None, "no health daemon"
    import _socket  # built in: socket.py's wrapper costs milliseconds of imports (module docstring)

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.05, timeout))
            sock.connect(path)
            sock.sendall((fastjson.dumps(message) + "\n").encode())
            data = _read_line(sock)
        finally:
            sock.close()
        answer = fastjson.loads(data)
    except (OSError, ValueError) as err:
        return None, f"health daemon did not answer: {getattr(err, 'strerror', None) or err}"[:200]
    if not isinstance(answer, dict):
        return None, "health daemon answered nonsense"
    return answer, ""


class nvml_closed:
    """Context manager: the health daemon's NVML sessions closed while it is entered (nothing
    to do where no daemon runs, or where this process is the daemon). Best effort: a daemon
    that does not answer before monotonic time `until` is left as it is, and the reset then
    reports what the driver says."""

    def __init__(self, config, until: float):
        self.config = config
        self.until = until
        self.sock = None

    def __enter__(self):
        import time

        path = socket_path(self.config)
        if SERVING_PID[0] == os.getpid() or not _trusted_socket(path):
            return self
        import _socket

        left = self.until - time.monotonic()
        if left <= 0:
            return self
        try:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(max(0.05, min(left, DAEMON_TIMEOUT)))
            sock.connect(path)
            sock.sendall((fastjson.dumps({"op": "close-nvml", "seconds": round(left, 3)}) + "\n").encode())
            answer = fastjson.loads(_read_line(sock))
        except (OSError, ValueError):
            try:
                sock.close()
            except (OSError, UnboundLocalError):
                pass
            return self
        if isinstance(answer, dict) and answer.get("ok"):
            self.sock = sock  # held open until the reset is done
        else:
            sock.close()
        return self

    def __exit__(self, *exc):
        if self.sock is not None:
            self.sock.close()
            self.sock = None


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

        from gpuhook.health import actions

        SERVING_PID[0] = os.getpid()
        try:
            self.session = nvml.Session(nvml.library_path(self.config), client_lock=actions.client_lock(self.config))
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
            SERVING_PID[0] = 0

    def _serve(self, conn) -> None:
        from gpuhook.discover import is_uuid
        from gpuhook.errors import GpuhookError
        from gpuhook.health import engine

        with conn:
            conn.settimeout(5)
            try:
                request = fastjson.loads(_read_line(conn))
                if isinstance(request, dict) and request.get("op") == "close-nvml":
                    self._close_nvml(conn, request)
                    return
                if isinstance(request, dict) and request.get("op") == "release":
                    self._release(conn, request)
                    return
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

    def _close_nvml(self, conn, request) -> None:
        """Keep this process's NVML closed while the asker (about to reset a GPU) holds the
        connection open, MAX_CLOSED_SECONDS at most."""
        import time

        from gpuhook import nvml

        seconds = request.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
            return
        until = time.monotonic() + min(float(seconds), MAX_CLOSED_SECONDS)
        try:
            with nvml.closed_for_reset(min(until, time.monotonic() + DAEMON_TIMEOUT)):
                conn.sendall(b'{"ok": true}\n')
                conn.settimeout(max(until - time.monotonic(), 0.01))
                try:
                    while conn.recv(1024):  # until the asker closes the connection
                        pass
                except OSError:
                    pass
        except nvml.NvmlBusy as err:
            try:
                conn.sendall((fastjson.dumps({"ok": False, "error": err.one_line()}) + "\n").encode())
            except OSError:
                pass

    def _release(self, conn, request) -> None:
        """Clean up after a stopped container (gpuhook.health.hooks.cleanup), as its poststop
        hook would: only entries of that id whose init is gone."""
        import time

        from gpuhook.errors import GpuhookError
        from gpuhook.health import hooks, registry

        container = request.get("container")
        if not isinstance(container, str) or not container or len(container) > 1024:
            return
        deadline = time.monotonic() + self.config.health.deadline_seconds
        decisions, answer = [], {"ok": True}
        for entry in registry.load_id(self.config.state_dir, container):
            if registry.is_alive(entry):
                continue
            try:
                decision, report = hooks.cleanup(entry, self.config, deadline)
            except GpuhookError as err:
                answer.update(ok=False, error=err.one_line())
                break
            decisions.append(decision)
            answer["health"] = {"ok": report.ok, "gpus": [
                {"uuid": g.uuid, "status": g.status.value, "failure": g.failure() or None,
                 "actions": [a.as_dict() for a in g.actions]} for g in report.gpus]}
        answer["decision"] = "; ".join(dict.fromkeys(decisions)) or "nothing to clean up"
        try:
            conn.sendall((fastjson.dumps(answer) + "\n").encode())
        except OSError:
            pass
