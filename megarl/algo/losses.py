"""Per-token PPO-family losses and truncated importance-sampling weights.

Each loss returns a ``(B, T)`` per-token tensor, exactly 0 outside the mask; reduce it
with ``megarl.algo.aggregation.aggregate`` so the result does not depend on how the batch
is split. Stats are detached scalar tensors averaged over the valid tokens *of the tensors
given* (a micro-batch): metrics, not part of the objective.

Policy loss (minimised), with ``ratio_t = exp(log π_θ - log π_old)`` and advantage ``A_t``:

* PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
  eq. (7)), with the decoupled clip range of DAPO (Yu et al. 2025, "DAPO", §3.1
  "Clip-Higher"):
  ``L = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))``.
* Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning", dual-clip PPO): for ``A < 0`` the surrogate above is unbounded
  as the ratio grows; it is capped at ``-c A`` with ``c = dual_clip > 1``:
  ``L = min(L, -c A)`` where ``A < 0``; unchanged where ``A >= 0``.
* Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"): the rollout engine samples from π_engine, which
  differs numerically from the trainer's π_old; the per-token loss is multiplied by the
  detached weight ``w = min(π_old / π_engine, cap)`` from ``tis_weights``.

``log ratio`` is clamped to ``[-20, 20]`` before ``exp`` so a wild token cannot produce inf;
inside that range the loss is the textbook one.

Value loss (clipped, as in OpenAI baselines' ppo2 and verl):
``L_V = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``; ``clip=None`` gives
``0.5 (V - R)^2``.
"""

from __future__ import annotations

import math

import torch

from megarl.algo.masked import (
    as_bool_mask,
    check_same_shape,
    masked_fill_zero,
    masked_mean,
)

LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp; e^20 ≈ 4.9e8 is finite in fp32/bf16


def _masked_max(x: torch.Tensor, mask: torch.Tensor, *, empty: float) -> torch.Tensor:
    """Max of ``x`` over the valid positions; ``empty`` when there are none."""
    sentinel = x.new_full((1,), empty)
    return torch.cat([x[as_bool_mask(mask)].reshape(-1), sentinel]).max()


def policy_loss(
    logprobs: torch.Tensor,  # (B, T) log π_θ(a_t|s_t), carries the gradient
    old_logprobs: torch.Tensor,  # (B, T) log π_old(a_t|s_t) from before the update
    advantages: torch.Tensor,  # (B, T) A_t (treated as a constant)
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    tis_weights: torch.Tensor | None = None,  # (B, T) w_t from ``tis_weights`` (detached)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # ((B, T) loss, scalar stats)
    """PPO clipped surrogate with clip-higher, optional dual clip and TIS weights.

    Stats: ``clipfrac`` (= ``clipfrac_low + clipfrac_high``: fraction of tokens whose
    clipped term is the active one), ``dual_clipfrac`` (tokens where the dual clip is
    active), ``approx_kl`` (k3 estimate of KL(π_old || π_θ)), ``ratio_mean``,
    ``ratio_max``.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None to disable)")
    if tis_weights is not None:
        check_same_shape(logprobs=logprobs, tis_weights=tis_weights)

    m = as_bool_mask(mask)
    adv = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (cap < loss)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    else:
        dual_active = torch.zeros_like(m)
    if tis_weights is not None:
        loss = loss * tis_weights.detach()
    loss = masked_fill_zero(loss, m)

    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        high = (adv > 0) & (r > 1.0 + clip_high)
        low = (adv < 0) & (r < 1.0 - clip_low)
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), m),
            "clipfrac_low": masked_mean(low.float(), m),
            "clipfrac_high": masked_mean(high.float(), m),
            "dual_clipfrac": masked_mean(dual_active.float(), m),
            "approx_kl": masked_mean(torch.expm1(lr) - lr, m),
            "ratio_mean": masked_mean(r, m),
            "ratio_max": _masked_max(r, m, empty=0.0),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,  # (B, T) V_θ(s_t), carries the gradient
    old_values: torch.Tensor,  # (B, T) V_old(s_t) from rollout time
    returns: torch.Tensor,  # (B, T) targets R_t (e.g. GAE returns)
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    clip: float | None = 0.2,
) -> torch.Tensor:  # (B, T) per-token value loss, 0 outside the mask
    """Clipped value loss ``0.5 max((V-R)^2, (clip(V, V_old±c) - R)^2)``."""
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    target = returns.detach()
    loss = (values - target).square()
    if clip is not None:
        if clip < 0:
            raise ValueError(f"value clip={clip} must be >= 0 (or None to disable)")
        old = old_values.detach()
        v_clipped = old + (values - old).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clipped - target).square())
    return masked_fill_zero(0.5 * loss, mask)


def tis_weights(
    old_logprobs: torch.Tensor,  # (B, T) log π_old(a_t|s_t), recomputed by the trainer
    engine_logprobs: torch.Tensor,  # (B, T) log π_engine(a_t|s_t) reported by the sampler
    mask: torch.Tensor,  # (B, T) 1 on response tokens
    *,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # ((B, T) weights, scalar stats)
    """Truncated importance weights ``w = min(exp(old - engine), cap)``, detached.

    Weights are 0 outside the mask. Stats: ``mean_abs_logp_diff`` (mean |old - engine|),
    ``max_ratio`` (largest untruncated ratio, its log clamped to 20), ``capped_frac``
    (fraction of tokens with ratio > cap), ``mean_weight``.
    """
    check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    if cap <= 0:
        raise ValueError(f"tis cap={cap} must be > 0")
    m = as_bool_mask(mask)
    with torch.no_grad():
        diff = old_logprobs.detach().float() - engine_logprobs.detach().float()
        # exp(min(d, log cap)) == min(exp(d), cap) without overflowing for large d.
        weights = masked_fill_zero(torch.exp(diff.clamp(max=math.log(cap))), m)
        max_log = _masked_max(diff, m, empty=-math.inf)
        stats = {
            "mean_abs_logp_diff": masked_mean(diff.abs(), m),
            "max_ratio": torch.exp(max_log.clamp(max=LOG_RATIO_CLAMP)),
            "capped_frac": masked_mean((diff > math.log(cap)).float(), m),
            "mean_weight": masked_mean(weights, m),
        }
    return weights, stats
