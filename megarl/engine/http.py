"""The engine server's HTTP face: route table, credential check, body limits, lifeline.

``/hello`` is the one route without it: the engine answers the client's nonce with
``engine_proof`` (an HMAC keyed by the credential), so a client checks that it talks to an
engine of its run before it sends the credential. Every other route, ``/health`` included,
needs the run's credential (``Authorization: Bearer``,
``megarl.engine.credentials``); a request without it gets 401 before its body is read, so
a stranger can neither reach the engine nor make it buffer anything, and connections that
have not shown the credential are few and short-lived (``megarl.engine.connections``). Bodies are bounded
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from megarl.engine import routes
from megarl.engine.credentials import engine_proof, token_matches
from megarl.engine.wire import GENERATION_TYPE
from megarl.errors import EngineError, EngineUnhealthy

if TYPE_CHECKING:
    from megarl.engine.connections import EngineHTTPServer
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


@dataclass(frozen=True)
class Served:
    """What a handler serves: the engine's routes by method, and what the checks around them need."""

    post: dict[str, Callable[[dict[str, Any]], dict[str, Any] | bytes]]
    """JSON routes (``LOAD_BYTES`` and ``SHUTDOWN`` are the handler's own)."""
    get: dict[str, Callable[[], dict[str, Any]]]
    engine: VllmEngine
    stop: threading.Event
    """Set by ``/shutdown``."""
    token: str
    """The run's credential."""
    limits: Limits
    lifeline: Lifeline


def route_table(engine: VllmEngine, stop: threading.Event, token: str, limits: Limits, lifeline: Lifeline) -> Served:
    """What a handler serves for ``engine``: its route table, which must cover ``routes.ROUTES``
    exactly."""
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
    return Served(post=post, get=get, engine=engine, stop=stop, token=token, limits=limits, lifeline=lifeline)


def hello_reply(query: str, token: str, port: int) -> tuple[int, dict[str, Any]]:
    """``/hello``: the engine's proof for the client's nonce (no credential needed, nothing
    revealed); (status, body), 400 for a nonce that is not 16-128 letters or digits."""
    nonce = parse_qs(query).get("nonce", [""])[0]
    if not (16 <= len(nonce) <= 128 and nonce.isascii() and nonce.isalnum()):
        return 400, {"error": "/hello needs ?nonce=<16-128 letters or digits>"}
    return 200, {"port": port, "proof": engine_proof(token, nonce, port)}


def body_refusal(headers: Message, path: str, limits: Limits) -> tuple[int, str] | None:
    """Why a request's body is not read, as (status, message); None when its declared length
    is within the route's limit."""
    if headers.get("Transfer-Encoding"):
        return 411, "send a Content-Length, not Transfer-Encoding"
    raw = headers.get("Content-Length", "0")
    if not (raw.isascii() and raw.isdigit()):  # ("²".isdigit() is True, int("²") fails)
        return 400, f"bad Content-Length {raw!r}"
    limit = limits.max_weights_bytes if path == routes.LOAD_BYTES else limits.max_json_bytes
    if int(raw) > limit:
        return 413, f"{path}: body of {raw} bytes exceeds the limit of {limit}"
    return None


def load_bytes_version(headers: Message, query: str) -> int:
    """The weight version of a ``/weights/load_bytes`` request; EngineError for a wrong
    Content-Type or a missing ``?version=<int>``."""
    ctype = headers.get("Content-Type", "")
    if ctype != "application/octet-stream":
        raise EngineError(f"{routes.LOAD_BYTES} expects Content-Type application/octet-stream, got {ctype!r}")
    version = parse_qs(query).get("version", [""])[0]
    if not version.lstrip("-").isdigit():
        raise EngineError(f"{routes.LOAD_BYTES} needs ?version=<int>, got {query!r}")
    return int(version)


class EngineHandler(BaseHTTPRequestHandler):
    """One connection's requests: ``/hello`` without the credential, every other route after
    it (``_route``), bodies within their limit (``_body``), engine errors as status codes
    (``_call``: 503 unhealthy, 409 refused, 500 failed). Served by ``EngineHTTPServer``."""

    # Kept-alive connections (every reply has a Content-Length; refusals close theirs) and
    # no Nagle delay between the header and body writes of a reply (~40 ms otherwise).
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 120  # seconds any one read of a trusted connection may wait (then it is closed)
    served: ClassVar[Served]
    server: EngineHTTPServer

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet access log
        log.debug(fmt, *args)

    def parse_request(self) -> bool:
        """A connection the server cut (evicted, past its deadline) ends without a reply."""
        if self.server.was_cut(self.request):
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
        if not token_matches(self.headers.get("Authorization"), self.served.token):
            log.warning("refused %s %r from %s: missing or wrong credential", method, path, self.client_address[0])
            self._send(401, {"error": "missing or wrong credential"}, close=True,
                       extra={"WWW-Authenticate": "Bearer"})  # fmt: skip
            return None
        self.served.lifeline.touch()
        self.server.trust(self.request)
        if routes.ROUTES.get(path) != method:
            self._send(404, {"error": f"no route {method} {path}"}, close=True)
            return None
        return path

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        if url.path == routes.HELLO:
            code, body = hello_reply(url.query, self.served.token, int(self.server.server_address[1]))
            self._send(code, body, close=code != 200)
            return
        path = self._route("GET")
        if path is not None:
            self._call(self.served.get[path])

    def do_POST(self) -> None:  # noqa: N802
        path = self._route("POST")
        if path is None:
            return
        try:
            self._post(path)
        finally:  # a long request counts until it ends (heartbeats also arrive meanwhile)
            self.served.lifeline.touch()

    def _post(self, path: str) -> None:
        body = self._body(path)
        if body is None:
            return
        if path == routes.LOAD_BYTES:
            query = urlsplit(self.path).query
            self._call(lambda: self.served.engine.load_bytes(load_bytes_version(self.headers, query), body))
            return
        try:
            req = json.loads(body or b"{}")
        except json.JSONDecodeError as e:
            self._send(400, {"error": f"bad JSON: {e}"})
            return
        if path == routes.SHUTDOWN:
            self._send(200, {"ok": True})
            self.served.stop.set()
            return
        self._call(lambda: self.served.post[path](req))

    def _body(self, path: str) -> bytes | None:
        """The request body, read only if its declared length is within the route's limit."""
        refusal = body_refusal(self.headers, path, self.served.limits)
        if refusal is not None:
            self._send(refusal[0], {"error": refusal[1]}, close=True)
            return None
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

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


def make_handler(
    engine: VllmEngine, stop: threading.Event, token: str, limits: Limits, lifeline: Lifeline
) -> type[EngineHandler]:
    """A handler class serving ``engine`` (for ``EngineHTTPServer``)."""

    class Handler(EngineHandler):
        served = route_table(engine, stop, token, limits, lifeline)

    return Handler
