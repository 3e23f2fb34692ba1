"""gpuhook.agent's request parser and its order of work: stops one at a time, in order; a start
after the stops that came before it (docs/agent.md)."""

import time

from gpuhook import agent

ENV = [b"PATH=/usr/bin:/bin", b"GPUHOOK_FRONT_PROTOCOL=1"]


def payload(args, env=ENV, magic=agent.PROTOCOL) -> bytes:
    tokens = [magic, str(len(args)).encode(), *args, str(len(env)).encode(), *env]
    return b"".join(t + b"\0" for t in tokens)


def test_a_request_is_its_args_and_kept_environment():
    assert agent.parse_request(payload([b"prestart", b"--config", b"/etc/g.toml"])) == (
        ["prestart", "--config", "/etc/g.toml"], {"PATH": "/usr/bin:/bin", "GPUHOOK_FRONT_PROTOCOL": "1"})


def test_anything_else_is_not_a_request():
    good = payload([b"prestart"])
    for bad in (b"", good[:-1], payload([b"prestart"], magic=b"gpuhook-agent/2"), payload([]),
                payload([b"prestart"], env=[b"LD_PRELOAD=/tmp/x.so"]),
                payload([b"prestart"], env=[b"PATH=/a", b"PATH=/b"]), payload([b"prestart"], env=[b"PATH"]),
                good.replace(b"\x001\x00prestart", b"\x005\x00prestart"), payload([b"\xff"]),
                good + b"extra\0"):
        assert agent.parse_request(bad) is None, bad


def jobs(*stages):
    return [agent.Job(i, None, stage, None, {}, [], 1, 0o022) for i, stage in enumerate(stages, 1)]


def launched(server, monkeypatch):
    order = []

    def fork(job):
        order.append(job.seq)
        job.pidfd = 1000 + job.seq
        server.running[job.pidfd] = job
    monkeypatch.setattr(server, "_fork", fork)
    return order


def test_stops_run_one_at_a_time_and_a_start_waits_for_the_stops_before_it(monkeypatch):
    server = agent.Agent("/nonexistent/agent.sock")
    order = launched(server, monkeypatch)
    stop1, stop2, start3 = jobs("poststop", "poststop", "prestart")
    server.waiting.extend([stop1, stop2, start3])
    server._launch()
    assert order == [1]  # the second stop waits for the first; the start for both
    server.running.pop(stop1.pidfd)
    server._launch()
    assert order == [1, 2]
    server.running.pop(stop2.pidfd)
    server._launch()
    assert order == [1, 2, 3]


def test_a_start_before_any_stop_does_not_wait_and_a_stuck_stop_holds_a_start_only_so_long(monkeypatch):
    server = agent.Agent("/nonexistent/agent.sock")
    order = launched(server, monkeypatch)
    start1, stop2, start3 = jobs("prestart", "poststop", "prestart")
    server.waiting.extend([start1, stop2, start3])
    server._launch()
    assert order == [1, 2]
    start3.queued_at = time.monotonic() - agent.STOP_WAIT - 0.1
    server._launch()
    assert order == [1, 2, 3]
