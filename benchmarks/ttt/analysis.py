"""From finished runs to the benchmark's table, ratios, calibration and sweep summary.

``run_result`` turns one run folder into a JSON-able result (what the cache holds);
``analyse`` combines results: best-of-sweep, ratios (``fit.py``), the critical batch fitted
from the sweep against the coordinators' online B_noise, and ``sweep.json`` for
``megarl report --sweep``. ``estimate_wall_s`` predicts a plan's wall time from the per-step
and per-run costs the results measured.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.ttt import fit
from benchmarks.ttt.curves import crossing, curve_from_records
from benchmarks.ttt.runs import Variant

HALF = 2
"""Evaluations each side of a point in the smoothing window (runs go ``2·HALF`` validations past
their stop, ``train.evals_past_target``, so the window at a crossing near the stop is complete)."""


def _finite(xs: list[Any]) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def coordinator_stats(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The coordinator's B_noise (median over the run's second half, responses), its band,
    the batches it chose, the actor LR it trained at first and last (``train/lr``: what ran,
    whatever ``--coord-set`` changed), and probe + planning time as a fraction of step time."""
    models = sorted({k.split("/")[-1] for r in recs for k in r if k.startswith("coord/b_noise/")})
    if not models:
        return None
    steps = [r for r in recs if "coord/batch" in r]
    late = steps[len(steps) // 2 :]
    m = "actor" if "actor" in models else models[0]

    def med(key: str) -> float | None:
        xs = _finite([r.get(key) for r in late])
        return statistics.median(xs) if xs else None

    step_s = _finite([r.get("timing/step/total") for r in steps])
    overhead = (
        _finite(  # the micro-batch probe (coord/probe_s/<model>) + the observe phase (named "plan" in older results)
            [
                sum(v for k, v in r.items() if k.startswith("coord/probe_s/"))
                + r.get("timing/step/observe", r.get("timing/step/plan", 0.0))
                for r in steps
            ]
        )
    )
    return {
        "model": m,
        "b_noise": med(f"coord/b_noise/{m}"),
        "b_noise_low": med(f"coord/b_noise_low/{m}"),
        "b_noise_high": med(f"coord/b_noise_high/{m}"),
        "batches": sorted({int(r["coord/batch"]) for r in steps}),
        "final_batch": int(steps[-1]["coord/batch"]) if steps else None,
        "lr_run": (lrs[0], lrs[-1]) if (lrs := _finite([r.get("train/lr") for r in steps])) else None,
        "overhead_frac": sum(overhead) / sum(step_s) if step_s else None,
    }


def run_result(
    v: Variant, seed: int, run_dir: Path, summary: dict[str, Any], targets: list[float], wall_s: float
) -> dict[str, Any]:
    from benchmarks.ttt.clocked import step_batches
    from megarl.metrics import read_metrics

    recs = read_metrics(run_dir)
    curve = curve_from_records(recs)
    cross = [crossing(curve, t, half=HALF) for t in targets]
    n_evals = max(len(curve.steps) - 1, 1)
    steps_run = curve.steps[-1]
    return {
        "key": f"{v.name}_s{seed}",
        "variant": v.name,
        "kind": v.kind,
        "clock": v.clock,
        "seed": seed,
        "prompts": v.prompts,
        "batch": v.batch,
        "lr": v.lr,
        "curve": curve.to_dict(),
        "step_batches": step_batches(recs),  # responses per step: re-costed under each clock
        "reached": [c.reached for c in cross],
        "time_s": [c.time_s for c in cross],
        "steps": [c.steps for c in cross],
        "samples": [c.samples for c in cross],
        "val_start": curve.reward[0],
        "steps_run": steps_run,
        "step_s": curve.train_s[-1] / max(steps_run, 1),
        "val_s": max(float(summary.get("rl_wall_s", 0.0)) - curve.train_s[-1], 0.0) / n_evals,
        "overhead_s": wall_s - float(summary.get("rl_wall_s", 0.0)),
        "coord": coordinator_stats(recs),
    }


def _times(results: list[dict[str, Any]], variant: str, i: int = -1) -> dict[int, float]:
    """Time to target ``i`` per seed, of the runs that reached it (a censored run's time is
    only a lower bound: a ratio with it would be a bound, not a measurement)."""
    return {r["seed"]: r["time_s"][i] for r in results if r["variant"] == variant and r["reached"][i]}


def headline_index(results: list[dict[str, Any]], best: str) -> int:
    """The last target the best-of-sweep reached on every seed it ran (else the first)."""
    runs = [r for r in results if r["variant"] == best]
    n = len(runs[0]["reached"]) if runs else 1
    return max((i for i in range(n) if all(r["reached"][i] for r in runs)), default=0)


def analyse(results: list[dict[str, Any]], targets: list[float], best: str) -> dict[str, Any]:
    """Table rows, ratios (JSON line), calibration line and sweep summary. The top-level ratios
    are at the headline target (:func:`headline_index`); pairs where either run missed the
    target are left out (``censored_runs`` counts runs that missed the last one)."""
    sweep = [r for r in results if r["kind"] == "sweep" and r["seed"] == 1]
    best_r = next(r for r in sweep if r["variant"] == best)
    censored = sum(not r["reached"][-1] for r in results)
    h = headline_index(results, best)
    ratios: dict[str, Any] = {"best_of_sweep": best, "headline_target": targets[h], "censored_runs": censored}
    for start in ("coord_small", "coord_large"):
        coord = _times(results, start, h)
        for name, other in (("best", _times(results, best, h)), ("default", _times(results, "default", h))):
            gm, per_seed = fit.paired_ratio(other, coord)
            ratios[f"{name}/{start}"] = _round(gm)
            ratios[f"{name}/{start}_per_seed"] = {s: _round(x) for s, x in per_seed.items()}
        # a censored setting counts with its lower bound (the slow half: the median barely moves)
        ratios[f"median/{start}"] = _round(fit.median_ratio([r["time_s"][h] for r in sweep], coord))
    gm, _ = fit.paired_ratio(_times(results, "coord_small", h), _times(results, "coord_large", h))
    ratios["coord_small/coord_large"] = _round(gm)
    ratios["by_target"] = {  # the headline ratios at every target (the keys above: the last one)
        str(t): {
            f"{name}/{start}": _round(fit.paired_ratio(_times(results, other, i), _times(results, start, i))[0])
            for start in ("coord_small", "coord_large")
            for name, other in (("best", best), ("default", "default"))
        }
        for i, t in enumerate(targets)
    }

    points = fit.best_steps_per_batch([(r["batch"], r["steps"][-1], r["reached"][-1]) for r in sweep])
    cb, why = fit.fit_critical_batch(points)
    online = _finite([(r["coord"] or {}).get("b_noise") for r in results if r["kind"] == "coord"])
    b_online = statistics.median(online) if online else None
    chosen = [r["coord"]["final_batch"] for r in results if r["kind"] == "coord" and r["coord"]]
    if cb is not None:
        ratios["b_crit_fit"] = _round(cb.b_crit)
        calib = f"critical batch from the sweep: B_crit = {cb.b_crit:.0f} responses (S_min {cb.s_min:.1f}, E_min {cb.e_min:.0f})"
    else:
        ratios["b_crit_fit"] = None
        calib = f"critical batch from the sweep: not identified ({why})"
    ratios["b_noise_online"] = _round(b_online)
    ratios["b_noise_online/b_crit_fit"] = _round(b_online / cb.b_crit) if cb and b_online else None
    ratios["chosen_batch/best_batch"] = [_round(b / best_r["batch"]) for b in chosen]
    calib += f"; online B_noise (median of coordinator runs) = {_fmt(b_online)}; ratio online/fit = {_fmt(ratios['b_noise_online/b_crit_fit'])}"
    ratios["bar_resolution"] = resolution(results, best, ["coord_small", "coord_large"], h)
    overheads = _finite([(r["coord"] or {}).get("overhead_frac") for r in results if r["kind"] == "coord"])
    if overheads:
        ratios["coord_overhead_frac_max"] = _round(max(overheads))
    summary = {
        "targets": targets,
        "best": {k: best_r[k] for k in ("variant", "prompts", "batch", "lr")} | {"time_s": best_r["time_s"][-1]},
        "median_time_s": statistics.median(r["time_s"][-1] for r in sweep),
        "b_crit": cb.b_crit if cb else None,
        "s_min": cb.s_min if cb else None,
        "e_min": cb.e_min if cb else None,
        "fit_refused": why or None,
        "points": points,
        "settings": [
            {k: r[k] for k in ("variant", "batch", "lr", "reached", "time_s", "steps", "samples")} for r in sweep
        ],
    }
    return {"rows": [_row(r) for r in results], "ratios": ratios, "calibration_line": calib, "sweep": summary}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    c = r["coord"] or {}
    batch = f"{r['batch']}->{c['final_batch']}" if c.get("final_batch") else r["batch"]
    lr_run = c.get("lr_run")  # results cached before it existed show the variant's nominal LR
    return {
        "key": r["key"],
        "batch": batch,
        "lr": f"{lr_run[0]:.3g}->{lr_run[1]:.3g}" if lr_run else r["lr"],
        "val_start": r["val_start"],
        "reached": "".join("y" if x else "n" for x in r["reached"]),
        "time_s": "/".join(("" if ok else ">") + f"{t:.1f}" for ok, t in zip(r["reached"], r["time_s"])),
        "steps": "/".join(f"{s:.1f}" for s in r["steps"]),
        "samples": round(r["samples"][-1]),
        "step_s": r["step_s"],
        "b_noise": c.get("b_noise"),
    }


def estimate_wall_s(results: list[dict[str, Any]], batches: list[int], samples: int, eval_samples: int) -> float | None:
    """Wall time of runs at ``batches`` training ``samples`` responses each, validated every
    ``eval_samples``, from the measured costs: step time t(B) = a + b·B (least squares over
    fixed runs), validation per evaluation and start-up/shutdown per run (means)."""
    fixed = [r for r in results if r["kind"] != "coord" and r["steps_run"] > 0]
    if len({r["batch"] for r in fixed}) < 2:
        return None
    xs, ys = [float(r["batch"]) for r in fixed], [r["step_s"] for r in fixed]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    val_s = statistics.mean(r["val_s"] for r in results)
    over = statistics.mean(r["overhead_s"] for r in results)
    return sum(over + samples / bb * (a + b * bb) + (samples // eval_samples) * val_s for bb in batches)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _arm_suffixes(coords: list[str]) -> list[str]:
    """'' for the control coordinator, '_NAME' for each ``--arm`` (from ``coord_small_NAME`` ...)."""
    return list(dict.fromkeys(c.removeprefix("coord_small").removeprefix("coord_large") for c in coords))


def compare_seeds(results: list[dict[str, Any]], targets: list[float], best: str) -> dict[str, Any]:
    """``--best`` mode (no sweep): the coordinators against one fixed setting on every seed.

    Per seed and coordinator variant (both starts, and both again for each ``--arm``), best
    time / coordinator time at the headline target; a run that missed
    it gives a bound (``<`` when the coordinator missed: its time is at least the run's, so the
    ratio is at most this; ``>`` when the fixed run missed). The geometric mean is over seeds
    where both reached it; ``worst_per_seed`` is the smallest ratio or bound that is an upper
    bound, i.e. a seed the coordinator lost by at least that much (None if every seed is won
    or censored the other way)."""
    h = headline_index(results, best)
    ratios: dict[str, Any] = {"fixed": best, "headline_target": targets[h]}
    coords = list(dict.fromkeys(r["variant"] for r in results if r["kind"] == "coord"))
    for start in coords:
        per_seed: dict[int, str] = {}
        exact: list[float] = []
        upper: list[float] = []
        for seed in sorted({r["seed"] for r in results}):
            b = next((r for r in results if r["variant"] == best and r["seed"] == seed), None)
            c = next((r for r in results if r["variant"] == start and r["seed"] == seed), None)
            if b is None or c is None:
                continue
            x = b["time_s"][h] / c["time_s"][h]
            if b["reached"][h] and c["reached"][h]:
                per_seed[seed] = f"{x:.3f}"
                exact.append(x)
                upper.append(x)
            elif b["reached"][h]:
                per_seed[seed] = f"<{x:.3f}"
                upper.append(x)
            elif c["reached"][h]:
                per_seed[seed] = f">{x:.3f}"
            else:
                per_seed[seed] = "both missed"
        ratios[f"best/{start}"] = _round(fit.geomean(exact)) if exact else None
        ratios[f"best/{start}_per_seed"] = per_seed
        ratios[f"best/{start}_worst_per_seed"] = _round(min(upper)) if upper else None
    suffixes = _arm_suffixes(coords)
    pairs = [(f"coord_small{s}", f"coord_large{s}") for s in suffixes]
    pairs += [(c, f"{c}{s}") for s in suffixes if s for c in ("coord_small", "coord_large")]
    for a, b in pairs:  # start vs start within an arm; control vs arm for each start
        if a in coords and b in coords:
            gm, per = fit.paired_ratio(_times(results, a, h), _times(results, b, h))
            ratios[f"{a}/{b}"] = _round(gm)
            ratios[f"{a}/{b}_per_seed"] = {s: _round(x) for s, x in per.items()}
    ratios["censored_runs"] = sum(not r["reached"][h] for r in results)
    chosen = [r["coord"]["final_batch"] for r in results if r["kind"] == "coord" and r["coord"]]
    b = next(r["batch"] for r in results if r["variant"] == best)
    ratios["chosen_batch/fixed_batch"] = [_round(x / b) for x in chosen]
    ratios["bar_resolution"] = resolution(results, best, coords, h)
    return {"rows": [_row(r) for r in results], "ratios": ratios}


def resolution_line(res: dict[str, Any] | None) -> str:
    """One line for the printed report."""
    if res is None:
        return "per-seed bar resolution: needs 3+ seeds of the fixed setting"
    pairing = ", ".join(f"{k} {v:+.2f}" for k, v in res["pairing"].items()) or "-"
    return (
        f"per-seed bar resolution: the fixed setting's log-time spreads σ = {res['sigma_log_fixed']:.2f} over "
        f"{res['seeds']} seeds; a method exactly as good, drawn independently, passes ratio ≥ {res['floor']} on "
        f"every seed with p = {res['p_equal_method_every_seed']:.3f}, and needs to be "
        f"{res['speedup_for_even_odds']:.2f}× faster for even odds; seed pairing (log-time correlation): {pairing}"
    )


def resolution(results: list[dict[str, Any]], best: str, coords: list[str], h: int) -> dict[str, Any] | None:
    """``fit.bar_resolution`` at target ``h``: what the fixed setting's own seed spread lets the
    per-seed bar resolve (JSON-able, rounded)."""
    res = fit.bar_resolution(_times(results, best, h), {c: _times(results, c, h) for c in coords})
    if res is None:
        return None
    return {
        "seeds": res.seeds,
        "floor": res.floor,
        "sigma_log_fixed": _round(res.sigma_log),
        "p_equal_method_every_seed": _round(res.p_every_seed),
        "speedup_for_even_odds": _round(res.speedup_for_even_odds),
        "pairing": {k: _round(v) for k, v in res.pairing.items()},
    }
