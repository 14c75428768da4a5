"""The engine server's HTTP face: route table, credential check, body limits, lifeline.

``/hello`` is the one route without it: the engine answers the client's nonce with
``engine_proof`` (an HMAC keyed by the credential), so a client checks that it talks to an
engine of its run before it sends the credential. Every other route, ``/health`` included,
needs the run's credential (``Authorization: Bearer``,
``megarl.engine.credentials``); a request without it gets 401 before its body is read, so
a stranger can neither reach the engine nor make it buffer anything, and connections that
have not shown the credential are few and short-lived (``EngineHTTPServer``). Bodies are bounded
(``Limits``): a weight bucket cannot be larger than the whole model at fp32 plus its
safetensors header, a JSON request than ``max_json_bytes``; a larger ``Content-Length`` gets
413 and the connection is closed unread. ``/health`` says only that the engine lives and
which weight version it serves; ``/info`` (tp, pid, sleep state) is for the trainer.

Lifeline (an engine must not outlive its trainer): ``Lifeline.parent_pid`` — a local engine
exits when the process that spawned it is gone (polled ``getppid``: a PR_SET_PDEATHSIG
signal would fire when the spawning *thread* ends, and the fleet may spawn from worker
threads); ``Lifeline.lease_s`` — an engine, local or remote, exits when no authenticated
request (the fleet sends ``/heartbeat`` every few seconds) came for that long. The lease
starts with the first authenticated request, so an engine waiting for a slow trainer to
attach is not killed; 0 turns it off (engines started by hand).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from megarl.engine import routes
from megarl.engine.credentials import engine_proof, token_matches
from megarl.engine.wire import GENERATION_TYPE
from megarl.errors import EngineError, EngineUnhealthy

if TYPE_CHECKING:
    from megarl.engine.vllm_engine import VllmEngine

log = logging.getLogger("megarl.engine")


@dataclass
class Limits:
    max_weights_bytes: int
    """Largest ``/weights/load_bytes`` body: the whole model at fp32 + header margin."""
    max_json_bytes: int
    """Largest JSON request body."""

    @classmethod
    def for_manifest(cls, manifest: dict[str, list[int]], max_json_bytes: int) -> Limits:
        numel = 0
        for shape in manifest.values():
            n = 1
            for d in shape:
                n *= int(d)
            numel += n
        # safetensors header: a JSON entry per tensor (name, dtype, shape, offsets) + padding
        margin = (1 << 20) + 512 * len(manifest)
        return cls(4 * numel + margin, max_json_bytes)


class Lifeline:
    """Decides when the engine has lost its trainer (see the module docstring)."""

    def __init__(self, parent_pid: int, lease_s: float) -> None:
        self.parent_pid, self.lease_s = parent_pid, lease_s
        self.last: float | None = None

    def touch(self) -> None:
        self.last = time.monotonic()

    def lost(self) -> str:
        """Why the trainer is considered gone, or ''."""
        if self.parent_pid and os.getppid() != self.parent_pid:
            return f"parent process {self.parent_pid} is gone"
        if self.lease_s > 0 and self.last is not None and time.monotonic() - self.last > self.lease_s:
            return f"no authenticated request for {self.lease_s:.0f}s (lease)"
        return ""

    def watch(self, stop: threading.Event, reason: list[str], every_s: float = 1.0) -> None:
        """Background thread: set ``stop`` (and ``reason``) once the trainer is gone."""

        def run() -> None:
            while not stop.wait(every_s):
                why = self.lost()
                if why:
                    log.warning("exiting: %s", why)
                    reason.append(why)
                    stop.set()

        threading.Thread(target=run, name="lifeline", daemon=True).start()


class EngineHTTPServer(ThreadingHTTPServer):
    """A thread per connection; a stranger cannot hold the engine's connections.

    A connection starts *unproven*. It holds one of ``max_pending`` slots and has
    ``proof_deadline_s`` from its accept to send a request that carries the run's credential
    (``/hello`` exchanges included): one deadline for all of it, not a per-read timeout, so a
    client that trickles a header byte every few seconds loses its slot like one that sends
    nothing. When every unproven slot is taken, a new connection evicts the *oldest* unproven
    one instead of being refused: the trainer's own connection sends its credential within
    milliseconds of connecting, so a stranger's pile of idle connections cannot shut it out.
    Once a request on a connection carried the credential the connection is *trusted*: it
    leaves the unproven pool, and each of its reads waits at most the handler's ``timeout``
    (the run's kept-alive connections idle between steps). A client that hangs up mid-reply is
    one log line; evictions and expiries are summarised at most once every 10 s."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of connections is not dropped (the stdlib's 5)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_pending: int = 64,
        proof_deadline_s: float = 10.0,
    ):
        self.max_pending, self.proof_deadline_s = max_pending, proof_deadline_s
        self._lock = threading.Lock()
        self._pending: dict[Any, float] = {}  # unproven socket -> deadline (insertion order: oldest first)
        self._trusted: set[Any] = set()
        self._cut: set[Any] = set()  # dropped, their handler not finished yet
        self.dropped = {"evicted": 0, "expired": 0}
        """Unproven connections closed so far: evicted by a newer one, or past their deadline."""
        self._noted, self._noted_at = dict(self.dropped), 0.0
        super().__init__(address, handler)
        threading.Thread(target=self._reap, name="http-reaper", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending)), "evicted")
            self._pending[request] = time.monotonic() + self.proof_deadline_s
        super().process_request(request, client_address)

    def trust(self, request: Any) -> None:
        """``request``'s connection carried the run's credential: it is the run's from now on."""
        with self._lock:
            if self._pending.pop(request, None) is not None:
                self._trusted.add(request)

    def was_cut(self, request: Any) -> bool:
        """True if the server closed ``request``'s connection (what was read is half a request)."""
        with self._lock:
            return request in self._cut

    def counts(self) -> dict[str, int]:
        """Open connections by kind, and unproven ones dropped so far."""
        with self._lock:
            return {"unproven": len(self._pending), "trusted": len(self._trusted), **self.dropped}

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # out of the pools before its socket closes (_drop never sees a closed one)
            self._pending.pop(request, None)
            self._trusted.discard(request)
            self._cut.discard(request)
        super().shutdown_request(request)

    def _drop(self, sock: Any, why: str) -> None:
        """Close an unproven connection (lock held): its handler's read returns, its thread ends."""
        del self._pending[sock]
        self._cut.add(sock)
        self.dropped[why] += 1
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _reap(self, every_s: float = 0.2) -> None:
        while True:
            time.sleep(every_s)
            now = time.monotonic()
            with self._lock:
                for sock in [s for s, deadline in self._pending.items() if deadline < now]:
                    self._drop(sock, "expired")
                if self.dropped != self._noted and now - self._noted_at >= 10.0:
                    new = {k: v - self._noted[k] for k, v in self.dropped.items()}
                    self._noted, self._noted_at = dict(self.dropped), now
                    log.warning(
                        "closed %d unproven connections (%d evicted by newer ones, %d without the credential "
                        "after %.0fs); %d unproven open",
                        sum(new.values()), new["evicted"], new["expired"], self.proof_deadline_s, len(self._pending),
                    )  # fmt: skip

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        log.warning("connection from %s ended: %s: %s", client_address[0], type(err).__name__, err)


