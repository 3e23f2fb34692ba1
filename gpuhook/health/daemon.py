"""The health daemon: `gpuhook prepare` on request, with NVML kept loaded.

Without persistence mode, loading NVML (nvmlInit) can take seconds, and with health.mode =
fallback every GPU start (and stop) loads it in the hook. In Kubernetes the device plugin's
PreStartContainer leaves stamps for the allocation so its start skips its GPUs. Where there
is no kubelet (podman, Docker), `gpuhook plugin --standalone` runs this daemon: it holds one
NVML session for its lifetime and answers the hook over a root-only unix socket
(`health.daemon-socket`, default <state-dir>/health.sock). The hook sends the GPUs it would
check; the daemon runs `prepare` (check, kill proven orphans, reset when needed, check
again) and answers on that same connection which GPUs are fine. It leaves no stamp: an
answer the hook stopped waiting for can serve no other start. When the daemon is absent,
slow (`DAEMON_TIMEOUT`) or says no, the hook does its own checks: the daemon can only save
time, never let a dirty GPU through or fail a start by itself (docs/health.md).

One JSON line each way, bounded: {"op": "prepare", "gpus": [UUID, ...], "container": ID,
"seconds": how long the hook waits} -> {"ok": true, "prepared": [...]} or {"ok": false,
"prepared": [...], "error": "..."}. Only GPUs of this host are prepared. Every request has
REQUEST_SECONDS to arrive whole and MAX_REQUEST bytes; at most MAX_CLIENTS connections are
served at once, MAX_PER_CLIENT of them from one process: beyond that a connection is
answered "busy" at once, so the hook goes on with its own checks instead of waiting.

The hook's side (`ask`) is on every GPU start with health on, so it imports what a bare
interpreter already has: the built-in `_socket`, not `socket` (which pulls in `enum` and
`selectors`), and no `threading`; together about 10 ms per start (benchmarks/, group daemon).
"""

import os
import stat
import time

from gpuhook import cache, fastjson

MAX_REQUEST = 8 << 10  # bytes: a prepare of 64 GPUs is about 3 KiB
MAX_ANSWER = 16 << 10  # bytes: the GPUs prepared and one error line
MAX_GPUS = 64  # GPUs one request may name
REQUEST_SECONDS = 2.0  # for a whole request to arrive, however it trickles in
MAX_CLIENTS = 32  # connections served at once
MAX_PER_CLIENT = 4  # of them from one process (SO_PEERCRED): one client never holds every slot
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
    """(UUIDs the daemon prepared for this start, why) from the daemon; ([], reason) when it
    cannot help. The whole exchange ends within `timeout` (at most DAEMON_TIMEOUT)."""
    path = socket_path(config)
    if not _trusted_socket(path):
        return [], "no health daemon"
    import _socket  # built in: socket.py's wrapper costs milliseconds of imports (module docstring)

    timeout = max(0.05, min(timeout, DAEMON_TIMEOUT))
    until = time.monotonic() + timeout
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            request = {"op": "prepare", "gpus": list(uuids), "container": container, "seconds": round(timeout, 3)}
            sock.settimeout(max(until - time.monotonic(), 0.001))
            sock.sendall((fastjson.dumps(request) + "\n").encode())
            data = _read_line(sock, MAX_ANSWER, until)
        finally:
            sock.close()
        answer = fastjson.loads(data)
    except (OSError, ValueError) as err:
        return [], f"health daemon did not answer: {getattr(err, 'strerror', None) or err}"[:200]
    prepared = answer.get("prepared") if isinstance(answer, dict) else None
    if not isinstance(prepared, list):
        return [], "health daemon answered nonsense"
    prepared = [u for u in uuids if u in prepared]
    return prepared, "prepared by the health daemon" if answer.get("ok") else str(answer.get("error", ""))[:300]


