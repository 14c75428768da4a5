"""Validation curves of one run and where they cross a target (pure; tested in
tests/benchmarks/test_ttt_curves.py).

A run's ``metrics.jsonl`` gives, per RL step, its step time (``timing/step/total``: generate
to plan, so validation and checkpoint time are excluded) and its responses
(``rollout/responses``), and every ``train.eval_every_samples`` responses a greedy validation
reward.
Validation on ~600 prompts still has binomial noise (±0.02 at 0.5), so the crossing is read
from a smoothed curve, not from the first lucky evaluation:

* **smoothing** — a running line: at each evaluation, the least-squares line through the
  ``2·half + 1`` nearest evaluations (fewer at the ends) in step index. On equally spaced
  evaluations this is the centred moving average inside the curve, and at the ends it
  follows the trend instead of lagging it (a moving average there is biased towards the
  interior);
* **crossing** — the first evaluation whose smoothed reward is ≥ the target, among those
  with their whole window after them (``half`` later evaluations); time, steps and samples
  are interpolated linearly between it and the evaluation before. At a run's last
  evaluations the line is fitted to fewer, earlier points, so it leans on the last raw
  value — and a run that stops on a high raw evaluation (``train.target_val_reward``) would
  otherwise read its crossing from the very point that stopped it, earlier the sooner it is
  cut: the benchmark runs ``train.evals_past_target`` = ``2·half`` validations past that.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Curve:
    """One run's validation curve; index i is one evaluation (0 = before the first step)."""

    steps: list[int]
    train_s: list[float]
    """Cumulative RL step time at that evaluation, s (validation excluded)."""
    samples: list[int]
    """Cumulative responses at that evaluation."""
    reward: list[float]
    """Greedy validation reward."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Crossing:
    reached: bool
    time_s: float
    """Interpolated train time to the target; if not reached, the whole run's (a lower bound)."""
    steps: float
    samples: float


def curve_from_records(recs: list[dict[str, Any]], clock: Any = None) -> Curve:
    """The curve of ``metrics.jsonl`` records (``megarl.metrics.read_metrics``).

    Several validation values at one step (a mid-run evaluation and the final one) are averaged.
    ``clock`` (a :class:`megarl.coordinator.clock.Clock`): each step's time is the clock's, not
    this machine's (:func:`virtual_step_s`; a fixed setting learns the same whatever the clock,
    so one run serves every clock)."""
    step_s: dict[int, float] = {}
    step_n: dict[int, int] = {}
    vals: dict[int, list[float]] = {}
    for r in recs:
        s = int(r["step"])
        if "timing/step/total" in r:
            step_s[s] = float(r["timing/step/total"]) if clock is None else virtual_step_s(clock, r)
            step_n[s] = int(r.get("rollout/responses", 0))
        v = r.get("val/reward")
        if isinstance(v, (int, float)) and math.isfinite(v):
            vals.setdefault(s, []).append(float(v))
    if 0 not in vals:
        raise ValueError("metrics have no validation reward at step 0 (the start of RL)")
    steps, train_s, samples, reward = [], [], [], []
    t, n = 0.0, 0
    done = 0
    for s in sorted(vals):
        for k in range(done + 1, s + 1):
            if k not in step_s:
                raise ValueError(f"metrics have a validation at step {s} but no step time for step {k}")
            t, n = t + step_s[k], n + step_n[k]
        done = s
        steps.append(s)
        train_s.append(t)
        samples.append(n)
        reward.append(sum(vals[s]) / len(vals[s]))
    return Curve(steps, train_s, samples, reward)


def virtual_step_s(clock: Any, rec: dict[str, Any]) -> float:
    """A step record's time on ``clock``: its batch costed by the clock — what the planner logged
    as ``vclock/step_s`` if the run ran under this clock (the run's step ``s`` is the clock's
    step ``s - 1``: the planner observes steps from 0), and a fixed setting's steps re-costed."""
    from megarl.coordinator.clock import PHASES

    times = clock.phase_times(int(rec["rollout/responses"]), int(rec["step"]) - 1)
    return float(sum(times[k] for k in PHASES))


def smooth(y: list[float], half: int = 1) -> list[float]:
    """Running-line smoother over equally weighted neighbours (see the module docstring)."""
    n = len(y)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        xs = list(range(lo, hi))
        ys = y[lo:hi]
        if len(xs) == 1:
            out.append(ys[0])
            continue
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (v - my) for x, v in zip(xs, ys)) / sxx
        out.append(my + slope * (i - mx))
    return out


def crossing(curve: Curve, target: float, half: int = 1) -> Crossing:
    """Where the smoothed curve first reaches ``target`` (interpolated), or the run's end.
    Only evaluations with ``half`` more after them count (see the module docstring)."""
    sm = smooth(curve.reward, half)
    for i, v in enumerate(sm[: max(len(sm) - half, 1)]):
        if v < target:
            continue
        if i == 0:
            return Crossing(True, 0.0, 0.0, 0.0)
        f = (target - sm[i - 1]) / (v - sm[i - 1])

        def at(xs: list[float] | list[int], i: int = i, f: float = f) -> float:
            return float(xs[i - 1] + f * (xs[i] - xs[i - 1]))

        return Crossing(True, at(curve.train_s), at(curve.steps), at(curve.samples))
    return Crossing(False, curve.train_s[-1], float(curve.steps[-1]), float(curve.samples[-1]))
