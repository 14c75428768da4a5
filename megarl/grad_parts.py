"""The grad probe's reading of one update as the coordinator's parts (`ModelGradStats`).

Which rows each part holds: a DP rank's rows (``source="dp"``), or its runs of micro-batches
that hold whole GRPO groups (``"microbatch"``), rank-major. Under expert parallelism (EP > 1)
the routed experts are a class of their own whose parts are unions over each EP group (the
ranks' parts of the same index: the tokens the all-to-all brought the group's experts;
``megarl.coordinator.noise.expert_parallel_estimates`` has the derivation). Each part counts
only its units with reward signal, and every norm is rescaled from the loss's global
denominator to its part's own mean gradient (docs/COORDINATOR.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.coordinator import ExpertGradStats, ModelGradStats
from megarl.model.grad_stats import GradProbe, rescale


@dataclass(frozen=True, kw_only=True)
class ExpertParts:
    """The experts' reading at EP > 1: per part its squared norm and rows, and the global norm."""

    sq: list[float]
    """Sum-scaled |g_j|² of each EP group's part, each expert once (`GradProbe.gather_experts`)."""
    rows: list[list[slice]]
    """The rows of each part: one slice per rank of its EP group."""
    global_sq: float
    """Sum-scaled |G|² of the experts' reduced gradient."""


def chunks(sl: slice, mbs: int) -> list[slice]:
    """The micro-batches ``train_step`` cuts ``sl`` into (the last may be short)."""
    start, stop = sl.start or 0, sl.stop
    return [slice(a, min(a + mbs, stop)) for a in range(start, stop, mbs)]


def read_parts(probe: GradProbe, every: list[slice], mbs: int) -> tuple[list[float], list[slice], ExpertParts | None]:
    """(each part's sum-scaled |g|², its rows, the experts' parts at EP > 1) of a probe's reading;
    ``every``: each DP rank's rows, ``mbs``: the micro-batch size. A collective over DP."""
    dims = probe.dims
    if probe.microbatch:  # runs of micro-batches holding whole groups
        by_rank = [chunks(sl, mbs * probe.microbatches_per_part) for sl in every]
        parts = probe.gather_microbatches() if dims.dp > 1 else probe.mb_sq
    else:
        by_rank, parts = [[sl] for sl in every], probe.gather_local()
    rows = [r for rank in by_rank for r in rank]
    if len(parts) != len(rows):
        raise RuntimeError(f"grad probe saw {len(parts)} parts, expected {len(rows)}")
    if probe.classes == 1:
        return parts, rows, None
    groups = [by_rank[g : g + dims.ep] for g in range(0, dims.dp, dims.ep)]  # consecutive DP ranks
    union = [[rank[k] for rank in group] for group in groups for k in range(len(group[0]))]
    sq = [x for group in probe.gather_experts() for x in group]
    if len(sq) != len(union) or any(len(rank) != len(group[0]) for group in groups for rank in group):
        raise RuntimeError(f"grad probe saw {len(sq)} expert parts, expected {len(union)} (equal runs per EP rank)")
    assert probe.expert_global_sq is not None, "the EP probe saw no DP reduction"
    return parts, rows, ExpertParts(sq=sq, rows=union, global_sq=probe.expert_global_sq)


def read_split(probe: GradProbe) -> list[float] | None:
    """Each part's halves' |Δ_1 - Δ_2|² (sum-scaled), rank-major like the parts, when the probe
    read them (``GradProbe.split``); a collective over DP then."""
    if not probe.split:
        return None
    return probe.gather_split() if probe.dims.dp > 1 else probe.split_sq


def split_unreadable(microbatch: bool, ep: int, samples: int, mbs: int) -> str | None:
    """Why a probe cannot read the noise split by prompt at ``samples`` per prompt and micro-batch
    ``mbs`` (each part must be one GRPO group whose halves are whole micro-batches); None: it can."""
    if not microbatch:
        return "the probe's parts are DP ranks, not micro-batches (PP > 1, a token budget, or microbatch_parts off)"
    if ep > 1:
        return "expert parallelism reads the experts' parts as unions over the EP group"
    if samples % (2 * mbs):
        return f"parallel.micro_batch_size={mbs} does not divide samples_per_prompt/2={samples / 2:g}"
    return None


def halves(rows: slice) -> tuple[slice, slice]:
    """A part's two halves: its first and last half of rows (one GRPO group, contiguous)."""
    mid = (rows.start + rows.stop) // 2
    return slice(rows.start, mid), slice(mid, rows.stop)


def grad_stats(
    name: str,
    parts: list[float],
    rows: list[slice],
    units: torch.Tensor,
    signal: torch.Tensor,
    grad_norm: float,
    unit: str,
    source: str,
    experts: ExpertParts | None = None,
    split: list[float] | None = None,
) -> ModelGradStats | None:
    """ModelGradStats over the parts' units with signal; None when fewer than 2 parts have any
    (of either class at EP > 1).

    The loss is divided by D, all units of the mini-batch, so a part's gradient is
    (n/D)·ḡ_part over its n units with signal (rows without signal add no gradient), and the
    step's gradient is (D_s/D)·Ḡ over the D_s units with signal: both are rescaled to means
    over units with signal (× (D/n)², × (D/D_s)²). Parts without signal are left out (their
    norm is ~0 and says nothing about the noise); ``signal_fraction`` tells the coordinator
    which share of the rollout's responses the estimate counts. ``source``: "microbatch" or
    "dp", what the parts are. ``experts``: at EP > 1 the experts' parts (``parts`` and
    ``grad_norm`` then cover the dense parameters), scaled alike over the same D_s. ``split``:
    each part's halves' |Δ_1 - Δ_2|² (`read_split`), rescaled like its part.
    """
    total = float(units.sum())
    weight = units * signal
    kept = _kept(parts, [[r] for r in rows], weight)
    signal_units = sum(n for _, n in kept)
    if len(kept) < 2 or signal_units <= 0:
        return None
    expert_stats = None
    if experts is not None:
        e_kept = _kept(experts.sq, experts.rows, weight)
        if len(e_kept) < 2:
            return None
        expert_stats = ExpertGradStats(
            sq_norms=[rescale(s, n, total) for s, n in e_kept],
            batches=[n for _, n in e_kept],
            global_sq_norm=rescale(experts.global_sq, signal_units, total),
        )
    split_sq = split_halves = None
    if split is not None:
        if len(split) != len(parts):
            raise RuntimeError(f"grad probe saw {len(split)} split parts, expected {len(parts)}")
        per_part = [[float(weight[h].sum()) for h in halves(r)] for r in rows]
        kept_split = [(s, h) for s, h in zip(split, per_part, strict=True) if sum(h) > 0]
        split_sq = [rescale(s, sum(h), total) for s, h in kept_split]
        split_halves = [h for _, h in kept_split]
    return ModelGradStats(
        model=name,
        local_sq_norms=[rescale(s, n, total) for s, n in kept],
        local_batches=[n for _, n in kept],
        global_sq_norm=rescale(grad_norm**2, signal_units, total),
        signal_fraction=float(signal.sum()) / len(signal),  # of all the mini-batch's responses
        batch_unit=unit,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
        grad_average="samples",
        experts=expert_stats,
        split_sq_norms=split_sq,
        split_halves=split_halves,
    )


def _kept(sq: list[float], rows: list[list[slice]], weight: torch.Tensor) -> list[tuple[float, float]]:
    """(|g|², units with signal) of the parts that have any."""
    units = [sum(float(weight[r].sum()) for r in part) for part in rows]
    return [(s, n) for s, n in zip(sq, units, strict=True) if n > 0]
