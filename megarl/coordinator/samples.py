"""Choosing prompts per step and samples per prompt together (``coordinator.choose:
prompts_and_samples``), from the noise split by prompt (`noise_split`).

With P prompts × S samples the step's mean gradient has tr Var = σ_b²/P + σ_w²/(P·S): the batch of
the reference group size S_ref (the one B_noise is measured at) that is as noisy is the effective
batch B_eff = P·S/ρ(S), ρ(S) = T(S)/T(S_ref) = (1 - ω)·S/S_ref + ω, ω the within-prompt share of
the per-response noise at S_ref (`noise_split.effective_batch`). McCandlish et al.'s steps to a
target depend on the step's noise only, so the progress of a rollout is that of B_eff responses at
S_ref, and its cost is that of P·S responses: the goodput of (P, S) is

    goodput(P, S) = B_eff/t(P·S) · (B_noise + B0)/(B_noise + B_eff)

(`goodput.goodput` at B_eff with the step time of P·S responses; at S = S_ref it is the total
mode's goodput exactly). The step-time model is per response (`throughput.StepTimeModel`, which
cannot tell a per-prompt cost from a per-response one while S is fixed); a cost per prompt
beside its responses' — a prompt's prefill where the engine does not share it over the samples,
a per-prompt environment — is ``coordinator.prompt_cost_s`` seconds, added as prompt_s·P.

Why S moves at all: at a fixed P·S, σ_b²/P + σ_w²/(P·S) is smallest with the most prompts, so
by noise alone the smallest S always wins, by a margin that vanishes as the between part does.
Only a cost per prompt makes more samples pay: with prompt_s > 0 and the noise mostly within
prompts the best S rises (towards the bound), with it mostly between prompts it stays low.

The candidates are every S of the run's layouts (`SamplesLayout`: S a multiple of 2 × the
micro-batch, so each group's halves stay whole micro-batches and the split stays measured) and,
for each, its own prompt grid (its batch divisor and smallest measurable batch).

Invariants: pure Python; batches in responses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config import CoordinatorConfig
from megarl.config.cross import probe_min_batch
from megarl.coordinator.goodput import BatchGrid, TimeModel, goodput
from megarl.coordinator.noise_split import effective_batch


@dataclass(frozen=True, kw_only=True)
class SamplesLayout:
    """What one samples-per-prompt value asks of the batch (the planner derives it per S)."""

    samples: int
    """Responses per prompt."""
    batch_divisor: int
    """Responses per step must be a multiple of this at this S (DP × probe part × mini-batches)."""
    min_batch: int
    """Smallest batch (responses) the probe can measure at this S."""


@dataclass(frozen=True, kw_only=True)
class PromptsAndSamples:
    """A (P, S) choice and why."""

    prompts: int
    samples: int
    goodput: float
    """Predicted goodput (B0-equivalent responses/s) of the choice."""
    gain: float
    """Its goodput over the current (P, S)'s, minus 1."""
    reason: str


def best_prompts_and_samples(
    grids: dict[int, BatchGrid],
    b_noise: float,
    share: float,
    time_model: TimeModel,
    current: tuple[int, int],
    *,
    b0: float,
    min_gain: float,
    prompt_s: float = 0.0,
    factor: float = 0.0,
) -> PromptsAndSamples:
    """The goodput argmax over every (P, S) of ``grids`` (per S its prompt grid); ``b_noise``: per
    rollout at the current S (S_ref), ``share``: ω at S_ref, ``prompt_s``: seconds per prompt
    beside its responses' (``coordinator.prompt_cost_s``). Of equal goodputs (all the noise
    within prompts and no prompt cost: only P·S matters) the larger S wins: fewer prompts never
    cost more. Keeps ``current`` unless the best gains more than ``min_gain``. ``factor`` > 0: only
    batches (P·S) within that factor of the current one (``track_factor``, `decisions.limit_move`)."""
    p0, s0 = current

    def score(p: int, s: int) -> float:
        t = time_model.predict(float(p * s)) + prompt_s * p
        return goodput(effective_batch(p, s, share, s0), b_noise, b0, t)

    cur = score(p0, s0)
    best = (cur, p0, s0)
    for s, grid in sorted(grids.items()):
        for p in grid.prompts():
            if factor > 0 and not p0 * s0 / factor <= p * s <= p0 * s0 * factor:
                continue
            g = score(p, s)
            if g > best[0] * (1 + 1e-12) or (g >= best[0] * (1 - 1e-12) and s > best[2]):
                best = (g, p, s)
    g, p, s = best
    gain = g / cur - 1.0
    what = f"b_noise={b_noise:.4g} responses at S={s0}, within share {share:.2f}"
    if (p, s) != (p0, s0) and gain > min_gain:
        reason = f"switch {p0}x{s0} -> {p}x{s} prompts x samples: predicted goodput +{100 * gain:.1f}% ({what})"
        return PromptsAndSamples(prompts=p, samples=s, goodput=g, gain=gain, reason=reason)
    reason = f"keep {p0}x{s0} prompts x samples: best {p}x{s} gains {100 * gain:.1f}% ({what})"
    return PromptsAndSamples(prompts=p0, samples=s0, goodput=cur, gain=gain, reason=reason)


def near(layouts: list[SamplesLayout], current: int, factor: float) -> list[SamplesLayout]:
    """The layouts within ``factor`` of the current S (a settled estimate's move is at most
    ``factor``, as for prompts: `decisions.limit_move`); ``factor`` 0: all."""
    if factor <= 0:
        return list(layouts)
    return [x for x in layouts if current / factor <= x.samples <= current * factor]


def samples_layouts(
    c: CoordinatorConfig, samples: int, mbs: int, mini_batches: int, dp: int, critic_dp: int | None, ep: int
) -> list[SamplesLayout]:
    """choose=prompts_and_samples: the samples-per-prompt values on offer — multiples of 2 × the
    micro-batch ``mbs`` (each group's halves whole micro-batches) in the bounds, on the
    coordinator's geometric grid, the configured ``samples`` among them — and what each asks of the
    batch (as the planner's CoordinatorRun at one S: DP ranks of actor and critic × the probe's
    part × mini-batches; `probe_min_batch`). Empty for choose=total."""
    if c.choose != "prompts_and_samples":
        return []
    step = 2 * mbs
    lo, hi = -(-c.min_samples_per_prompt // step) * step, c.max_samples_per_prompt // step * step
    values, x = {samples, *((lo, hi) if 0 < lo <= hi else ())}, float(lo)  # both ends, as `BatchGrid`
    while 0 < lo and x <= hi:
        values.add(min(max(round(x / step) * step, lo), hi))
        x *= c.grid_factor
    ranks = math.lcm(dp, critic_dp or dp)
    out = []
    for s in sorted(values):
        part = math.lcm(mbs, s)
        out.append(
            SamplesLayout(
                samples=s,
                batch_divisor=ranks * part * mini_batches,
                min_batch=probe_min_batch(part, mini_batches, dp, critic_dp, ep),
            )
        )
    return out
