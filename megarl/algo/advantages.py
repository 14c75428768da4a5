"""Advantage estimators for policy-gradient RL on LLM responses.

Pure tensor code: tensors and masks in, tensors out, nothing distributed. Conventions:

* token tensors are ``(B, T)``; ``mask`` ``(B, T)`` is 1 on response tokens (read as
  binary). Every ``(B, T)`` result is exactly 0 outside the mask, and values outside the
  mask (even NaN) never leak into valid positions.
* sequence rewards are ``(B,)``; ``group_ids`` ``(B,)`` long gives each sample its prompt
  group (any integers, any order). ``group_ids_from_size`` builds them for contiguous
  groups of equal size.
* all statistics are over the tensors given. Group statistics need whole groups, so call
  these on the full rollout batch (before it is split over data-parallel ranks); the
  batch-whitening estimators likewise whiten over whatever batch they are handed.

Estimators (``r`` = sequence reward, ``G`` = a prompt group of size n):

* GRPO (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision):
  ``A_i = (r_i - mean_G r) / (std_G r + eps)``. ``std`` is the *unbiased* (n - 1) sample
  std by default, like ``torch.std`` in the reference implementations (verl, TRL); pass
  ``unbiased=False`` for the population std. A group of size 1 has no baseline: its
  advantage is 0 (``r - mean = 0`` exactly; the undefined std is replaced by 0). Note
  verl instead gives a singleton group mean 0 and std 1, i.e. ``A = r``.
* Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective"): GRPO without the std division, ``A_i = r_i - mean_G r``.
* RLOO (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
  Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
  for Learning from Human Feedback in LLMs"): leave-one-out baseline
  ``A_i = r_i - (1/(n-1)) sum_{j != i} r_j``; 0 for a group of size 1.
* REINFORCE++ (Hu 2025, "REINFORCE++", arXiv:2501.03262): per-token discounted
  return-to-go ``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the response tokens, then
  whitened over all valid tokens of the batch. The "baseline" variant subtracts the
  group mean of the sequence reward first, broadcasts it to the tokens, then whitens.
* GAE (Schulman et al. 2015/ICLR 2016, "High-Dimensional Continuous Control Using Generalized
  Advantage Estimation", eq. (16)): ``delta_t = r_t + gamma V_{t+1} - V_t``,
  ``A_t = sum_l (gamma lam)^l delta_{t+l}``; returns ``R_t = A_t + V_t`` (the TD(lam)
  target for the critic). ``V`` after the last valid token is 0 (no bootstrap).

KL in the reward (``algo.kl_mode: reward``; Ziegler et al. 2019 §2.2; Ouyang et al. 2022
eq. (2)): ``kl_penalized_rewards`` turns the outcome reward into per-token rewards
``r_t = [t last] r - β KL_t`` and the matching sequence reward ``r - β Σ_t KL_t``, which is
the sum of those token rewards. Outcome estimators read the sequence reward, token
estimators the token rewards, so the penalty acts on every estimator (verl does the same:
``apply_kl_penalty`` then ``token_level_rewards.sum(-1)`` as the GRPO/RLOO score).
``compute_advantages`` refuses ``rewards`` and ``token_rewards`` that disagree on this sum,
so a penalty put into one of them cannot be silently ignored by an estimator reading the
other.

Recurrences run over the *valid* tokens only: a masked position inside a response (for
example a tool output in a multi-turn rollout) is skipped, not counted as a time step,
and its reward and value are ignored. For right-padded single-turn responses this is the
usual definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algo.masked import (
    as_bool_mask,
    check_same_shape,
    masked_fill_zero,
    masked_sum,
    masked_whiten,
)

# ---------------------------------------------------------------------------- helpers


def group_ids_from_size(
    batch_size: int, group_size: int, device: torch.device | None = None
) -> torch.Tensor:  # (B,) long
    """``(B,)`` group ids for contiguous groups: ``[0]*group_size + [1]*group_size + ...``."""
    if group_size < 1 or batch_size % group_size != 0:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide batch_size={batch_size}")
    return torch.arange(batch_size, device=device) // group_size


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def _check_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "expected rewards (B,) and group_ids (B,), got "
            f"rewards={tuple(rewards.shape)}, group_ids={tuple(group_ids.shape)}"
        )


def _group_stats(
    rewards: torch.Tensor,  # (B,) sequence rewards
    group_ids: torch.Tensor,  # (B,) long group of each sample
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(count, sum, mean, centred sum of squares)`` of its group, in float64.

    float64 because these are (B,)-sized and the std of near-equal rewards is a
    difference of close numbers.
    """
    _check_groups(rewards, group_ids)
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count.index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    total.index_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    sq.index_add_(0, inverse, (r - mean[inverse]) ** 2)
    return count[inverse], total[inverse], mean[inverse], sq[inverse]


