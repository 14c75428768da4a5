"""Advantage estimators against slow python-loop references (several seeds + edge cases)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    group_ids_from_size,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_to_last_token,
    sequence_to_token,
)

SEEDS = range(5)


# ------------------------------------------------------------------ random inputs


def _groups(seed: int, b: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards with ties, and shuffled, non-contiguous group ids incl. a singleton."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (b,), generator=g).to(torch.float64) + torch.where(
        torch.rand(b, generator=g) < 0.5, 0.0, torch.rand(b, generator=g, dtype=torch.float64)
    )
    labels = torch.tensor([7, 7, 7, 3, 3, 3, 3, 100, 42, 42, 42, 42][:b])
    perm = torch.randperm(b, generator=g)
    return rewards, labels[perm]


def _right_padded_mask(seed: int, b: int = 6, t: int = 9) -> torch.Tensor:
    """Right-padded responses; row 1 is empty, row 0 is full."""
    g = torch.Generator().manual_seed(seed + 1000)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 0
    return (torch.arange(t)[None, :] < lengths[:, None]).float()


def _holey_mask(seed: int, b: int = 6, t: int = 9) -> torch.Tensor:
    """Arbitrary masks (multi-turn holes), row 1 empty."""
    g = torch.Generator().manual_seed(seed + 2000)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[1] = False
    return mask


def _tokens(seed: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 3000)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    rewards[mask == 0] = math.nan  # garbage outside the mask must not leak
    values[mask == 0] = math.nan
    return rewards, values


def _valid_idx(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


# ------------------------------------------------------------------ loop references


def ref_grpo(r: list[float], gid: list[int], std: bool, eps: float, unbiased: bool):
    out = []
    for i in range(len(r)):
        members = [r[j] for j in range(len(r)) if gid[j] == gid[i]]
        n = len(members)
        mean = sum(members) / n
        if n == 1:
            out.append(0.0)
        elif std:
            d = n - 1 if unbiased else n
            sd = math.sqrt(sum((x - mean) ** 2 for x in members) / d)
            out.append((r[i] - mean) / (sd + eps))
        else:
            out.append(r[i] - mean)
    return out


def ref_rloo(r: list[float], gid: list[int]) -> list[float]:
    out = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if gid[j] == gid[i] and j != i]
        out.append(r[i] - sum(others) / len(others) if others else 0.0)
    return out


def ref_returns(rew: torch.Tensor, mask: torch.Tensor, gamma: float) -> list[list[float]]:
    out = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        running = 0.0
        for t in reversed(_valid_idx(mask, i)):
            running = float(rew[i, t]) + gamma * running
            out[i][t] = running
    return out


def ref_whiten(x: list[list[float]], mask: torch.Tensor, eps: float = 1e-8):
    vals = [x[i][t] for i in range(mask.shape[0]) for t in _valid_idx(mask, i)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals) + eps)
    return [
        [(x[i][t] - mean) / std if mask[i, t] else 0.0 for t in range(mask.shape[1])]
        for i in range(mask.shape[0])
    ]


def ref_gae(rew, val, mask, gamma: float, lam: float):
    adv = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    ret = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        idx = _valid_idx(mask, i)
        last_adv = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = float(val[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rew[i, t]) + gamma * next_v - float(val[i, t])
            last_adv = delta + gamma * lam * last_adv
            adv[i][t] = last_adv
            ret[i][t] = last_adv + float(val[i, t])
    return adv, ret


def _assert_close(out: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(
        out.to(torch.float64), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0
    )


# ------------------------------------------------------------------ outcome estimators


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("std", "unbiased"), [(True, True), (True, False), (False, True)])
def test_grpo_matches_loop(seed: int, std: bool, unbiased: bool) -> None:
    rewards, gid = _groups(seed)
    out = grpo_advantages(rewards, gid, normalize_std=std, unbiased=unbiased)
    expected = ref_grpo(rewards.tolist(), gid.tolist(), std, 1e-6, unbiased)
    _assert_close(out, expected)
    assert out[gid == 100].item() == 0.0  # the singleton group


def test_grpo_default_std_is_torch_std() -> None:
    """Contiguous groups: default matches (r - mean) / (torch.std(r) + eps) per group."""
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1])
    out = grpo_advantages(rewards, group_ids_from_size(8, 4))
    grouped = rewards.view(2, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, expected.view(-1))
    # one correct answer in 4: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> A = 1.5
    # (the population std sqrt(0.1875) would give 1.732).
    assert out[3].item() == pytest.approx(1.5, rel=1e-5)
    assert out[0].item() == pytest.approx(-0.5, rel=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed: int) -> None:
    rewards, gid = _groups(seed)
    out = rloo_advantages(rewards, gid)
    _assert_close(out, ref_rloo(rewards.tolist(), gid.tolist()))
    # RLOO is the centred reward scaled by n/(n-1) (n = 4 for label 3).
    g3 = gid == 3
    centred = rewards[g3] - rewards[g3].mean()
    torch.testing.assert_close(out[g3], centred * 4 / 3)


@pytest.mark.parametrize("fn", ["grpo", "drgrpo", "rloo"])
def test_equal_rewards_and_singletons_give_zero(fn: str) -> None:
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 2.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 2])
    if fn == "rloo":
        out = rloo_advantages(rewards, gid)
    else:
        out = grpo_advantages(rewards, gid, normalize_std=fn == "grpo")
    assert torch.equal(out[:3], torch.zeros(3))  # all-equal group
    assert out[5].item() == 0.0  # group of size 1
    assert out[3].item() < 0.0 < out[4].item()
    assert torch.isfinite(out).all()


def test_integer_rewards_and_group_ids_from_size() -> None:
    out = grpo_advantages(torch.tensor([1, 0, 1, 1]), group_ids_from_size(4, 2))
    assert out.dtype == torch.float32
    assert out[2:].abs().max().item() == 0.0
    assert out[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)
    with pytest.raises(ValueError, match="group_size=3"):
        group_ids_from_size(4, 3)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------ token estimators


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_returns_and_reinforce_pp_match_loop(seed: int, holes: bool) -> None:
    mask = _holey_mask(seed) if holes else _right_padded_mask(seed)
    rew, _ = _tokens(seed, mask)
    ref = ref_returns(rew, mask, 0.9)
    _assert_close(discounted_returns(rew, mask, gamma=0.9), ref)
    out = reinforce_pp_advantages(rew, mask, gamma=0.9)
    _assert_close(out, ref_whiten(ref, mask))
    assert out[1].abs().sum().item() == 0.0  # empty response


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_matches_loop(seed: int) -> None:
    rewards, gid = _groups(seed, b=6)
    mask = _right_padded_mask(seed, b=6)
    centred = ref_grpo(rewards.tolist(), gid.tolist(), False, 0.0, True)
    per_token = [[centred[i]] * mask.shape[1] for i in range(6)]
    out = reinforce_pp_baseline_advantages(rewards, gid, mask)
    _assert_close(out, ref_whiten(per_token, mask))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop(seed: int, holes: bool) -> None:
    mask = _holey_mask(seed) if holes else _right_padded_mask(seed)
    rew, val = _tokens(seed, mask)
    adv, ret = gae_advantages(rew, val, mask, gamma=0.95, lam=0.8)
    ref_adv, ref_ret = ref_gae(rew, val, mask, 0.95, 0.8)
    _assert_close(adv, ref_adv)
    _assert_close(ret, ref_ret)
    white, ret2 = gae_advantages(rew, val, mask, gamma=0.95, lam=0.8, whiten=True)
    _assert_close(white, ref_whiten(ref_adv, mask))
    torch.testing.assert_close(ret2, ret)  # returns come from unwhitened advantages
    assert not torch.isnan(adv).any() and not torch.isnan(ret).any()


def test_gae_limits() -> None:
    """lam=1: Monte Carlo return minus V; lam=0: one-step TD error."""
    mask = _right_padded_mask(3)
    rew, val = _tokens(3, mask)
    m = mask.bool()
    v0 = torch.where(m, val, 0.0)
    adv1, _ = gae_advantages(rew, val, mask, gamma=0.9, lam=1.0)
    expected1 = torch.where(m, discounted_returns(rew, mask, gamma=0.9) - v0, 0.0)
    torch.testing.assert_close(adv1, expected1)
    adv0, _ = gae_advantages(rew, val, mask, gamma=0.9, lam=0.0)
    next_v = torch.cat([v0[:, 1:], torch.zeros(v0.shape[0], 1, dtype=v0.dtype)], dim=1)
    expected0 = torch.where(m, torch.where(m, rew, 0.0) + 0.9 * next_v - v0, 0.0)
    torch.testing.assert_close(adv0, expected0)


# ------------------------------------------------------------------ helpers and registry


def test_broadcast_helpers() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    adv = torch.tensor([2.0, 3.0, -1.0])
    expected = torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, -1.0]])
    assert torch.equal(sequence_to_token(adv, mask), expected)
    last = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]])
    assert torch.equal(sequence_to_last_token(adv, mask), last)


def test_compute_advantages_dispatch() -> None:
    rewards, gid = _groups(0, b=6)
    mask = _right_padded_mask(0, b=6)
    _, val = _tokens(0, mask)
    expect = {
        "grpo": sequence_to_token(grpo_advantages(rewards, gid), mask),
        "drgrpo": sequence_to_token(grpo_advantages(rewards, gid, normalize_std=False), mask),
        "rloo": sequence_to_token(rloo_advantages(rewards, gid), mask),
        "reinforce_pp_baseline": reinforce_pp_baseline_advantages(rewards, gid, mask),
        "reinforce_pp": reinforce_pp_advantages(sequence_to_last_token(rewards, mask), mask),
    }
    for name, expected in expect.items():
        result = compute_advantages(name, mask=mask, rewards=rewards, group_ids=gid)
        torch.testing.assert_close(result.advantages, expected, msg=name)
        assert result.returns is None
    gae = compute_advantages(
        "gae", mask=mask, rewards=rewards, group_ids=gid, values=val, gamma=0.9, lam=0.7
    )
    adv, ret = gae_advantages(
        sequence_to_last_token(rewards, mask), val, mask, gamma=0.9, lam=0.7, whiten=True
    )
    torch.testing.assert_close(gae.advantages, adv)
    assert gae.returns is not None
    torch.testing.assert_close(gae.returns, ret)
    assert set(ADVANTAGE_ESTIMATORS) == {*expect, "gae"}
    # explicit token rewards alone drive the token estimators
    tok, _ = _tokens(0, mask)
    explicit = compute_advantages("reinforce_pp", mask=mask, token_rewards=tok)
    torch.testing.assert_close(explicit.advantages, reinforce_pp_advantages(tok, mask))
    # rewards that are not the token rewards' sums are refused, whichever estimator would read them
    with pytest.raises(ValueError, match="'reinforce_pp': rewards and token_rewards disagree"):
        compute_advantages("reinforce_pp", mask=mask, rewards=rewards, token_rewards=tok)


def test_compute_advantages_errors() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*grpo"):
        compute_advantages("ppo", mask=mask, rewards=torch.zeros(2))
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", mask=mask, rewards=torch.zeros(2))
    with pytest.raises(ValueError, match="'grpo' needs group_ids"):
        compute_advantages("grpo", mask=mask, rewards=torch.zeros(2))
