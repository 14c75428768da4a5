"""Each virtual clock's phases by batch (#45): ``python -m benchmarks.ttt.clock_table [FILE] [CLOCK ...]``.

One line per batch: the seconds of each phase (``megarl.coordinator.clock``), the step's seconds
per response and the generation's tokens per second — the batch-dependence a clock gives.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megarl.coordinator.clock import PHASES, Clock  # noqa: E402

BATCHES = [64, 128, 256, 512, 1024, 2048, 4096]


def describe(clock: Clock, batches: list[int]) -> list[dict[str, Any]]:
    """Per batch: each phase's seconds and the step's seconds per response (step 0)."""
    rows = []
    for b in batches:
        t = clock.phase_times(b, 0)
        step_s = sum(t[k] for k in PHASES)
        rows.append({"batch": b, **{k: round(t[k], 3) for k in PHASES}, "step_s": round(step_s, 3),
                     "ms_per_response": round(1000 * step_s / b, 2),
                     "gen_tokens_per_s": round(sum(clock.lengths(b, 0)) / t["generate"])})  # fmt: skip
    return rows


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/ttt/clocks.toml"
    names = sys.argv[2:] or sorted(tomllib.loads(Path(path).read_text())["clock"])
    for name in names:
        clock = Clock.load(path, name)
        print(f"[{name}] sha256 {clock.sha256[:12]}, {clock.slots()} sequences per engine at once")
        for row in describe(clock, BATCHES):
            print("  " + "  ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
