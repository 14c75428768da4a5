"""Padding-free packing (``megarl.model.packing``): the pack/unpack index maths, per-sequence
positions and boundaries, and the local spec's packed attention against a block-diagonal
causal mask over the whole packed row (the slow, obvious reference). Model-level parity
(log-probs, loss and gradients against the padded paths, every aggregation mode, TP1/TP2/DP2)
is in ``test_parity.py`` (``*_packed`` layouts)."""

import pytest
import torch
import torch.nn.functional as F

from megarl.model.microbatch import padded_tokens, row_lengths, take, token_budget_split
from megarl.model.packing import Packing, packings_of
from megarl.model.sdpa import varlen_causal_attention


def test_pack_unpack_index_maths() -> None:
    p = Packing.of(torch.tensor([3, 1, 4]), width=5)
    assert p.tokens == 8
    assert p.index.tolist() == [0, 1, 2, 5, 10, 11, 12, 13]
    assert p.positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]  # restart at 0 per sequence
    assert p.cu_seqlens.tolist() == [0, 3, 4, 8] and p.cu_seqlens.dtype == torch.int32
    x = torch.arange(15).reshape(3, 5)
    assert p.pack(x).tolist() == [[0, 1, 2, 5, 10, 11, 12, 13]]
    inside = torch.arange(5)[None] < torch.tensor([3, 1, 4])[:, None]
    assert torch.equal(p.unpack(p.pack(x)), x * inside)  # zeros at padding
    h = torch.randn(3, 5, 7)  # trailing dimensions (hidden, vocabulary) travel along
    assert torch.equal(p.unpack(p.pack(h)), h * inside[..., None])


def test_unpack_is_differentiable() -> None:
    p = Packing.of(torch.tensor([2, 3]), width=3)
    y = torch.randn(1, 5, 4, requires_grad=True)
    weights = torch.randn(2, 3, 4)
    (p.unpack(y) * weights).sum().backward()
    assert torch.equal(y.grad, p.pack(weights))  # each packed token gets its own padded slot's weight


def test_bad_lengths_are_named() -> None:
    with pytest.raises(ValueError, match=r"row lengths \[3, 6\] must lie in \[1, width=5\]"):
        Packing.of(torch.tensor([3, 6]), width=5)
    with pytest.raises(ValueError, match=r"row lengths \[0, 2\]"):
        Packing.of(torch.tensor([0, 2]), width=5)
    p = Packing.of(torch.tensor([2, 2]), width=3)
    with pytest.raises(ValueError, match=r"expected \(2, 3, ...\) to pack, got \(2, 4\)"):
        p.pack(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"expected \(1, 4, ...\) to unpack, got \(1, 5, 2\)"):
        p.unpack(torch.zeros(1, 5, 2))


def test_packed_plan_round_trips_a_batch() -> None:
    """The packed plan of a ragged batch: every response position of every row is packed
    exactly once, and unpacking gives back the token-budget micro-batch's columns."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(24, 40)
    for i, r in enumerate(torch.randint(1, 30, (24,), generator=g).tolist()):
        mask[i, 4 : 4 + r] = 1.0
    lengths = row_lengths(mask)
    tokens = torch.randint(3, 100, (24, 40), generator=g)
    plan = token_budget_split(lengths, 120, packed=True)
    padded = token_budget_split(lengths, 120)
    assert padded_tokens(plan) == int(lengths.sum()) < padded_tokens(padded)  # no padding computed
    # the padded split's micro-batches, each with its rows' own lengths in row order
    assert [(mb.rows.tolist(), mb.width) for mb in plan] == [(mb.rows.tolist(), mb.width) for mb in padded]
    assert all(mb.lengths is not None and mb.lengths.tolist() == lengths[mb.rows].tolist() for mb in plan)
    seen = 0
    for mb, pk in zip(plan, packings_of(plan), strict=True):
        assert pk is not None and mb.rows.numel() * mb.width <= 120
        part = take({"tokens": tokens, "mask": mask}, mb)
        assert pk.pack(part["mask"]).sum() == part["mask"].sum()  # every response position packed
        inside = torch.arange(mb.width)[None] < lengths[mb.rows][:, None]
        assert torch.equal(pk.unpack(pk.pack(part["tokens"])), part["tokens"] * inside)
        seen += pk.tokens
    assert seen == int(lengths.sum())
    assert packings_of(padded) == [None] * len(padded)


@pytest.mark.parametrize("heads", [1, 4])
def test_varlen_attention_is_block_diagonal_causal(heads: int) -> None:
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    T, d = int(cu[-1]), 8
    q, k, v = (torch.randn(T, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    seq = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=allowed, scale=0.3)
    out = varlen_causal_attention(q, k, v, cu, 0.3)
    assert (out - ref.transpose(0, 1)).abs().max().item() < 1e-12
    # one causal row over the packed tokens (sequences seeing each other) is different
    leak = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.3)
    assert (out - leak.transpose(0, 1)).abs().max().item() > 1e-2
