"""The trainer's requests to an engine reuse kept-alive HTTP/1.1 connections.

The server here is the engine's real HTTP face (``megarl.engine.http.make_handler``: route
table, credential, limits) in front of a stand-in for the vLLM engine, so the connection
handling is tested alone: a kept connection carries request after request; a refusal closes
its connection and is not reused; a connection the server dropped (an engine that restarted)
is retried once on a fresh one; a server that is gone is ``EngineDead``.
"""

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from megarl.engine import routes
from megarl.engine.connections import EngineHTTPServer
from megarl.engine.http import Lifeline, Limits, make_handler
from megarl.errors import EngineDead, RolloutError
from megarl.fleet.client import EngineClient, free_port

TOKEN = "run-token"


class FakeEngine:
    """What the routes read of a VllmEngine; every POST handler answers {"ok": True}."""

    version, tp, asleep, failed = 7, 1, set[str](), ""

    def __getattr__(self, name: str) -> Any:
        return lambda req: {"ok": True, "version": self.version}


class Server:
    def __init__(self, port: int) -> None:
        handler = make_handler(FakeEngine(), threading.Event(), TOKEN, Limits(1 << 20, 1 << 20), Lifeline(0, 0))  # type: ignore[arg-type]
        self.accepted: list[socket.socket] = []
        outer = self

        class Counting(handler):  # type: ignore[misc, valid-type]
            def setup(self) -> None:
                outer.accepted.append(self.request)
                super().setup()

        self.httpd = EngineHTTPServer(("127.0.0.1", port), Counting)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """Like a process exit: the listener and every accepted connection close."""
        self.httpd.shutdown()
        self.httpd.server_close()
        for s in self.accepted:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.fixture
def server() -> Iterator[tuple[Server, int]]:
    port = free_port()
    srv = Server(port)
    yield srv, port
    srv.stop()


def test_requests_share_one_connection(server: tuple[Server, int]) -> None:
    srv, port = server
    e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    for _ in range(5):
        assert e.info()["version"] == 7
        assert e.post(routes.HEARTBEAT, {}, timeout=5)["ok"] is True
    assert len(srv.accepted) == 1, len(srv.accepted)  # ten requests, one TCP connection
    t0 = time.perf_counter()
    for _ in range(20):
        e.post(routes.HEARTBEAT, {}, timeout=5)
    per_request = (time.perf_counter() - t0) / 20
    assert per_request < 0.02, per_request  # no Nagle / delayed-ACK stall (~40 ms a request)
    e.close()


def test_a_refusal_closes_its_connection(server: tuple[Server, int]) -> None:
    srv, port = server
    e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    with pytest.raises(RolloutError, match="no route GET /generate"):  # refused with "Connection: close"
        e._request(routes.GENERATE, None, "", 5)
    assert e._idle == []  # the server closed it: nothing kept to reuse
    assert e.info()["version"] == 7
    assert len(srv.accepted) == 2


def test_a_dropped_connection_is_retried_once_on_a_fresh_one() -> None:
    port = free_port()
    first = Server(port)
    e = EngineClient("engine0", f"127.0.0.1:{port}", token=TOKEN)
    assert e.info()["version"] == 7
    first.stop()  # the engine restarts on the same port: the kept connection is dead
    second = Server(port)
    try:
        assert e.info()["version"] == 7
        assert len(second.accepted) == 1
    finally:
        second.stop()
    with pytest.raises(EngineDead, match="engine0"):  # and now nothing listens at all
        e.info()