def sequence_to_token(
    adv: torch.Tensor,  # (B,) one value per sequence
    mask: torch.Tensor,  # (B, T) 1 on response tokens
) -> torch.Tensor:  # (B, T) adv[b] on every valid token of row b, 0 elsewhere
    """Broadcast a per-sequence value to every response token."""
    if adv.dim() != 1 or mask.dim() != 2 or mask.shape[0] != adv.shape[0]:
        raise ValueError(f"expected adv (B,) and mask (B, T), got adv={tuple(adv.shape)}, mask={tuple(mask.shape)}")
    return masked_fill_zero(adv[:, None].expand(mask.shape), mask)


def sequence_to_last_token(
    rewards: torch.Tensor,  # (B,) one reward per sequence
    mask: torch.Tensor,  # (B, T) 1 on response tokens
) -> torch.Tensor:  # (B, T) rewards[b] on the last valid token of row b, 0 elsewhere
    """Place a sequence (outcome) reward on the last response token, as token rewards.

    Rows with no valid token get no reward.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected rewards (B,) and mask (B, T), got rewards={tuple(rewards.shape)}, mask={tuple(mask.shape)}"
        )
    m = as_bool_mask(mask)
    t = torch.arange(m.shape[1], device=m.device)
    last = torch.where(m, t, -1).max(dim=1).values  # (B,) -1 when the row is empty
    out = torch.zeros(m.shape, dtype=_float_dtype(rewards), device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    return out


def kl_penalized_rewards(
    rewards: torch.Tensor,  # (B,) outcome reward per sequence
    kl: torch.Tensor,  # (B, T) per-token KL(π || π_ref) estimate; ignored outside the mask
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    coef: float,
    token_rewards: torch.Tensor | None = None,  # (B, T) the rewards placed per token (None: at the last)
) -> tuple[torch.Tensor, torch.Tensor]:  # (sequence rewards (B,), token rewards (B, T))
    """Put a KL penalty ``β·KL_t`` into the rewards, as sequence and as token rewards.

    ``token = [t last valid] r - coef·KL_t`` on valid tokens (0 elsewhere) and
    ``sequence = r - coef·Σ_t KL_t``: the sequence reward is the sum of the token rewards
    (a row without valid tokens keeps its outcome reward, it has no KL to pay). With
    ``token_rewards`` (multi-turn episodes: each reward at its turn; a row sums to ``rewards``)
    those stand in for ``r`` at the last valid token.
    """
    check_same_shape(kl=kl, mask=mask)
    penalty = coef * masked_fill_zero(kl, mask).to(torch.float64)  # (B, T)
    placed = sequence_to_last_token(rewards.to(torch.float64), mask) if token_rewards is None else token_rewards
    token = masked_fill_zero(placed.to(torch.float64), mask) - penalty
    sequence = rewards.to(torch.float64) - penalty.sum(dim=1)
    dtype = _float_dtype(rewards)
    return sequence.to(dtype), masked_fill_zero(token, mask).to(dtype)


# ------------------------------------------------------------------ outcome estimators


def grpo_advantages(
    rewards: torch.Tensor,  # (B,) sequence rewards
    group_ids: torch.Tensor,  # (B,) long prompt group of each sample
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> torch.Tensor:  # (B,) advantages
    """GRPO group-normalised advantage; ``normalize_std=False`` is Dr. GRPO.

    ``(r - mean_G) / (std_G + eps)``, std unbiased unless ``unbiased=False``; groups of
    size 1 give 0.
    """
    count, _, mean, sq = _group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - mean
    if normalize_std:
        denom = count - 1.0 if unbiased else count
        var = torch.where(denom > 0, sq / denom.clamp(min=1.0), torch.zeros_like(sq))
        adv = adv / (var.sqrt() + eps)
    return adv.to(_float_dtype(rewards))


def rloo_advantages(
    rewards: torch.Tensor,  # (B,) sequence rewards
    group_ids: torch.Tensor,  # (B,) long prompt group of each sample
) -> torch.Tensor:  # (B,) advantages
    """Leave-one-out: ``r_i`` minus the mean of the *other* rewards in its group."""
    count, total, _, _ = _group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    others = (count - 1.0).clamp(min=1.0)
    adv = torch.where(count > 1.0, r - (total - r) / others, torch.zeros_like(r))
    return adv.to(_float_dtype(rewards))


# -------------------------------------------------------------------- token estimators


def discounted_returns(
    token_rewards: torch.Tensor,  # (B, T) reward r_t on each token
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    gamma: float = 1.0,
) -> torch.Tensor:  # (B, T) return-to-go G_t over valid tokens, 0 elsewhere
    """``G_t = r_t + gamma * G_{next valid t}``, 0 after the last valid token."""
    check_same_shape(token_rewards=token_rewards, mask=mask)
    m = as_bool_mask(mask)
    r = masked_fill_zero(token_rewards, m)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return masked_fill_zero(out, m)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,  # (B, T) reward r_t on each token (e.g. outcome - KL)
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:  # (B, T) advantages, whitened over the batch's valid tokens
    """REINFORCE++: discounted return-to-go, whitened over all valid batch tokens."""
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, eps=eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,  # (B,) sequence rewards
    group_ids: torch.Tensor,  # (B,) long prompt group of each sample
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    eps: float = 1e-8,
) -> torch.Tensor:  # (B, T) advantages, whitened over the batch's valid tokens
    """REINFORCE++ with group baseline: ``r - mean_G r`` per token, then batch-whitened."""
    adv = grpo_advantages(rewards, group_ids, normalize_std=False)
    return masked_whiten(sequence_to_token(adv, mask), mask, eps=eps)


def gae_advantages(
    token_rewards: torch.Tensor,  # (B, T) reward r_t on each token
    values: torch.Tensor,  # (B, T) critic V(s_t); ignored outside the mask
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:  # (advantages (B, T), returns (B, T))
    """Generalised advantage estimation over the response tokens.

    ``returns = advantages + values`` is computed *before* optional whitening of the
    advantages (whitening is masked, over the whole batch), as in PPO practice.
    """
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    m = as_bool_mask(mask)
    r = masked_fill_zero(token_rewards, m)
    v = masked_fill_zero(values, m).to(r.dtype)
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        valid = m[:, t]
        next_adv = torch.where(valid, a_t, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        adv[:, t] = next_adv
    adv = masked_fill_zero(adv, m)
    returns = masked_fill_zero(adv + v, m)
    if whiten:
        adv = masked_whiten(adv, m, eps=eps)
    return adv, returns


# ---------------------------------------------------------------------------- registry


@dataclass(kw_only=True)
class AdvantageResult:
    """Output of ``compute_advantages``."""

    advantages: torch.Tensor  # (B, T) per-token advantages, 0 outside the mask
    returns: torch.Tensor | None  # (B, T) critic targets (GAE only), else None


def _need(name: str, field: str, value: torch.Tensor | None, shape: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"advantage estimator '{name}' needs {field} {shape}, got None")
    return value


def _reward_views(
    name: str,
    rewards: torch.Tensor | None,  # (B,) sequence rewards
    token_rewards: torch.Tensor | None,  # (B, T) per-token rewards
    mask: torch.Tensor,  # (B, T)
) -> tuple[torch.Tensor, torch.Tensor]:  # (sequence (B,), token (B, T)) rewards that agree
    """Both views of the rewards; the missing one is derived, two given ones must agree.

    A sequence reward is the sum of its token rewards over the valid tokens (rows without
    valid tokens are not compared: they take no part in any loss).
    """
    if token_rewards is None:
        seq = _need(name, "rewards or token_rewards", rewards, "(B,) or (B, T)")
        return seq, sequence_to_last_token(seq, mask)
    check_same_shape(token_rewards=token_rewards, mask=mask)
    summed = masked_sum(token_rewards.to(torch.float64), mask, dim=1)  # (B,)
    if rewards is None:
        return summed.to(_float_dtype(token_rewards)), token_rewards
    r = rewards.to(torch.float64)
    # rounding of each summand, not of the (possibly cancelling) sum, bounds the disagreement
    eps = max(torch.finfo(_float_dtype(token_rewards)).eps, torch.finfo(_float_dtype(rewards)).eps)
    scale = masked_sum(token_rewards.to(torch.float64).abs(), mask, dim=1) + r.abs()
    has_tokens = as_bool_mask(mask).any(dim=1)
    bad = torch.nonzero(has_tokens & ((summed - r).abs() > 1e-6 + 16 * eps * scale)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"advantage estimator '{name}': rewards and token_rewards disagree on {bad.numel()} row(s), "
            f"first row {i}: rewards[{i}]={float(r[i]):.6g} but token_rewards sum to {float(summed[i]):.6g}; "
            "a sequence reward must be the sum of its token rewards (put a per-token penalty such as "
            "KL into both, see kl_penalized_rewards, or pass only one of them)"
        )
    return rewards, token_rewards


def compute_advantages(
    name: str,
    *,
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    rewards: torch.Tensor | None = None,  # (B,) sequence rewards
    token_rewards: torch.Tensor | None = None,  # (B, T) per-token rewards
    group_ids: torch.Tensor | None = None,  # (B,) long prompt group of each sample
    values: torch.Tensor | None = None,  # (B, T) critic values (GAE)
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    std_eps: float = 1e-6,
) -> AdvantageResult:
    """Run the estimator named by the config key ``name`` (see ``ADVANTAGE_ESTIMATORS``).

    Give ``rewards``, ``token_rewards`` or both (then they must agree: each sequence reward
    is the sum of its token rewards over the mask, else ``ValueError``). Outcome estimators
    (grpo, drgrpo, rloo, reinforce_pp_baseline) read the sequence rewards (the token-reward
    sums when only ``token_rewards`` is given, as verl) and ``group_ids``. Token estimators
    (reinforce_pp, gae) read the token rewards (an outcome reward on the last response token
    when only ``rewards`` is given). ``whiten`` applies to GAE only (the other estimators
    define their own normalisation).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator '{name}'; valid options: {valid}")
    seq, tok = _reward_views(name, rewards, token_rewards, mask)
    if name in ("grpo", "drgrpo", "rloo"):
        gid = _need(name, "group_ids", group_ids, "(B,)")
        if name == "rloo":
            adv = rloo_advantages(seq, gid)
        else:
            adv = grpo_advantages(seq, gid, normalize_std=name == "grpo", eps=std_eps)
        return AdvantageResult(advantages=sequence_to_token(adv, mask), returns=None)
    if name == "reinforce_pp_baseline":
        gid = _need(name, "group_ids", group_ids, "(B,)")
        return AdvantageResult(advantages=reinforce_pp_baseline_advantages(seq, gid, mask), returns=None)
    if name == "reinforce_pp":
        return AdvantageResult(advantages=reinforce_pp_advantages(tok, mask, gamma=gamma), returns=None)
    vals = _need(name, "values", values, "(B, T)")
    adv, ret = gae_advantages(tok, vals, mask, gamma=gamma, lam=lam, whiten=whiten)
    return AdvantageResult(advantages=adv, returns=ret)


# Config key -> the estimator function behind it (for discovery and docs; the uniform
# entry point is ``compute_advantages``).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., object]] = {
    "grpo": grpo_advantages,
    "drgrpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
}
