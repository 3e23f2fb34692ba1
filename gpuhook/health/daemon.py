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

At a stop that needs NVML (docs/health.md, "After a stop"), the hook sends {"op": "release",
"container": ID}; the daemon cleans up after the container (registry entries of that id whose
init is gone, and only those) and answers {"ok": true, "decision": "...", "health": {...}}.

A reset needs every NVML session closed, the daemon's too (docs/health.md, Resetting): a
gpuhook process about to reset sends {"op": "close-nvml", "seconds": S}; the daemon closes
its sessions, answers {"ok": true} and opens them again when the asker closes the connection
(or after S seconds, 60 at most).

The hook's side (`ask_start`, `Asked.answer`) is on every GPU start with health on, so it
imports what a bare interpreter already has: the built-in `_socket`, not `socket` (which pulls in `enum` and
`selectors`), and no `threading`; together about 10 ms per start (benchmarks/, group daemon).
"""

import os
import stat
import time

from gpuhook import fastjson
from gpuhook.apply import statefiles
from gpuhook.kernel import files

MAX_REQUEST = 8 << 10  # bytes: a prepare of 64 GPUs is about 3 KiB
MAX_ANSWER = 16 << 10  # bytes: the GPUs prepared and one error line
MAX_GPUS = 64  # GPUs one request may name
REQUEST_SECONDS = 2.0  # for a whole request to arrive, however it trickles in
MAX_CLIENTS = 32  # connections served at once
MAX_PER_CLIENT = 4  # of them from one process (SO_PEERCRED): one client never holds every slot
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
    return stat.S_ISSOCK(st.st_mode) and files.trusted(st) and stat.S_ISDIR(parent.st_mode) and files.trusted(parent)


class Asked:
    """A prepare request on its way (`ask_start`): the daemon works on it while the asker
    does something else, then `answer` reads what it did."""

    def __init__(self, uuids: list, sock, until: float, why: str = ""):
        self.uuids = uuids
        self.sock = sock  # None when nothing went out (`why` says why)
        self.until = until
        self.why = why

    def answer(self) -> tuple:
        """(UUIDs the daemon prepared for this start, why); ([], reason) when it cannot help.
        Closes the connection."""
        if self.sock is None:
            return [], self.why
        answer, why = _receive(self.sock, self.until)
        self.sock = None
        if answer is None:
            return [], why
        prepared = answer.get("prepared")
        if not isinstance(prepared, list):
            return [], "health daemon answered nonsense"
        prepared = [u for u in self.uuids if u in prepared]
        return prepared, "prepared by the health daemon" if answer.get("ok") else str(answer.get("error", ""))[:300]

    def close(self) -> None:
        """Give up on the answer (the start failed meanwhile): the daemon's work is done
        anyway, and nothing reads it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def ask_start(config, uuids: list, container: str, timeout: float) -> Asked:
    """Send the daemon a prepare request for `uuids` and return at once: the exchange, the
    answer read by `Asked.answer` included, ends within `timeout` (at most DAEMON_TIMEOUT)."""
    timeout = max(0.05, min(timeout, DAEMON_TIMEOUT))
    sock, until, why = _send(config, {"op": "prepare", "gpus": list(uuids), "container": container,
                                      "seconds": round(timeout, 3)}, timeout)
    return Asked(list(uuids), sock, until, why)


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
    """(answer dict, "") or (None, why) for one request to the daemon; the whole exchange
    ends within `timeout` (at most DAEMON_TIMEOUT)."""
    sock, until, why = _send(config, message, timeout)
    return (None, why) if sock is None else _receive(sock, until)


def _send(config, message: dict, timeout: float) -> tuple:
    """(connected socket, monotonic time the exchange must end by, "") once `message` went
    out, or (None, 0, why)."""
    path = socket_path(config)
    if not _trusted_socket(path):
        return None, 0.0, "no health daemon"
    import _socket  # built in: socket.py's wrapper costs milliseconds of imports (module docstring)

    timeout = max(0.05, min(timeout, DAEMON_TIMEOUT))
    until = time.monotonic() + timeout
    sock = None
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(max(until - time.monotonic(), 0.001))
        sock.sendall((fastjson.dumps(message) + "\n").encode())
    except OSError as err:
        if sock is not None:
            sock.close()
        return None, 0.0, _no_answer(err)
    return sock, until, ""


def _receive(sock, until: float) -> tuple:
    """(answer dict, "") or (None, why): the daemon's one line on `sock` (closed here), read
    before `until`."""
    try:
        try:
            data = _read_line(sock, MAX_ANSWER, until)
        finally:
            sock.close()
        answer = fastjson.loads(data)
    except (OSError, ValueError) as err:
        return None, _no_answer(err)
    if not isinstance(answer, dict):
        return None, "health daemon answered nonsense"
    return answer, ""


