"""The benchmark's printed report, once per clock (``--clock``): the table, the ratios' JSON line,
and each ratio split into its statistical and systems factors (``benchmarks/ttt/clocked.py``).

Every JSON line names its clock and carries the clocks file's sha256; the table shows each run's
time to the last target on the clock, the measured CPU train time beside it, samples to target
and the cost per sample (ms a response on that clock).
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.common import table
from benchmarks.ttt import stats
from benchmarks.ttt.analysis import HALF, analyse, compare_seeds, headline_index, resolution_line
from benchmarks.ttt.clocked import clock_view, clocks_sha256, decompose

COLUMNS = ["key", "batch", "lr", "val_start", "reached", "time_s", "cpu_s", "samples", "ms_per_sample", "steps", "step_s", "b_noise"]  # fmt: skip


def best_fixed(view: list[dict[str, Any]], kinds: tuple[str, ...] = ("sweep",), seed: int = 1) -> str:
    """The fixed setting fastest to the last target on this view's clock (reached first)."""
    runs = [r for r in view if r["kind"] in kinds and r["seed"] == seed]
    return str(min(runs, key=lambda r: (not r["reached"][-1], r["time_s"][-1]))["variant"])


def decomposition(view: list[dict[str, Any]], other: str, methods: list[str], i: int) -> dict[str, Any]:
    """For each method: other's time / method's time at target ``i``, paired over seeds, as
    geometric means of the time ratio and of its statistical (samples to target) and systems
    (cost per sample) factors; gm(time) = gm(statistical) · gm(systems) exactly."""
    out: dict[str, Any] = {}
    for m in methods:
        pairs = []
        for a in (r for r in view if r["variant"] == other):
            b = next((r for r in view if r["variant"] == m and r["seed"] == a["seed"]), None)
            d = decompose(a, b, i) if b is not None else None
            if d is not None:
                pairs.append(d)
        if pairs:
            out[f"{other}/{m}"] = {
                k: round(stats.geomean([d[k] for d in pairs]), 4) for k in ("time", "statistical", "systems")
            } | {"seeds": len(pairs)}
    return out


def rows_with_clock(rows: list[dict[str, Any]], view: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The analysis rows plus the CPU train time and the cost per sample at the last target."""
    out = []
    for row, r in zip(rows, view):
        cps = r["cost_per_sample"][-1]
        out.append(
            row | {"cpu_s": round(r["cpu_s"][-1], 1), "ms_per_sample": None if cps is None else round(1e3 * cps, 3)}
        )
    return out


def report_clocks(
    results: list[dict[str, Any]],
    targets: list[float],
    clocks: dict[str, Any],
    fixed: str | None,
    line: dict[str, Any],
    out_dir: Any = None,
) -> list[dict[str, Any]]:
    """Print one report per clock: the sweep analysis (``fixed`` None: its best on that clock) or
    the ``--best`` comparison with ``fixed``. Returns the JSON lines printed."""
    sha = clocks_sha256()
    lines = []
    for name, clock in clocks.items():
        view = clock_view(results, name, clock, targets, HALF)
        best = fixed or best_fixed(view)
        report = analyse(view, targets, best) if fixed is None else compare_seeds(view, targets, best)
        print(f"\n== clock {name} (clocks.toml sha256 {sha[:12]}) ==")
        print(table(rows_with_clock(report["rows"], view), COLUMNS))
        if "calibration_line" in report:
            print(report["calibration_line"])
        print(resolution_line(report["ratios"]["bar_resolution"]))
        if out_dir is not None and "sweep" in report:
            (out_dir / ("sweep.json" if name == "cpu" else f"sweep_{name}.json")).write_text(
                json.dumps(report["sweep"], indent=1)
            )
        coords = sorted({r["variant"] for r in view if r["kind"] == "coord"})
        h = headline_index(view, best)
        extra = {"clock": name, "clocks_sha256": sha, "decomposition": decomposition(view, best, coords, h)}
        full = line | extra | report["ratios"]
        print(json.dumps(full))
        lines.append(full)
    return lines
