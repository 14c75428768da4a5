"""The trainer's side of the engine protocol: one :class:`EngineClient` per engine server.

Requests use the route table of ``megarl.engine.routes`` and carry the run's credential
(``Authorization: Bearer``), sent only on a connection where the engine first proved it holds
the credential (``/hello``: an HMAC of a fresh nonce, ``credentials.engine_proof``); ``/generate`` answers one binary frame (``megarl.engine.wire``),
every other route JSON. An engine that answers with an error raises
:class:`RolloutError` naming engine, address and route, one that does not answer at all
:class:`EngineDead` (the fleet restarts local engines that are down).
"""

from __future__ import annotations

import hmac
import http.client
import json
import secrets
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.engine import routes
from megarl.engine.credentials import auth_header, engine_proof
from megarl.engine.wire import GENERATION_TYPE, decode_generation
from megarl.errors import EngineDead, RolloutError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EngineClient:
    """The trainer's handle on one engine server: its address, process (when megarl started
    it), launch command and credential; every request carries the credential and maps
    failures to RolloutError (the engine answered no) or EngineDead (it did not answer)."""

    name: str
    address: str
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    launch: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """The engine process's environment additions (may hold the credential: not in repr)."""
    token: str = field(default="", repr=False)
    """The run's credential, sent with every request."""
    answered_at: float = field(default=float("-inf"), repr=False)
    """``time.monotonic()`` of the engine's last successful answer (the fleet skips a /health
    ping for an engine that answered moments ago)."""
    served_version: int | None = field(default=None, repr=False)
    """The weight version the engine named in its last answer that carried one."""
    log_start: int = field(default=0, repr=False)
    """Where the current process's output starts in ``log_path`` (every start appends to it)."""
    _idle: list[http.client.HTTPConnection] = field(default_factory=list, init=False, repr=False)
    """Kept-alive connections not in use (several threads may talk to one engine at once)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def _request(self, path: str, data: bytes | None, content_type: str, timeout: float) -> dict[str, Any]:
        ctype, body = self._exchange(path, data, content_type, timeout)
        if ctype != "application/json":
            raise RolloutError(f"engine {self.name} ({self.address}) {path}: expected JSON, got {ctype!r}")
        reply = dict(json.loads(body))
        if isinstance(reply.get("version"), int):
            self.served_version = reply["version"]
        return reply

    def _exchange(self, path: str, data: bytes | None, content_type: str, timeout: float) -> tuple[str, bytes]:
        """One request: (reply Content-Type, reply body); errors mapped as the module says.

        Requests reuse kept-alive connections (the engine speaks HTTP/1.1 without Nagle
        delays): no TCP handshake and no server thread per request, ~0.35 ms less per round
        trip on one host. A kept connection the engine has closed meanwhile (it restarted)
        fails before any answer; the request then goes once more on a fresh connection."""
        headers = auth_header(self.token) | ({"Content-Type": content_type} if data is not None else {})
        method = "GET" if data is None else "POST"
        for retry in (False, True):
            conn, reused = self._connection(timeout, fresh=retry)
            try:
                if not reused:
                    self._hello(conn)
                conn.request(method, path, body=data, headers=headers)
                r = conn.getresponse()
                body = r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if reused and not retry:
                    continue
                raise EngineDead(f"engine {self.name} ({self.address}) {path}: {e}") from e
            except (OSError, http.client.HTTPException) as e:  # refused, timed out, unreachable, garbled
                conn.close()
                raise EngineDead(f"engine {self.name} ({self.address}) {path}: {e}") from e
            self._release(conn, r)
            if r.status >= 400:
                detail = body.decode(errors="replace")
                try:
                    detail = json.loads(detail).get("error", detail)
                except (json.JSONDecodeError, AttributeError):
                    pass
                raise RolloutError(f"engine {self.name} ({self.address}) {path}: {detail}")
            self.answered_at = time.monotonic()
            return r.headers.get_content_type(), body
        raise AssertionError("unreachable")

    def _connection(self, timeout: float, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection, whether it was kept from an earlier request)."""
        with self._lock:
            conn = None if fresh or not self._idle else self._idle.pop()
        if conn is None:
            return http.client.HTTPConnection(self.address, timeout=timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def _hello(self, conn: http.client.HTTPConnection) -> None:
        """Have the engine prove, on this connection, that it holds the run's credential before
        the credential goes over it (RolloutError otherwise: a process that took the engine's
        port, or an engine of another run). Network errors propagate to the caller's mapping."""
        nonce = secrets.token_hex(16)
        conn.request("GET", f"{routes.HELLO}?nonce={nonce}")
        r = conn.getresponse()
        body = r.read()
        port = int(self.address.rsplit(":", 1)[1])
        try:
            proof = json.loads(body).get("proof", "") if r.status == 200 else ""
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            proof = ""
        # the proof holds for this connection only: one the server closes would be reopened unproven
        if (
            r.will_close
            or not isinstance(proof, str)
            or not hmac.compare_digest(proof.encode(), engine_proof(self.token, nonce, port).encode())
        ):
            conn.close()
            raise RolloutError(
                f"engine {self.name} ({self.address}) did not prove it holds this run's credential "
                f"(GET {routes.HELLO}: HTTP {r.status}): another process holds the port, or it is an engine of "
                "another run; the credential was not sent"
            )

    def _release(self, conn: http.client.HTTPConnection, r: http.client.HTTPResponse) -> None:
        if r.will_close or conn.sock is None:  # the engine closes it (e.g. after a refusal)
            conn.close()
            return
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        """Close the kept-alive connections (a fresh one opens on the next request)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self._request(path, json.dumps(body).encode(), "application/json", timeout)

    def generate(
        self, body: dict[str, Any], timeout: float
    ) -> tuple[int, list[list[dict[str, Any]]], dict[str, float]]:
        """POST /generate: (weight version, samples per prompt as ``{"token_ids", "logprobs",
        "finish_reason"}``, the engine's timings), decoded from the binary frame."""
        ctype, frame = self._exchange(routes.GENERATE, json.dumps(body).encode(), "application/json", timeout)
        if ctype != GENERATION_TYPE:
            raise RolloutError(f"engine {self.name} ({self.address}) {routes.GENERATE}: expected {GENERATION_TYPE}, "
                               f"got {ctype!r} (an engine from an older megarl?)")  # fmt: skip
        try:
            version, outputs, timings = decode_generation(frame)
        except ValueError as e:
            raise RolloutError(f"engine {self.name} ({self.address}) {routes.GENERATE}: {e}") from e
        self.served_version = version
        return version, outputs, timings

    def post_bytes(self, path: str, data: bytes, timeout: float) -> dict[str, Any]:
        """POST a binary body (safetensors bytes); the reply is JSON."""
        return self._request(path, data, "application/octet-stream", timeout)

    def health(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """{"ok", "version"}, or None while the engine does not answer (a wrong credential raises)."""
        return self.check_health(timeout)[0]

    def check_health(self, timeout: float = 2.0) -> tuple[dict[str, Any] | None, str, bool]:
        """(health, why not, answered): ``answered`` is True when something replied at the
        address but not as a megarl engine of this run (it will not become one by waiting): the
        credential goes only to an engine that proved it holds it (``_hello``), so no 401 can come."""
        conn = http.client.HTTPConnection(self.address, timeout=timeout)
        try:
            self._hello(conn)
            conn.request("GET", routes.HEALTH, headers=auth_header(self.token))
            r = conn.getresponse()
            body, status = r.read(), r.status
        except RolloutError as e:  # something answered, not an engine of this run
            return None, str(e), True
        except (ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
            if isinstance(e, socket.gaierror):
                return None, f"host not found ({e})", True
            return None, str(e) or type(e).__name__, False
        finally:
            conn.close()
        if status != 200:
            return None, f"GET /health answered HTTP {status}", True
        try:
            health = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, f"GET /health answered {body[:40]!r}, not JSON", True
        if not isinstance(health, dict) or health.get("ok") is not True or "version" not in health:
            return None, f"GET /health answered {str(health)[:80]}, not a megarl engine's", True
        self.answered_at, self.served_version = time.monotonic(), int(health["version"])
        return health, "", True

    def info(self, timeout: float = 10.0) -> dict[str, Any]:
        """{"version", "pid", "tp", "asleep", "lease_s"} (authenticated)."""
        return self._request(routes.INFO, None, "", timeout)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        """The last ``n`` lines the current process wrote to its log (not an earlier start's)."""
        if not (self.log_path and self.log_path.exists()):
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self.log_start)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-n:])

    def last_words(self, n: int = 15) -> str:
        """A sentence for an error: the current process's last log lines, or that it wrote none."""
        tail = self.log_tail(n)
        if not tail.strip():
            return f"this process wrote nothing to its log ({self.log_path})"
        return f"last log lines of this process ({self.log_path}):\n{tail}"