def _read_line(sock, limit: int, until: float) -> bytes:
    """One message: bytes up to a newline, the peer closing, or `limit`, all before monotonic
    time `until` (each recv waits only for what is left of it: a peer sending a byte now and
    then cannot stretch the exchange). Raises OSError (TimeoutError) when time runs out."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError(110, "timed out")
        sock.settimeout(left)
        chunk = sock.recv(limit - len(data))
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
        self.clients: dict = {}  # peer pid -> connections being served
        self.clients_lock = threading.Lock()

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
        try:
            server = self._listen()
        except BaseException:
            if self.session is not None:
                self.session.close()
            raise
        server.settimeout(0.5)
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                pid = _peer_pid(conn)
                if not self._admit(pid):
                    _refuse(conn)
                    continue
                threading.Thread(target=self._serve, args=(conn, pid), daemon=True).start()
        finally:
            server.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self.session is not None:
                self.session.close()

    def _listen(self):
        """The listening socket, 0600 from its creation (umask), in a directory only root can
        write; an existing socket there (a daemon that died) is replaced, anything else is not."""
        import socket

        from gpuhook.errors import HostError

        directory = os.path.dirname(self.path) or "."
        try:
            cache.ensure_dir(directory)
        except OSError as err:
            raise HostError(f"the health daemon's socket directory {directory} is not usable: "
                            f"{err.strerror or err}") from err
        try:
            old = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(old.st_mode):
                raise HostError(f"{self.path} exists and is not a socket: not replaced")
            os.unlink(self.path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mask = os.umask(0o177)
        try:
            server.bind(self.path)
        finally:
            os.umask(mask)
        server.listen(64)
        return server

    def _admit(self, pid) -> bool:
        with self.clients_lock:
            if sum(self.clients.values()) >= MAX_CLIENTS or self.clients.get(pid, 0) >= MAX_PER_CLIENT:
                return False
            self.clients[pid] = self.clients.get(pid, 0) + 1
            return True

    def _release(self, pid) -> None:
        with self.clients_lock:
            self.clients[pid] -= 1
            if not self.clients[pid]:
                del self.clients[pid]

    def _serve(self, conn, pid) -> None:
        try:
            with conn:
                started = time.monotonic()
                try:
                    data = _read_line(conn, MAX_REQUEST, started + REQUEST_SECONDS)
                except OSError:
                    return  # too slow, or gone: nobody to answer
                answer = self._answer(data, started)
                try:
                    conn.settimeout(REQUEST_SECONDS)
                    conn.sendall((fastjson.dumps(answer) + "\n").encode())
                except OSError:
                    pass
        finally:
            self._release(pid)

    def _answer(self, data: bytes, started: float) -> dict:
        """The answer to one request (`data`, received since monotonic time `started`)."""
        from gpuhook import discover
        from gpuhook.errors import GpuhookError
        from gpuhook.health import engine

        if not data.endswith(b"\n"):
            return {"ok": False, "prepared": [], "error": f"not one request line of at most {MAX_REQUEST} bytes"}
        try:
            request = fastjson.loads(data)
        except (ValueError, RecursionError):
            request = None
        if not isinstance(request, dict) or request.get("op") != "prepare":
            return {"ok": False, "prepared": [], "error": "not a prepare request"}
        uuids, seconds = request.get("gpus"), request.get("seconds", DAEMON_TIMEOUT)
        if (not isinstance(uuids, list) or not 0 < len(uuids) <= MAX_GPUS or isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))):
            return {"ok": False, "prepared": [], "error": f"a prepare request names 1 to {MAX_GPUS} GPUs"}
        try:
            known = {gpu.uuid for gpu in discover.gpus(self.config.proc_root)}
        except GpuhookError as err:
            return {"ok": False, "prepared": [], "error": err.one_line()[:300]}
        if not all(isinstance(u, str) and u in known for u in uuids):
            # Never work, lock or write reports for GPUs this host does not have.
            return {"ok": False, "prepared": [], "error": "not a GPU of this host"}
        uuids = list(dict.fromkeys(uuids))
        # No work past what the asker waits for: an answer nobody reads helps no start.
        budget = min(self.config.health.deadline_seconds, seconds) - (time.monotonic() - started) - 0.05
        if budget <= 0:
            return {"ok": False, "prepared": [], "error": "no time left to prepare"}
        try:
            engine.prepare(uuids, self.config, budget)
        except GpuhookError as err:
            report = getattr(err, "report", None)
            prepared = [g.uuid for g in report.gpus if g.ok] if report is not None else []
            return {"ok": False, "prepared": prepared, "error": err.one_line()[:1000]}
        return {"ok": True, "prepared": uuids}


def _peer_pid(conn) -> int:
    """The pid of the process at the other end (SO_PEERCRED); 0 when unknown."""
    import socket
    import struct

    try:
        return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    except OSError:
        return 0


def _refuse(conn) -> None:
    """Answer "busy" without waiting on the peer, and close."""
    try:
        conn.setblocking(False)
        conn.send(b'{"ok": false, "prepared": [], "error": "health daemon busy"}\n')
    except OSError:
        pass
    finally:
        conn.close()
