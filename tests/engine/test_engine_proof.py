"""The client sends the run's credential only to an engine that proved it holds it.

An engine's port is on its command line, and a local engine binds it only once vLLM has
loaded: any local process can take the port first and answer the trainer's first request —
which carried the credential. Now every new connection starts with ``GET /hello?nonce=N``
(no credential); the engine answers HMAC(token, port, N) (``credentials.engine_proof``) and
only then does the client send ``Authorization``. The servers here: the engine's real HTTP
face (``make_handler``) in front of a stand-in engine, a squatter that answers everything
and records what it was sent, and a relay that forwards a port to a real engine of the run.
"""

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.engine import routes
from megarl.engine.credentials import engine_proof
from megarl.errors import RolloutError
from megarl.fleet.client import EngineClient, free_port
from tests.engine.test_keepalive import TOKEN, Server


class Squatter:
    """Took the engine's port: answers 200 with engine-like JSON to every request, and keeps
    the headers it received."""

    def __init__(self, port: int) -> None:
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                outer.headers.append(dict(self.headers))
                n = int(self.headers.get("Content-Length", "0") or 0)
                self.rfile.read(n)
                body = json.dumps({"ok": True, "version": 3, "port": port, "proof": "0" * 64}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _relay(listen: int, target: int) -> socket.socket:
    """Forward every connection on ``listen`` to ``target`` byte for byte (both directions)."""
    lsock = socket.create_server(("127.0.0.1", listen))

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            b.close()

    def accept() -> None:
        while True:
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", target))
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock


@pytest.fixture
def squatter() -> Iterator[tuple[Squatter, int]]:
    port = free_port()
    s = Squatter(port)
    yield s, port
    s.stop()


def test_a_squatter_never_gets_the_credential(squatter: tuple[Squatter, int]) -> None:
    sq, port = squatter
    e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    health, why, answered = e.check_health(timeout=5)
    assert health is None and answered
    assert "did not prove it holds this run's credential" in why and "the credential was not sent" in why
    with pytest.raises(RolloutError, match="did not prove it holds this run's credential"):
        e.post(routes.GENERATE, {"prompts": [[1, 2]]}, timeout=5)
    with pytest.raises(RolloutError, match="did not prove"):
        e.info()
    assert len(sq.headers) == 3  # three /hello, nothing else
    assert all("Authorization" not in h for h in sq.headers), sq.headers
    assert TOKEN not in json.dumps(sq.headers)


def test_an_engine_of_another_run_is_refused_before_the_credential_goes() -> None:
    port = free_port()
    srv = Server(port)  # holds TOKEN
    try:
        other = EngineClient("engine0", f"127.0.0.1:{port}", token="another-run")
        health, why, answered = other.check_health(timeout=5)
        assert health is None and answered and "did not prove" in why
        ours = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
        assert ours.check_health(timeout=5)[0] == {"ok": True, "version": 7}
        assert ours.info()["version"] == 7
    finally:
        srv.stop()


def test_a_relay_to_another_engine_of_the_run_is_refused() -> None:
    """The proof names the port the engine listens on: a process on engine 1's port that
    relays to engine 0 (same run, same credential) cannot pass it off as engine 1's."""
    real, fake = free_port(), free_port()
    srv = Server(real)
    lsock = _relay(fake, real)
    try:
        relayed = EngineClient("engine1", f"127.0.0.1:{fake}", token=TOKEN)
        with pytest.raises(RolloutError, match="did not prove"):
            relayed.info()
        direct = EngineClient("engine0", f"127.0.0.1:{real}", token=TOKEN)
        assert direct.info()["version"] == 7
    finally:
        lsock.close()
        srv.stop()


def test_hello_answers_only_a_well_formed_nonce() -> None:
    import http.client

    port = free_port()
    srv = Server(port)
    try:
        for query, code in (("", 400), ("?nonce=short", 400), ("?nonce=" + "a" * 200, 400), ("?nonce=" + "ab" * 16, 200)):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", routes.HELLO + query)
            r = c.getresponse()
            body = json.loads(r.read())
            assert r.status == code, (query, body)
            if code == 200:
                assert body == {"port": port, "proof": engine_proof(TOKEN, "ab" * 16, port)}
            c.close()
    finally:
        srv.stop()


def test_strangers_holding_connections_time_out_and_cannot_exhaust_the_engine() -> None:
    """Connections that send nothing, or half a request line, hold an unproven slot until one
    deadline from their accept; beyond the slots a new connection evicts the oldest (closed
    unanswered); then the run's client gets through. (#41 A replaced the per-read timeout and the
    refusal beyond the cap: tests/engine/test_connection_slots.py has the slow-header attack.)"""
    import time

    from megarl.engine.connections import EngineHTTPServer
    from megarl.engine.http import Lifeline, Limits, make_handler
    from tests.engine.test_keepalive import FakeEngine

    handler = make_handler(FakeEngine(), threading.Event(), TOKEN, Limits(1 << 20, 1 << 20), Lifeline(0, 0))  # type: ignore[arg-type]
    port = free_port()
    httpd = EngineHTTPServer(("127.0.0.1", port), handler, max_pending=4, proof_deadline_s=1.0)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    strangers = []
    try:
        for k in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            if k % 2:
                s.sendall(b"GET /health HT")  # half a request line
            strangers.append(s)
            time.sleep(0.05)  # accepted in this order
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port))
        strangers[0].settimeout(5)
        assert strangers[0].recv(100) == b""  # the oldest was evicted by the newcomer, unanswered
        t0 = time.monotonic()
        for s in [*strangers[1:], extra]:
            s.settimeout(5)
            assert s.recv(100) == b""  # closed at the deadline, unanswered
        assert time.monotonic() - t0 < 2.5
        extra.close()
        e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
        assert e.info()["version"] == 7
        assert httpd.counts()["evicted"] == 1 and httpd.counts()["expired"] == 4
    finally:
        for s in strangers:
            s.close()
        httpd.shutdown()
        httpd.server_close()