def make_handler(
    engine: VllmEngine, stop: threading.Event, token: str, limits: Limits, lifeline: Lifeline
) -> type[BaseHTTPRequestHandler]:
    post: dict[str, Callable[[dict[str, Any]], dict[str, Any] | bytes]] = {
        routes.GENERATE: engine.generate,
        routes.LOGPROBS: engine.logprobs,
        routes.HEARTBEAT: lambda req: {"ok": True},
        routes.BEGIN: engine.begin,
        routes.LOAD: engine.load,
        routes.CHECK: engine.check,
        routes.NCCL_INIT: engine.nccl_init,
        routes.NCCL_LOAD: engine.nccl_load,
        routes.IPC_LOAD: engine.ipc_load,
        routes.COMMIT: engine.commit,
        routes.ABORT: engine.abort,
        routes.SLEEP: engine.sleep,
        routes.WAKE_UP: engine.wake_up,
    }

    def health() -> dict[str, Any]:
        if engine.failed:  # 503: the fleet restarts it
            raise EngineUnhealthy(f"engine failed ({engine.failed}); it must be restarted")
        return {"ok": True, "version": engine.version}

    get: dict[str, Callable[[], dict[str, Any]]] = {
        routes.HEALTH: health,
        routes.INFO: lambda: {
            "ok": True,
            "version": engine.version,
            "pid": os.getpid(),
            "tp": engine.tp,
            "asleep": sorted(engine.asleep),
            "lease_s": lifeline.lease_s,
        },
    }
    special = {routes.LOAD_BYTES, routes.SHUTDOWN}
    served = {p: "GET" for p in get} | {p: "POST" for p in [*post, *special]}
    assert served == routes.ROUTES, f"route table and handlers disagree: {set(served) ^ set(routes.ROUTES)}"

    class Handler(BaseHTTPRequestHandler):
        # Kept-alive connections (every reply has a Content-Length; refusals close theirs) and
        # no Nagle delay between the header and body writes of a reply (~40 ms otherwise).
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        timeout = 120  # seconds any one read of a trusted connection may wait (then it is closed)

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet access log
            log.debug(fmt, *args)

        def parse_request(self) -> bool:
            """A connection the server cut (evicted, past its deadline) ends without a reply."""
            was_cut = getattr(self.server, "was_cut", None)  # (a plain test server has no pools)
            if was_cut is not None and was_cut(self.request):
                self.close_connection = True
                return False
            return super().parse_request()

        def _send(
            self, code: int, body: dict[str, Any] | bytes, close: bool = False, extra: dict[str, str] | None = None
        ) -> None:
            # a bytes body is a generation frame (megarl.engine.wire); everything else is JSON
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", GENERATION_TYPE if isinstance(body, bytes) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            if close:  # the request body (if any) was not read: this connection cannot be reused
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> str | None:
            """Check the credential, then the route; the path, or None once refused."""
            path = urlsplit(self.path).path
            if not token_matches(self.headers.get("Authorization"), token):
                log.warning("refused %s %r from %s: missing or wrong credential", method, path, self.client_address[0])
                self._send(401, {"error": "missing or wrong credential"}, close=True,
                           extra={"WWW-Authenticate": "Bearer"})  # fmt: skip
                return None
            lifeline.touch()
            trust = getattr(self.server, "trust", None)  # (a plain test server has no pools)
            if trust is not None:
                trust(self.request)
            if routes.ROUTES.get(path) != method:
                self._send(404, {"error": f"no route {method} {path}"}, close=True)
                return None
            return path

        def _hello(self) -> None:
            """The engine's proof for the client's nonce (no credential needed, nothing revealed)."""
            nonce = parse_qs(urlsplit(self.path).query).get("nonce", [""])[0]
            if not (16 <= len(nonce) <= 128 and nonce.isascii() and nonce.isalnum()):
                self._send(400, {"error": "/hello needs ?nonce=<16-128 letters or digits>"}, close=True)
                return
            port = int(self.server.server_address[1])  # type: ignore[index]
            self._send(200, {"port": port, "proof": engine_proof(token, nonce, port)})

        def do_GET(self) -> None:  # noqa: N802
            if urlsplit(self.path).path == routes.HELLO:
                self._hello()
                return
            path = self._route("GET")
            if path is not None:
                self._call(get[path])

        def do_POST(self) -> None:  # noqa: N802
            path = self._route("POST")
            if path is None:
                return
            try:
                self._post(path)
            finally:  # a long request counts until it ends (heartbeats also arrive meanwhile)
                lifeline.touch()

        def _post(self, path: str) -> None:
            body = self._body(path)
            if body is None:
                return
            if path == routes.LOAD_BYTES:
                self._call(lambda: self._load_bytes(body))
                return
            try:
                req = json.loads(body or b"{}")
            except json.JSONDecodeError as e:
                self._send(400, {"error": f"bad JSON: {e}"})
                return
            if path == routes.SHUTDOWN:
                self._send(200, {"ok": True})
                stop.set()
                return
            self._call(lambda: post[path](req))

        def _body(self, path: str) -> bytes | None:
            """The request body, read only if its declared length is within the route's limit."""
            if self.headers.get("Transfer-Encoding"):
                self._send(411, {"error": "send a Content-Length, not Transfer-Encoding"}, close=True)
                return None
            raw = self.headers.get("Content-Length", "0")
            if not (raw.isascii() and raw.isdigit()):  # ("²".isdigit() is True, int("²") fails)
                self._send(400, {"error": f"bad Content-Length {raw!r}"}, close=True)
                return None
            limit = limits.max_weights_bytes if path == routes.LOAD_BYTES else limits.max_json_bytes
            if int(raw) > limit:
                self._send(413, {"error": f"{path}: body of {raw} bytes exceeds the limit of {limit}"}, close=True)
                return None
            return self.rfile.read(int(raw))

        def _load_bytes(self, body: bytes) -> dict[str, Any]:
            ctype = self.headers.get("Content-Type", "")
            if ctype != "application/octet-stream":
                raise EngineError(f"{routes.LOAD_BYTES} expects Content-Type application/octet-stream, got {ctype!r}")
            query = urlsplit(self.path).query
            version = parse_qs(query).get("version", [""])[0]
            if not version.lstrip("-").isdigit():
                raise EngineError(f"{routes.LOAD_BYTES} needs ?version=<int>, got {query!r}")
            return engine.load_bytes(int(version), body)

        def _call(self, fn: Callable[[], dict[str, Any] | bytes]) -> None:
            try:
                self._send(200, fn())
            except EngineUnhealthy as e:
                self._send(503, {"error": str(e)})
            except EngineError as e:
                self._send(409, {"error": str(e)})
            except Exception as e:  # engine-side failure: report it, keep serving if alive
                log.exception("request %s failed", self.path)
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler
