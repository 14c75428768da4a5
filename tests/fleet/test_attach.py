"""``rollout.engine_addresses`` that do not lead to a megarl engine fail at once, naming the
address and what answered, instead of waiting out ``rollout.engine_start_timeout_s``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.errors import RolloutError
from megarl.fleet.client import free_port
from megarl.fleet.fleet import Fleet


class _NotAnEngine(BaseHTTPRequestHandler):
    """Something else on the port: a JSON API whose /health is not a megarl engine's."""

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"status": "green"}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NotAnEngine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def test_address_that_is_not_an_engine_fails_fast(server: ThreadingHTTPServer) -> None:
    address = f"127.0.0.1:{server.server_port}"
    t0 = time.monotonic()
    with pytest.raises(
        RolloutError,
        match=rf"rollout.engine_addresses: {address} is not a megarl engine: engine engine0 \({address}\) did not "
        r"prove it holds this run's credential \(GET /hello: HTTP 404\)",
    ):
        Fleet.attach([address], request_timeout_s=5, start_timeout_s=300, token="t0ken")
    assert time.monotonic() - t0 < 5  # not the 300 s start timeout


def test_unknown_host_fails_fast() -> None:
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match=r"no-such-host.invalid:8000 is not a megarl engine: host not found"):
        Fleet.attach(["no-such-host.invalid:8000"], request_timeout_s=5, start_timeout_s=300, token="t0ken")
    assert time.monotonic() - t0 < 15


def test_refused_address_is_waited_for_then_named() -> None:
    """A remote engine may still be loading (nothing listens yet): wait, then say why."""
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match=rf"rollout.engine_start_timeout_s=2s: engine0 \({address}: .*refused"):
        Fleet.attach([address], request_timeout_s=5, start_timeout_s=2, token="t0ken")
    assert 2 <= time.monotonic() - t0 < 10


def test_attach_without_a_credential_is_refused_before_any_request(server: ThreadingHTTPServer) -> None:
    import os

    if os.environ.get("MEGARL_ENGINE_TOKEN") or os.environ.get("MEGARL_ENGINE_TOKEN_FILE"):
        pytest.skip("this environment provides a credential")
    with pytest.raises(RolloutError, match=r"needs the run's credential: set MEGARL_ENGINE_TOKEN_FILE"):
        Fleet.attach([f"127.0.0.1:{server.server_port}"], request_timeout_s=5, start_timeout_s=300)