def _no_answer(err: Exception) -> str:
    return f"health daemon did not answer: {getattr(err, 'strerror', None) or err}"[:200]


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
        path = socket_path(self.config)
        if SERVING_PID[0] == os.getpid() or not _trusted_socket(path):
            return self
        import _socket

        left = self.until - time.monotonic()
        if left <= 0:
            return self
        sock = None
        try:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            wait = max(0.05, min(left, DAEMON_TIMEOUT))
            sock.settimeout(wait)
            sock.connect(path)
            sock.sendall((fastjson.dumps({"op": "close-nvml", "seconds": round(left, 3)}) + "\n").encode())
            answer = fastjson.loads(_read_line(sock, MAX_ANSWER, time.monotonic() + wait))
        except (OSError, ValueError):
            if sock is not None:
                sock.close()
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

        from gpuhook.discover import nvml
        from gpuhook.errors import GpuhookError

        from gpuhook.health import actions

        SERVING_PID[0] = os.getpid()
        try:
            self.session = nvml.Session(nvml.library_path(self.config), client_lock=actions.client_lock(self.config))
            self.session.open()  # held: every run's own session nests in it, nvmlInit stays done
        except GpuhookError:
            self.session = None  # the checks will say what is wrong with NVML
        try:
            server = self._listen()
        except BaseException:
            if self.session is not None:
                self.session.close()
            SERVING_PID[0] = 0
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
            SERVING_PID[0] = 0

    def _listen(self):
        """The listening socket, 0600 from its creation (umask), in a directory only root can
        write; an existing socket there (a daemon that died) is replaced, anything else is not."""
        import socket

        from gpuhook.errors import HostError

        directory = os.path.dirname(self.path) or "."
        try:
            statefiles.ensure_dir(directory)
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
                request = _parse(data)
                if isinstance(request, dict) and request.get("op") == "close-nvml":
                    self._close_nvml(conn, request)
                    return
                answer = self._answer(data, request, started)
                try:
                    conn.settimeout(REQUEST_SECONDS)
                    conn.sendall((fastjson.dumps(answer) + "\n").encode())
                except OSError:
                    pass
        finally:
            self._release(pid)

    def _answer(self, data: bytes, request, started: float) -> dict:
        """The answer to one request (`data`, parsed as `request`, received since monotonic
        time `started`)."""
        from gpuhook.discover import proc
        from gpuhook.errors import GpuhookError
        from gpuhook.health import engine

        if not data.endswith(b"\n"):
            return {"ok": False, "prepared": [], "error": f"not one request line of at most {MAX_REQUEST} bytes"}
        if isinstance(request, dict) and request.get("op") == "release":
            return self._release_container(request)
        if not isinstance(request, dict) or request.get("op") != "prepare":
            return {"ok": False, "prepared": [], "error": "not a prepare request"}
        uuids, seconds = request.get("gpus"), request.get("seconds", DAEMON_TIMEOUT)
        if (not isinstance(uuids, list) or not 0 < len(uuids) <= MAX_GPUS or isinstance(seconds, bool)
                or not isinstance(seconds, (int, float))):
            return {"ok": False, "prepared": [], "error": f"a prepare request names 1 to {MAX_GPUS} GPUs"}
        try:
            known = {gpu.uuid for gpu in proc.gpus(self.config.proc_root)}
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

    def _close_nvml(self, conn, request) -> None:
        """Keep this process's NVML closed while the asker (about to reset a GPU) holds the
        connection open, MAX_CLOSED_SECONDS at most."""
        from gpuhook.discover import nvml

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

    def _release_container(self, request) -> dict:
        """Clean up after a stopped container (gpuhook.health.hooks.cleanup), as its poststop
        hook would: only entries of that id whose init is gone."""
        from gpuhook.errors import GpuhookError
        from gpuhook.health import hooks, registry

        container = request.get("container")
        if not isinstance(container, str) or not container or len(container) > 1024:
            return {"ok": False, "error": "a release request names one container"}
        deadline = time.monotonic() + self.config.health.deadline_seconds
        decisions, answer = [], {"ok": True}
        for entry in registry.load_id(self.config.state_dir, container):
            if registry.is_alive(entry):
                continue
            try:
                decision, report = hooks.cleanup(entry, self.config, deadline)
            except GpuhookError as err:
                answer.update(ok=False, error=err.one_line()[:1000])
                break
            decisions.append(decision)
            answer["health"] = {"ok": report.ok, "gpus": [
                {"uuid": g.uuid, "status": g.status.value, "failure": g.failure() or None,
                 "actions": [a.as_dict() for a in g.actions]} for g in report.gpus]}
        answer["decision"] = "; ".join(dict.fromkeys(decisions)) or "nothing to clean up"
        return answer


def _parse(data: bytes):
    """The request in one received line, or None when it is not JSON."""
    try:
        return fastjson.loads(data)
    except (ValueError, RecursionError):
        return None


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
