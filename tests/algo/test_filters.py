"""DAPO dynamic-sampling and overlong helpers against loop references."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.filters import (
    groups_with_signal,
    overlong_filter_mask,
    overlong_soft_penalty,
)


def ref_signal(r: list[float], gid: list[int]) -> list[bool]:
    return [len({r[j] for j in range(len(r)) if gid[j] == gid[i]}) > 1 for i in range(len(r))]


@pytest.mark.parametrize("seed", range(5))
def test_groups_with_signal_matches_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gid = torch.randint(0, 6, (20,), generator=g) * 13  # sparse, shuffled labels
    rewards = torch.randint(0, 2, (20,), generator=g).float()
    rewards[gid == gid[0]] = 1.0  # at least one all-equal group
    out = groups_with_signal(rewards, gid)
    assert out.dtype == torch.bool
    assert out.tolist() == ref_signal(rewards.tolist(), gid.tolist())
    assert not out[0]


def test_groups_with_signal_edges() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5000001])
    gid = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    assert groups_with_signal(rewards, gid).tolist() == [
        False,
        False,
        True,
        True,
        False,
        True,
        True,
    ]  # all-equal, mixed, singleton, tiny difference
    assert groups_with_signal(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def ref_overlong(length: int, max_len: int, cache_len: int) -> float:
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return ((max_len - cache_len) - length) / cache_len
    return -1.0


def test_overlong_soft_penalty_matches_loop() -> None:
    lengths = torch.arange(0, 130)
    out = overlong_soft_penalty(lengths, max_len=100, cache_len=20)
    expected = [ref_overlong(n, 100, 20) for n in range(130)]
    assert out.tolist() == pytest.approx(expected, abs=1e-7)
    # explicit points: safe zone, buffer zone, its end, beyond
    picks = overlong_soft_penalty(torch.tensor([80, 90, 100, 101]), max_len=100, cache_len=20)
    assert picks.tolist() == pytest.approx([0.0, -0.5, -1.0, -1.0])
    no_buffer = overlong_soft_penalty(torch.tensor([100, 101]), max_len=100, cache_len=0)
    assert no_buffer.tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="cache_len=120"):
        overlong_soft_penalty(lengths, max_len=100, cache_len=120)


def test_overlong_filter_mask() -> None:
    keep = overlong_filter_mask(torch.tensor([True, False, False, True]))
    assert keep.tolist() == [False, True, True, False]
    token_mask = torch.ones(4, 3) * keep[:, None]
    assert token_mask.sum().item() == 6.0
