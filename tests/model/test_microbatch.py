"""Token-budget micro-batches (``megarl.model.microbatch``): the partitions cover every row once,
respect the budget, balance DP ranks by tokens, and — with megarl's global denominators — sum
to the full-batch loss for every aggregation mode, though the micro-batches are unequal."""

import pytest
import torch

from megarl import algo
from megarl.model.microbatch import (
    MicroBatch,
    balance_rows,
    padded_tokens,
    row_lengths,
    take,
    token_budget_split,
)


def _mixed_mask(n: int = 64, prompt: int = 12, seed: int = 0) -> torch.Tensor:
    """(n, S) response masks with lengths drawn from 5..256 after a fixed prompt."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(5, 257, (n,), generator=g)
    S = prompt + 256 + 1
    mask = torch.zeros(n, S)
    for i, r in enumerate(resp.tolist()):
        mask[i, prompt - 1 : prompt - 1 + r] = 1.0
    return mask


def test_row_lengths_keep_the_label_of_the_last_response_position() -> None:
    mask = torch.zeros(3, 8)
    mask[0, 2:5] = 1  # last response position 4 predicts tokens[5]: 6 columns
    mask[1, 6] = 1  # the last position is always masked: 6 -> the whole row
    assert row_lengths(mask).tolist() == [6, 8, 1]  # row 2: no response tokens


def test_split_covers_every_row_once_within_the_budget() -> None:
    lengths = row_lengths(_mixed_mask())
    mbs = token_budget_split(lengths, 1024)
    rows = torch.cat([mb.rows for mb in mbs])
    assert sorted(rows.tolist()) == list(range(64))
    for mb in mbs:
        assert mb.width == int(lengths[mb.rows].max())
        assert mb.rows.numel() * mb.width <= 1024
    assert len({mb.rows.numel() for mb in mbs}) > 1  # unequal micro-batches
    # far less padding than 8-row micro-batches padded to the batch's longest row
    fixed = 64 * int(lengths.max())
    assert padded_tokens(mbs) < 0.7 * fixed, (padded_tokens(mbs), fixed)
    assert padded_tokens(mbs) < 1.1 * int(lengths.sum())


@pytest.mark.parametrize("seed", range(5))
def test_split_is_the_best_cut_of_the_sorted_rows(seed: int) -> None:
    """The dynamic programme against brute force over every cut of the sorted rows."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (9,), generator=g)
    budget, over = 80, 15
    ls = sorted(lengths.tolist(), reverse=True)

    def cost(bounds: tuple[int, ...]) -> float:
        edges = [0, *bounds, len(ls)]
        runs = [(ls[i], j - i) for i, j in zip(edges, edges[1:])]
        if any(n > 1 and n * w > budget for w, n in runs):
            return float("inf")
        return sum(n * w + over for w, n in runs)

    brute = min(cost(c) for k in range(len(ls)) for c in itertools.combinations(range(1, len(ls)), k))
    mbs = token_budget_split(lengths, budget, overhead=over)
    assert padded_tokens(mbs) + over * len(mbs) == brute
    assert sorted(torch.cat([mb.rows for mb in mbs]).tolist()) == list(range(9))


def test_a_row_longer_than_the_budget_runs_alone() -> None:
    mbs = token_budget_split(torch.tensor([50, 10, 10]), 40)
    assert [(mb.rows.tolist(), mb.width) for mb in mbs] == [([0], 50), ([1, 2], 10)]
    with pytest.raises(ValueError, match="max_tokens=0"):
        token_budget_split(torch.tensor([3]), 0)


@pytest.mark.parametrize("shares", [None, [0.25, 0.75]])
def test_balance_rows_by_tokens(shares: list[float] | None) -> None:
    lengths = row_lengths(_mixed_mask(seed=3))
    parts = balance_rows(lengths, 2, shares)
    assert sorted(torch.cat(parts).tolist()) == list(range(64))
    loads = [int(lengths[p].sum()) for p in parts]
    w = shares or [0.5, 0.5]
    target = [x * int(lengths.sum()) for x in w]
    for load, t in zip(loads, target):  # LPT: within one longest row of the target
        assert abs(load - t) <= int(lengths.max()), (loads, target)
    # equal rows (today's DP split) are far less even in tokens on this batch
    if shares is None:
        halves = [int(lengths[:32].sum()), int(lengths[32:].sum())]
        assert abs(loads[0] - loads[1]) < abs(halves[0] - halves[1])


def test_every_rank_gets_a_row() -> None:
    parts = balance_rows(torch.tensor([100, 1, 1, 1]), 4, [0.97, 0.01, 0.01, 0.01])
    assert all(p.numel() == 1 for p in parts)
    with pytest.raises(ValueError, match="positive"):
        balance_rows(torch.tensor([1, 2]), 2, [1.0, 0.0])


def test_take_cuts_per_token_tensors_only() -> None:
    batch = {"tokens": torch.arange(12).reshape(3, 4), "adv": torch.tensor([1.0, 2.0, 3.0])}
    out = take(batch, MicroBatch(torch.tensor([0, 2]), 2))
    assert out["tokens"].tolist() == [[0, 1], [8, 9]]
    assert out["adv"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
def test_unequal_micro_batches_sum_to_the_full_loss(mode: str) -> None:
    """Every aggregation mode: the global denominator over the whole batch makes the sum over
    token-budget micro-batches (cut columns, balanced DP ranks) the full-batch loss and grad."""
    mask = _mixed_mask(n=32, seed=5)
    lengths = row_lengths(mask)
    g = torch.Generator().manual_seed(1)
    per_tok = torch.randn(mask.shape, generator=g, dtype=torch.float64).requires_grad_()
    denom = algo.global_denominator(mode, mask, fixed_normalizer=256.0)
    full = algo.aggregate(per_tok, mask, mode=mode, global_denominator=denom)
    (full_grad,) = torch.autograd.grad(full, per_tok)
    total = torch.zeros((), dtype=torch.float64)
    for rows in balance_rows(lengths, 2):
        for mb in token_budget_split(lengths[rows], 700):
            part = take({"l": per_tok[rows], "m": mask[rows]}, mb)
            total = total + algo.aggregate(part["l"], part["m"], mode=mode, global_denominator=denom)
    (grad,) = torch.autograd.grad(total, per_tok)
    assert abs(float(total) - float(full)) < 1e-12
    assert torch.allclose(grad, full_grad, atol=1e-15)
    # the naive per-micro-batch mean would not be the full objective (the test can fail)
    naive = sum(
        float(
            algo.aggregate(
                per_tok[mb.rows, : mb.width],
                mask[mb.rows, : mb.width],
                mode=mode,
                global_denominator=algo.global_denominator(mode, mask[mb.rows], fixed_normalizer=256.0),
            )
        )
        for mb in token_budget_split(lengths, 700)
    )
    assert abs(naive - float(full)) > 1e-3
