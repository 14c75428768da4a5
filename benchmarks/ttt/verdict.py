"""The study's figures and verdicts (#45 "How it is checked"), per clock; pure.

Each figure is a paired ratio over seeds, other arm's time / the method's time at the judged
(last) target (> 1: the method is faster), summarised by :func:`benchmarks.ttt.stats.paired`
(geometric mean, one-sided lower bound) and split into its statistical (samples to target) and
systems (cost per sample) factors, with the same pair's ratio of measured CPU train time beside
it. A run that missed the target enters with its whole training time and samples (a lower bound
of its own: conservative against whichever arm missed); ``censored`` counts such pairs.

    V1  start (128 at the picked LR) / coordinator started at 128; C = start / best fixed batch on
        the √ line (the ceiling this clock allows). gpu clocks: gm ≥ C^0.7 and lower ≥ bar; cpu: lower ≥ bar
    V2  best fixed batch on the line / coordinator started at 128: gm ≥ 0.95, lower ≥ 0.85
    V3  coordinator started at 128 / started at 1024: gm within [0.87, 1.15]
    V5  best of the full batch × LR grid (pilot seeds) / coordinator started at 128: reported

The best fixed batch is picked on the same seeds it is judged on (its geometric-mean time):
that favours the fixed arm, so V2 is conservative for the coordinator.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.ttt import stats


def _by_seed(view: list[dict[str, Any]], variant: str, seeds: list[int]) -> dict[int, dict[str, Any]]:
    return {r["seed"]: r for r in view if r["variant"] == variant and r["seed"] in seeds}


def figure(view: list[dict[str, Any]], other: str, method: str, seeds: list[int], i: int = -1) -> dict[str, Any] | None:
    """other's time / method's time at target ``i``, paired over ``seeds`` (see the module docstring)."""
    a, b = _by_seed(view, other, seeds), _by_seed(view, method, seeds)
    common = [s for s in seeds if s in a and s in b and min(a[s]["samples"][i], b[s]["samples"][i]) > 0]
    if not common:
        return None
    time = [a[s]["time_s"][i] / b[s]["time_s"][i] for s in common]
    stat = [a[s]["samples"][i] / b[s]["samples"][i] for s in common]
    cpu = [a[s]["cpu_s"][i] / b[s]["cpu_s"][i] for s in common]
    p = stats.paired(time)
    assert p is not None
    return {
        "other": other,
        "method": method,
        **p.to_dict(),
        "statistical": round(stats.geomean(stat), 4),
        "systems": round(stats.geomean([t / s for t, s in zip(time, stat)]), 4),
        "cpu_gm": round(stats.geomean(cpu), 4),
        "censored": sum(not (a[s]["reached"][i] and b[s]["reached"][i]) for s in common),
        "per_seed": {s: round(x, 4) for s, x in zip(common, time)},
    }


def best_of(view: list[dict[str, Any]], variants: list[str], seeds: list[int], i: int = -1) -> str:
    """The variant with the smallest geometric-mean time over ``seeds`` (missing ones last)."""

    def key(v: str) -> tuple[int, float]:
        runs = _by_seed(view, v, seeds)
        if len(runs) < len(seeds):
            return (1, math.inf)
        return (0, stats.geomean([r["time_s"][i] for r in runs.values()]))

    return min(variants, key=key)


def verdicts(
    view: list[dict[str, Any]],
    clock: str,
    names: dict[str, Any],
    seeds: list[int],
    pilot: list[int],
    bars: dict[str, Any],
) -> list[dict[str, Any]]:
    """V1, V2, V3 on ``seeds`` and V5 on ``pilot``, with PASS/FAIL against ``bars``.

    ``names``: start (the fixed start's variant), line (the fixed variants on the √ line),
    grid (every fixed variant of the pilot's batch × LR grid), small / large (coordinator starts)."""
    out: list[dict[str, Any]] = []
    best = best_of(view, names["line"], seeds)
    ceiling = figure(view, names["start"], best, seeds)
    c = ceiling["gm"] if ceiling else None
    v1 = figure(view, names["start"], names["small"], seeds)
    bar1 = bars["v1"][clock]
    need_gm = c ** bar1["ceiling_exponent"] if c is not None and "ceiling_exponent" in bar1 else None
    ok1 = _lower_ok(v1, bar1["lower"]) and (need_gm is None or (v1 is not None and v1["gm"] >= need_gm))
    rule1 = f"lower ≥ {bar1['lower']}" + (f", gm ≥ C^{bar1['ceiling_exponent']} = {need_gm:.3f}" if need_gm else "")
    out.append(_row("V1", clock, v1, rule1, ok1, {"C": c, "best_fixed": best}))
    v2 = figure(view, best, names["small"], seeds)
    b2 = bars["v2"]
    ok2 = v2 is not None and v2["gm"] >= b2["gm"] and _lower_ok(v2, b2["lower"])
    out.append(_row("V2", clock, v2, f"gm ≥ {b2['gm']}, lower ≥ {b2['lower']}", ok2, {"best_fixed": best}))
    v3 = figure(view, names["small"], names["large"], seeds)
    b3 = bars["v3"]
    ok3 = v3 is not None and b3["low"] <= v3["gm"] <= b3["high"]
    out.append(_row("V3", clock, v3, f"gm in [{b3['low']}, {b3['high']}]", ok3, {}))
    grid_best = best_of(view, names["grid"], pilot)
    v5 = figure(view, grid_best, names["small"], pilot)
    out.append(_row("V5", clock, v5, "reported (pilot seeds)", None, {"best_of_grid": grid_best}))
    return out


def _lower_ok(fig: dict[str, Any] | None, bar: float) -> bool:
    return fig is not None and fig["lower"] is not None and fig["lower"] >= bar


def _row(
    name: str, clock: str, fig: dict[str, Any] | None, rule: str, ok: bool | None, extra: dict[str, Any]
) -> dict[str, Any]:
    verdict = "-" if ok is None else "PASS" if ok else "FAIL"
    return {"figure": name, "clock": clock, "rule": rule, "verdict": verdict, **(fig or {"n": 0}), **extra}


def power(
    rows: list[dict[str, Any]], bars: dict[str, Any], sigma: float | None = None, level: float = 0.9
) -> list[dict[str, Any]]:
    """Seeds each lower-bound bar needs (V1, V2): at the pilot rows' geometric mean and their σ of
    log ratios (or ``sigma`` given), :func:`benchmarks.ttt.stats.seeds_needed` at power 0.8."""
    out = []
    for r in rows:
        if r["figure"] not in ("V1", "V2") or not r.get("n"):
            continue
        bar = bars["v1"][r["clock"]]["lower"] if r["figure"] == "V1" else bars["v2"]["lower"]
        s = sigma if sigma is not None else r.get("sigma_log")
        n = stats.seeds_needed(r["gm"], s, bar, level) if s is not None else None
        out.append({"figure": r["figure"], "clock": r["clock"], "effect_gm": r["gm"], "sigma_log": s,
                    "bar_lower": bar, "seeds_needed": n, "pilot_seeds": r["n"]})  # fmt: skip
    return out
