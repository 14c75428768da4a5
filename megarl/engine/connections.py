"""The engine's listening socket: a thread per connection, and slots that keep strangers from
holding its connections (``EngineHTTPServer``; what a connection may ask is ``megarl.engine.http``).

Invariants: a connection is *unproven* from its accept until a request on it carries the run's
credential, then *trusted*; at most ``max_pending`` are unproven at once (a newcomer evicts the
oldest); an unproven one is closed at its deadline, and a closed one is never answered.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

log = logging.getLogger("megarl.engine")


@dataclass
class _Conn:
    """One open connection's standing with the server (see ``EngineHTTPServer``)."""

    deadline: float
    """Monotonic time by which an unproven connection must have shown the credential."""
    state: Literal["unproven", "trusted", "cut"] = "unproven"
    """``cut``: the server closed it (evicted, past its deadline), its handler not finished yet."""


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
        self._conns: dict[Any, _Conn] = {}  # open socket -> its standing (insertion order: oldest first)
        self.dropped = {"evicted": 0, "expired": 0}
        """Unproven connections closed so far: evicted by a newer one, or past their deadline."""
        self._noted, self._noted_at = dict(self.dropped), 0.0
        super().__init__(address, handler)
        threading.Thread(target=self._reap, name="http-reaper", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            unproven = self._unproven()
            if len(unproven) >= self.max_pending:
                self._drop(unproven[0], "evicted")
            self._conns[request] = _Conn(time.monotonic() + self.proof_deadline_s)
        super().process_request(request, client_address)

    def trust(self, request: Any) -> None:
        """``request``'s connection carried the run's credential: it is the run's from now on."""
        with self._lock:
            conn = self._conns.get(request)
            if conn is not None and conn.state == "unproven":
                conn.state = "trusted"

    def was_cut(self, request: Any) -> bool:
        """True if the server closed ``request``'s connection (what was read is half a request)."""
        with self._lock:
            conn = self._conns.get(request)
            return conn is not None and conn.state == "cut"

    def counts(self) -> dict[str, int]:
        """Open connections by kind, and unproven ones dropped so far."""
        with self._lock:
            states = [c.state for c in self._conns.values()]
            return {"unproven": states.count("unproven"), "trusted": states.count("trusted"), **self.dropped}

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # forgotten before its socket closes (_drop never sees a closed one)
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def _unproven(self) -> list[Any]:
        """The unproven sockets, oldest first (lock held)."""
        return [s for s, c in self._conns.items() if c.state == "unproven"]

    def _drop(self, sock: Any, why: str) -> None:
        """Close an unproven connection (lock held): its handler's read returns, its thread ends."""
        self._conns[sock].state = "cut"
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
                for sock in [s for s in self._unproven() if self._conns[s].deadline < now]:
                    self._drop(sock, "expired")
                if self.dropped != self._noted and now - self._noted_at >= 10.0:
                    new = {k: v - self._noted[k] for k, v in self.dropped.items()}
                    self._noted, self._noted_at = dict(self.dropped), now
                    log.warning(
                        "closed %d unproven connections (%d evicted by newer ones, %d without the credential "
                        "after %.0fs); %d unproven open",
                        sum(new.values()), new["evicted"], new["expired"], self.proof_deadline_s,
                        len(self._unproven()),
                    )  # fmt: skip

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        log.warning("connection from %s ended: %s: %s", client_address[0], type(err).__name__, err)
