"""``megarl.compat.startup``: no cyclic collection while an entry point builds its long-lived
heap, then collection on again with that heap frozen — checked in a fresh interpreter, since
a frozen object stays frozen for the rest of the process."""

import subprocess
import sys

CHILD = r"""
import gc, json
from megarl.compat.startup import startup

class Node:
    def __init__(self): self.me = self  # a reference cycle: only the cyclic collector frees it

gc.collect()
before, runs = gc.get_freeze_count(), []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
with startup():
    inside = gc.isenabled()
    kept = [Node() for _ in range(50_000)]  # ~70 automatic collections' worth of allocations
    during = len(runs)
frozen = gc.get_freeze_count() - before
del kept
for _ in range(50_000):
    Node()  # garbage cycles again: the collector is back
print(json.dumps({"inside": inside, "during": during, "frozen": frozen, "after": gc.isenabled(),
                  "collected_after": len(runs) - during}))
"""


def test_startup_pauses_collection_then_freezes_what_it_built() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60)
    import json

    r = json.loads(out.stdout)
    assert r["inside"] is False and r["during"] == 0  # no automatic collection ran inside
    assert r["frozen"] >= 50_000  # what it built is frozen
    assert r["after"] is True and r["collected_after"] > 10  # and collection runs again