def _serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    port = free_port()
    httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd, port


def test_a_proof_on_a_connection_the_server_then_closes_is_not_trusted() -> None:
    """The proof vouches for its connection only: http.client would reopen a closed one
    silently, and the credential would go over a connection nobody proved."""
    seen: list[dict[str, str]] = []

    class CloseAfterHello(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            seen.append(dict(self.headers))
            port = self.server.server_address[1]
            nonce = self.path.split("nonce=")[-1]
            body = json.dumps({"port": port, "proof": engine_proof(TOKEN, nonce, port)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

    httpd, port = _serve(CloseAfterHello)
    try:
        e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
        with pytest.raises(RolloutError, match="did not prove"):
            e.info()
        assert e.check_health(timeout=5)[0] is None
        assert seen and all("Authorization" not in h for h in seen)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_failed_engine_answers_503_on_health() -> None:
    from megarl.engine.connections import EngineHTTPServer
    from megarl.engine.http import Lifeline, Limits, make_handler
    from tests.engine.test_keepalive import FakeEngine

    engine = FakeEngine()
    handler = make_handler(engine, threading.Event(), TOKEN, Limits(1 << 20, 1 << 20), Lifeline(0, 0))  # type: ignore[arg-type]
    port = free_port()
    httpd = EngineHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
        assert e.health(timeout=5) == {"ok": True, "version": 7}
        engine.failed = "IndexError: index out of range in self"
        health, why, answered = e.check_health(timeout=5)
        assert health is None and answered and why == "GET /health answered HTTP 503"
        with pytest.raises(RolloutError, match=r"engine failed \(IndexError: index out of range in self\)"):
            e._request(routes.HEALTH, None, "", 5)
        assert e.info()["version"] == 7  # the trainer can still read what it needs to restart it
    finally:
        httpd.shutdown()
        httpd.server_close()
