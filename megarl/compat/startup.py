"""No cyclic garbage collection while a process imports what it keeps for its whole life.

CPython runs a full collection each time the objects that survived earlier collections grow by
a quarter, and a full collection walks all of them; explicit ``gc.collect()`` calls (vLLM makes
three when its engine is built) walk them all too. Inside :func:`startup` collection is off; at
its end it is on again and everything built so far is frozen (``gc.freeze``: never scanned
again — it lives as long as the process). An engine server imports vLLM inside it and builds
its engine after, with collection on: the demo's engine starts in 6.9 s instead of 7.9–8.5 s
(docs/LOG.md, session 24). (The engine is not built inside it: vLLM's own collections would
then walk everything the construction made, three times.) Only for a process's own entry point:
a frozen object is never collected, so a long-lived caller (a test session) would keep the
cyclic garbage of every start-up it ran.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def startup() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
