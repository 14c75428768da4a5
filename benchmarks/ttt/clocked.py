"""A run's time to target on each clock, and time = samples to target × cost per sample (#45).

``cpu`` is this machine's measured step time (the control). A virtual clock (a ``[clock.NAME]`` of
``benchmarks/ttt/clocks.toml``) charges each step the clock's time for the batch the step
recorded (:func:`benchmarks.ttt.curves.virtual_step_s`):

* a **fixed setting** learns the same whatever the clock, so its one run (made without a clock)
  is re-costed under every clock from its recorded per-step batches;
* a **coordinator** run chooses its batches from the phase times it is shown, so it is run once
  per clock (``MEGARL_VIRTUAL_CLOCK``) and costed under that clock only — the same numbers its
  planner logged as ``vclock/step_s``.

The crossing's steps and samples depend on the validation curve alone (the interpolation
fraction is read from rewards), so **samples to target is clock-free**; the clock only prices
them. Every ratio of two times then splits exactly into a *statistical* factor (samples to
target) and a *systems* factor (cost per sample): t_a / t_b = (n_a / n_b) · (c_a / c_b) with
c = t / n. Pure (no processes); tested in tests/benchmarks/test_ttt_clocked.py.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from benchmarks.ttt.curves import Curve, crossing

CPU = "cpu"
"""The measured clock of this machine (no virtual clock)."""

CLOCKS_FILE = Path(__file__).resolve().parent / "clocks.toml"

_memo: dict[tuple[str, str, int, int], float] = {}
"""(clock sha, clock, responses, step) → step seconds: fixed settings at one batch share every step."""


def clocks_sha256(path: Path = CLOCKS_FILE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_clocks(names: list[str], path: Path = CLOCKS_FILE) -> dict[str, Any]:
    """{name: Clock} for each name (``cpu`` → None); an unknown name raises naming the file's clocks."""
    from megarl.coordinator.clock import Clock

    return {n: None if n == CPU else Clock.load(path, n) for n in dict.fromkeys(names)}


def step_batches(recs: list[dict[str, Any]]) -> list[int]:
    """Responses trained at steps 1..N of ``metrics.jsonl`` records (index k = step k + 1)."""
    by_step = {int(r["step"]): int(r.get("rollout/responses", 0)) for r in recs if "timing/step/total" in r}
    last = max(by_step, default=0)
    missing = [s for s in range(1, last + 1) if s not in by_step]
    if missing:
        raise ValueError(f"metrics have no step record for steps {missing[:5]}")
    return [by_step[s] for s in range(1, last + 1)]


def step_s(clock: Any, responses: int, step: int) -> float:
    """The clock's seconds for run step ``step`` (1-based) training ``responses`` (memoised)."""
    from megarl.coordinator.clock import PHASES

    key = (clock.sha256, clock.name, responses, step)
    if key not in _memo:
        times = clock.phase_times(responses, step - 1)  # the planner observes step s as s - 1
        _memo[key] = float(sum(times[k] for k in PHASES))
    return _memo[key]


def recost(curve: Curve, batches: list[int], clock: Any) -> Curve:
    """``curve`` with each evaluation's cumulative train time charged by ``clock``."""
    if curve.steps and curve.steps[-1] > len(batches):
        raise ValueError(f"curve reaches step {curve.steps[-1]} but only {len(batches)} step batches are recorded")
    cum, t = [0.0], 0.0
    for k, n in enumerate(batches, start=1):
        t += step_s(clock, n, k)
        cum.append(t)
    return Curve(curve.steps, [cum[s] for s in curve.steps], curve.samples, curve.reward)


def per_sample(times: list[float], samples: list[float]) -> list[float | None]:
    """Cost per sample, s/response (None where the target was met before any sample)."""
    return [t / n if n > 0 else None for t, n in zip(times, samples)]


def on_clock(res: dict[str, Any], name: str, clock: Any, targets: list[float], half: int) -> dict[str, Any]:
    """``res`` (a cached run result) as seen on clock ``name``: ``time_s`` and ``step_s`` on that
    clock, ``cpu_s`` the measured CPU train time to each target beside it, ``cost_per_sample``;
    the variant keeps its name without the ``@clock`` a coordinator run carries."""
    out = {**res, "variant": res["variant"].split("@")[0], "clock": name, "cpu_s": list(res["time_s"])}
    if clock is not None:
        if "step_batches" not in res:
            raise ValueError(f"result {res['key']} has no step_batches (made before --clock): delete it to rerun")
        curve = recost(Curve(**res["curve"]), res["step_batches"], clock)
        cross = [crossing(curve, t, half=half) for t in targets]
        out |= {"curve": curve.to_dict(), "time_s": [c.time_s for c in cross]}
        out["step_s"] = curve.train_s[-1] / max(curve.steps[-1], 1)
        # the crossing's samples and steps are the CPU curve's (read from rewards alone)
        assert all(math.isclose(c.samples, s, abs_tol=1e-6) for c, s in zip(cross, res["samples"]))
    out["cost_per_sample"] = per_sample(out["time_s"], res["samples"])
    return out


def clock_view(
    results: list[dict[str, Any]], name: str, clock: Any, targets: list[float], half: int
) -> list[dict[str, Any]]:
    """The results that count on clock ``name``: every fixed setting (re-costed) and the
    coordinator runs made under that clock."""
    keep = [r for r in results if r["kind"] != "coord" or r.get("clock", CPU) == name]
    return [on_clock(r, name, clock, targets, half) for r in keep]


def decompose(a: dict[str, Any], b: dict[str, Any], i: int) -> dict[str, float] | None:
    """a's time / b's time at target ``i`` = statistical (samples) × systems (cost per sample)
    factor; None where either missed it or met it before any sample."""
    if not (a["reached"][i] and b["reached"][i]) or min(a["samples"][i], b["samples"][i]) <= 0:
        return None
    stat = a["samples"][i] / b["samples"][i]
    time = a["time_s"][i] / b["time_s"][i]
    return {"time": time, "statistical": stat, "systems": time / stat}
