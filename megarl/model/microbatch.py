"""Token-budget micro-batches: which rows run together, and how wide (``parallel.max_tokens_per_micro_batch``).

With fixed-row micro-batches every row is padded to the batch's longest sequence; with real
response lengths (a few tokens to hundreds) most of the compute is padding. Here a DP rank's
rows are sorted by their real length and packed greedily into micro-batches whose
``rows × own longest length`` stays within a token budget, and each micro-batch keeps only
its own longest row's columns. Pure functions of the lengths: every rank of a pipeline / TP
group computes the same partition without communicating.

Why cutting columns changes nothing: attention is causal, so the outputs at positions
``< L`` depend only on tokens ``< L``; a row's loss reads positions where ``mask = 1``, the
last of which, ``t``, needs the label ``tokens[t+1]``, so a row needs ``L = t + 2`` columns
(:func:`row_lengths`). Losses are divided by a GLOBAL denominator
(``megarl.algo.aggregation``), so any grouping of rows sums to the same objective.

With ``parallel.pack_sequences`` the same micro-batches run padding-free
(``megarl.model.packing``): each then carries its rows' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # (b,) long, indices into the rank's batch, ascending
    width: int
    """Columns kept: the longest of its rows' lengths."""
    lengths: torch.Tensor | None = None  # (b,) long, each row's length when it runs packed


def row_lengths(mask: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B,) long
    """Columns each row needs: its last response position + 2 (the label of that position is
    the next token), at least 1 (a row without response tokens only has to be present)."""
    if mask.dim() != 2:
        raise ValueError(f"expected mask (B, S), got shape {tuple(mask.shape)}")
    S = mask.shape[1]
    pos = torch.arange(S, device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, torch.full_like(pos, -1)).max(dim=1).values
    return (last + 2).clamp(min=1, max=S).long().cpu()


def token_budget_split(
    lengths: torch.Tensor, max_tokens: int, overhead: int | None = None, packed: bool = False
) -> list[MicroBatch]:
    """Rows sorted by length (longest first, ties by index), cut into runs that minimise
    ``Σ rows × width + overhead × micro-batches`` subject to ``rows × width ≤ max_tokens``.

    ``packed``: the same micro-batches carry their rows' lengths and run padding-free
    (``megarl.model.packing``). The cut stays the padded one on purpose: a training loss reads
    the packed output unpacked to (rows, width, vocab/TP) logits, so rows × width still costs
    memory-bound loss-head work (a cut for the fewest micro-batches, 3 instead of 6 on
    ``benchmarks/token_budget.py``, was no faster on CPU: 2.150 s vs 2.147 s padded), and
    ``rows × width ≤ max_tokens`` keeps bounding those logits.

    ``overhead``: what one more micro-batch costs, in tokens (default: one row of the longest
    length) — without it the optimum would be one row per micro-batch. Runs of similar lengths
    waste little padding; a dynamic programme over the cut points finds the best runs exactly,
    in O(rows × rows per micro-batch). A row longer than the budget runs alone (config
    validation keeps the budget ≥ the longest possible row)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be > 0")
    lens = [int(x) for x in lengths]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    ls = [lens[i] for i in order]
    n = len(ls)
    over = (ls[0] if ls else 0) if overhead is None else overhead
    best = [0] + [-1] * n  # best[j]: least cost of the first j sorted rows; cut[j]: its last run's start
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # last run = sorted rows i..j-1, width ls[i]
            if i < j - 1 and (j - i) * ls[i] > max_tokens:
                break  # wider and longer runs only cost more tokens
            c = best[i] + (j - i) * ls[i] + over
            if best[j] < 0 or c < best[j]:
                best[j], cut[j] = c, i
    runs: list[tuple[int, int]] = []
    j = n
    while j > 0:
        runs.append((cut[j], j))
        j = cut[j]
    mbs = []
    for i, j in reversed(runs):
        rows = torch.tensor(sorted(order[i:j]), dtype=torch.long)
        mbs.append(MicroBatch(rows, ls[i], torch.tensor([lens[r] for r in rows.tolist()]) if packed else None))
    return mbs


def balance_rows(lengths: torch.Tensor, parts: int, shares: list[float] | None = None) -> list[torch.Tensor]:
    """Split rows over ``parts`` DP ranks with equal tokens (or tokens ∝ ``shares``): greedy
    longest-processing-time (each row, longest first, to the rank with the least load/share);
    its makespan is within 4/3 of the optimum (Graham 1969). Every rank gets ≥ 1 row when
    there are ≥ ``parts`` rows. Returns each rank's row indices, ascending."""
    w = shares if shares is not None else [1.0] * parts
    if len(w) != parts or min(w) <= 0:
        raise ValueError(f"shares={shares} must be {parts} positive numbers")
    lens = [int(x) for x in lengths]
    load = [0.0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        r = min(range(parts), key=lambda r: (load[r] / w[r], r))
        members[r].append(i)
        load[r] += lens[i]
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members]


def take(batch: dict[str, torch.Tensor], mb: MicroBatch) -> dict[str, torch.Tensor]:
    """The micro-batch's rows, per-token tensors (B, S, ...) cut to its width; per-row (B,) kept."""
    return {k: v[mb.rows, : mb.width] if v.dim() >= 2 else v[mb.rows] for k, v in batch.items()}


def padded_tokens(mbs: list[MicroBatch]) -> int:
    """Tokens the micro-batches compute, padding included (Σ rows × width; real tokens when packed)."""
    return sum(int(mb.lengths.sum()) if mb.lengths is not None else int(mb.rows.numel()) * mb.width for mb in mbs)
