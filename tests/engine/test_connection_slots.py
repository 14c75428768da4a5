"""A stranger cannot hold an engine's connections (issue 41 A).

The server is the engine's real HTTP face (``EngineHTTPServer`` + ``make_handler``) in front
of a stand-in for vLLM. The attacker is a separate process under another uid (``nobody``
when the tests run as root) that knows only the port: it keeps more connections open than
the engine has unproven slots, each trickling one header line every ``DRIP_S`` seconds (a
per-read timeout never fires on that) and reopens every connection the engine closes. While
it does, the trainer's client connects afresh again and again (as it must after an engine
restart, or for every /health): every request must be answered, promptly, and no
attacker connection may outlive the proof deadline by more than the reaper's tick.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from megarl.engine import routes
from megarl.engine.connections import EngineHTTPServer
from megarl.engine.http import Lifeline, Limits, make_handler
from megarl.fleet.client import EngineClient, free_port
from tests.engine.test_keepalive import TOKEN, FakeEngine

DEADLINE_S = 2.0
DRIP_S = 0.5
SLOTS = 16

# stdlib only: runs under a system interpreter as another user, with no access to the run's files
ATTACK = r"""
import json, socket, sys, time
port, n, drip, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
def connect():
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    return [s, time.monotonic()]
conns, lifetimes, end = [connect() for _ in range(n)], [], time.monotonic() + seconds
while time.monotonic() < end:
    time.sleep(drip)
    for c in conns:
        closed = False
        try:
            closed = c[0].recv(4096) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed = True
        if not closed:
            try:
                c[0].sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
        if closed:
            lifetimes.append(time.monotonic() - c[1])
            c[0].close()
            c[:] = connect()
still_open = [time.monotonic() - c[1] for c in conns]
print(json.dumps({"lifetimes": lifetimes, "open_ages": still_open}))
"""


@pytest.fixture
def server() -> Iterator[tuple[EngineHTTPServer, int]]:
    port = free_port()
    handler = make_handler(FakeEngine(), threading.Event(), TOKEN, Limits(1 << 20, 1 << 20), Lifeline(0, 0))  # type: ignore[arg-type]
    httpd = EngineHTTPServer(("127.0.0.1", port), handler, max_pending=SLOTS, proof_deadline_s=DEADLINE_S)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd, port
    httpd.shutdown()
    httpd.server_close()


def _stranger() -> dict:
    """Popen kwargs: another uid when we can (root), else this one (the slots do not care)."""
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    if os.geteuid() == 0:
        return {"args0": python, "user": 65534, "group": 65534, "extra_groups": []}
    return {"args0": sys.executable}


@pytest.mark.parametrize("held", [SLOTS // 2, 2 * SLOTS])
def test_slow_header_stranger_from_another_uid_cannot_lock_the_trainer_out(
    server: tuple[EngineHTTPServer, int], held: int
) -> None:
    """``held`` connections: fewer than the slots (each cut at the deadline), or twice as many
    (each cut by a newer one before that)."""
    httpd, port = server
    how = _stranger()
    python = how.pop("args0")
    seconds = 2 * DEADLINE_S + 2
    attacker = subprocess.Popen(
        [python, "-c", ATTACK, str(port), str(held), str(DRIP_S), str(seconds)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, **how,
    )  # fmt: skip
    client = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    time.sleep(1.0)  # the stranger holds its connections (and every unproven slot)
    assert httpd.counts()["unproven"] == min(held, SLOTS)
    waits = []
    while attacker.poll() is None:
        client.close()  # a fresh connection each time: the one the attack is meant to block
        t0 = time.monotonic()
        assert client.post(routes.HEARTBEAT, {}, timeout=5.0) == {"ok": True}
        health, why, _ = client.check_health(timeout=5.0)
        assert health == {"ok": True, "version": 7}, why
        waits.append(time.monotonic() - t0)
        time.sleep(0.1)
    out, err = attacker.communicate()
    assert attacker.returncode == 0, err
    seen = json.loads(out)
    # the trainer was served throughout, without waiting on the stranger's connections
    assert len(waits) >= 20 and max(waits) < 1.0, waits
    # the stranger's connections were cut, never held past the deadline (+ the drip it notices by)
    lifetimes = seen["lifetimes"]
    assert len(lifetimes) >= held
    assert max(lifetimes + seen["open_ages"]) < DEADLINE_S + DRIP_S + 0.5, max(lifetimes)
    counts = httpd.counts()
    assert counts["evicted"] + counts["expired"] >= len(lifetimes)
    if held < SLOTS:  # room for all: each one ran out its deadline
        assert counts["expired"] >= held and counts["evicted"] == 0
        assert min(lifetimes) > DEADLINE_S - 0.1
    else:  # more than the slots: the oldest went first, well before its deadline
        assert counts["evicted"] >= held and max(lifetimes) < DEADLINE_S


def test_a_trusted_connection_keeps_its_slot_past_the_deadline(server: tuple[EngineHTTPServer, int]) -> None:
    """The run's kept-alive connection idles between steps for longer than the proof deadline."""
    httpd, port = server
    client = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    client.post(routes.HEARTBEAT, {}, timeout=5.0)
    assert httpd.counts()["trusted"] == 1 and httpd.counts()["unproven"] == 0
    time.sleep(DEADLINE_S + 1.0)
    kept = client._idle[0]
    client.post(routes.HEARTBEAT, {}, timeout=5.0)
    assert client._idle == [kept]  # the same connection served it: it was not cut
    assert httpd.counts()["expired"] == 0
