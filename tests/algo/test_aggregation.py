"""Loss aggregation: loop definitions, and invariance to how the batch is split."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.aggregation import (
    LOSS_AGG_MODES,
    aggregate,
    denominator_stats,
    global_denominator,
    make_denominator,
)

FIXED_NORMALIZER = 16.0


def _batch(seed: int, b: int = 11, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 0  # full and empty responses
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return x, mask


def _per_token_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-token loss depending on a shared parameter ``w`` (T,)."""
    return torch.sin(x * w) + 0.5 * (x - w) ** 2


def ref_aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    """The modes written out as their textbook definitions, with python loops."""
    rows = []
    for i in range(loss.shape[0]):
        vals = [float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]]
        if vals:
            rows.append(vals)
    if mode == "token-mean":
        flat = [v for row in rows for v in row]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    assert mode == "seq-mean-token-sum-norm"
    return sum(sum(row) for row in rows) / (len(rows) * FIXED_NORMALIZER)


def _random_parts(seed: int, b: int, k: int) -> list[torch.Tensor]:
    """Shuffle the rows and cut them into k uneven (possibly empty) parts."""
    g = torch.Generator().manual_seed(seed + 7)
    perm = torch.randperm(b, generator=g)
    cuts = sorted(torch.randint(0, b + 1, (k - 1,), generator=g).tolist())
    bounds = [0, *cuts, b]
    return [perm[bounds[j] : bounds[j + 1]] for j in range(k)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_unsplit_matches_loop_definition(seed: int, mode: str) -> None:
    x, mask = _batch(seed)
    loss = _per_token_loss(torch.linspace(-1, 1, x.shape[1], dtype=torch.float64), x)
    denom = global_denominator(mode, mask, fixed_normalizer=FIXED_NORMALIZER)
    out = aggregate(loss, mask, mode=mode, global_denominator=denom)
    assert out.item() == pytest.approx(ref_aggregate(loss, mask, mode), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_split_sum_equals_full_value_and_grad(seed: int, mode: str, k: int) -> None:
    x, mask = _batch(seed)
    w_full = torch.linspace(-1, 1, x.shape[1], dtype=torch.float64).requires_grad_(True)
    w_split = w_full.detach().clone().requires_grad_(True)

    denom = global_denominator(mode, mask, fixed_normalizer=FIXED_NORMALIZER)
    full = aggregate(_per_token_loss(w_full, x), mask, mode=mode, global_denominator=denom)
    full.backward()

    # Each part plays a DP rank / micro-batch: local counts, "all-reduced" by summing.
    parts = _random_parts(seed, x.shape[0], k)
    local = [denominator_stats(mask[p]) for p in parts]
    tokens = sum(s["tokens"] for s in local)
    seqs = sum(s["seqs"] for s in local)
    denom_reduced = make_denominator(
        mode, tokens=tokens, seqs=seqs, fixed_normalizer=FIXED_NORMALIZER
    )
    assert denom_reduced == denom
    total = torch.zeros((), dtype=torch.float64)
    for p in parts:
        part = aggregate(
            _per_token_loss(w_split, x[p]), mask[p], mode=mode, global_denominator=denom
        )
        part.backward()  # gradients accumulate across micro-batches
        total = total + part.detach()

    assert total.item() == pytest.approx(full.item(), abs=1e-6, rel=0)
    assert w_full.grad is not None and w_split.grad is not None
    torch.testing.assert_close(w_split.grad, w_full.grad, atol=1e-6, rtol=0)
    assert w_full.grad.abs().max().item() > 1e-3  # a real gradient was compared


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_local_mean_would_differ(mode: str) -> None:
    """Sanity: naive per-part normalisation is NOT split-invariant on this batch."""
    x, mask = _batch(0)
    loss = _per_token_loss(torch.ones(x.shape[1], dtype=torch.float64), x)
    full = ref_aggregate(loss, mask, mode)
    parts = [torch.arange(0, 3), torch.arange(3, x.shape[0])]
    naive = sum(ref_aggregate(loss[p], mask[p], mode) for p in parts) / len(parts)
    assert abs(naive - full) > 1e-3


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_rows_change_nothing(mode: str) -> None:
    x, mask = _batch(1)
    loss = _per_token_loss(torch.ones(x.shape[1], dtype=torch.float64), x)
    padded_loss = torch.cat([loss, torch.full((3, x.shape[1]), float("nan"))])
    padded_mask = torch.cat([mask, torch.zeros(3, x.shape[1])])
    d = global_denominator(mode, mask, fixed_normalizer=FIXED_NORMALIZER)
    d_pad = global_denominator(mode, padded_mask, fixed_normalizer=FIXED_NORMALIZER)
    assert d == d_pad
    a = aggregate(loss, mask, mode=mode, global_denominator=d)
    b = aggregate(padded_loss, padded_mask, mode=mode, global_denominator=d_pad)
    assert a.item() == b.item()


def test_denominators_and_errors() -> None:
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]])
    stats = denominator_stats(mask)
    assert (stats["tokens"].item(), stats["seqs"].item()) == (4.0, 2.0)
    assert global_denominator("token-mean", mask) == 4.0
    assert global_denominator("seq-mean-token-mean", mask) == 2.0
    assert global_denominator("seq-mean-token-sum", mask) == 2.0
    assert global_denominator("seq-mean-token-sum-norm", mask, fixed_normalizer=8) == 16.0
    assert make_denominator("token-mean", tokens=0, seqs=0) == 1.0
    empty = aggregate(
        torch.ones(2, 3), torch.zeros(2, 3), mode="token-mean", global_denominator=1.0
    )
    assert empty.item() == 0.0
    with pytest.raises(ValueError, match="needs fixed_normalizer"):
        make_denominator("seq-mean-token-sum-norm", tokens=4, seqs=2)
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'mean'.*token-mean"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), mode="mean", global_denominator=1.0)
