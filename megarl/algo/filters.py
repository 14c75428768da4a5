"""Sample filters and length shaping from DAPO (Yu et al. 2025, "DAPO: An Open-Source
LLM Reinforcement Learning System at Scale").

* Dynamic sampling (§3.2): a prompt group whose rewards are all equal has zero
  group-relative advantage, so it adds no gradient, only noise in the token counts.
  ``groups_with_signal`` marks the samples worth keeping; the caller over-samples and
  refills the batch.
* Overlong filtering (§3.4): truncated samples are masked out of the loss instead of being
  punished for a length the sampler cut.
* Soft overlong punishment (§3.4, eq. (13)), added to the task reward, with
  ``L_max = max_len`` and ``L_cache = cache_len``::

      R_length(L) = 0                                   if L <= L_max - L_cache
                  = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                  = -1                                  if L > L_max
"""

from __future__ import annotations

import torch


def groups_with_signal(
    rewards: torch.Tensor,  # (B,) sequence rewards
    group_ids: torch.Tensor,  # (B,) long prompt group of each sample
) -> torch.Tensor:  # (B,) bool, False for samples in groups whose rewards are all equal
    """True for samples whose group has at least two distinct rewards.

    Groups of size 1 have no signal (False). Comparison is exact: rewards computed by
    different float paths should be rounded by the caller first.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "expected rewards (B,) and group_ids (B,), got "
            f"rewards={tuple(rewards.shape)}, group_ids={tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    high = r.new_full((n_groups,), -torch.inf).scatter_reduce(0, inverse, r, reduce="amax")
    low = r.new_full((n_groups,), torch.inf).scatter_reduce(0, inverse, r, reduce="amin")
    return (high > low)[inverse]


def overlong_soft_penalty(
    lengths: torch.Tensor,  # (B,) response lengths in tokens
    *,
    max_len: int,
    cache_len: int,
) -> torch.Tensor:  # (B,) float penalty in [-1, 0], to add to the reward
    """DAPO eq. (13) soft overlong punishment (see module docstring)."""
    if max_len <= 0 or not 0 <= cache_len <= max_len:
        raise ValueError(
            f"need max_len > 0 and 0 <= cache_len <= max_len, got max_len={max_len}, cache_len={cache_len}"
        )
    length = lengths.to(torch.float32)
    safe = float(max_len - cache_len)
    ramp = (safe - length) / float(max(cache_len, 1))  # only used when cache_len > 0
    penalty = torch.where(length <= safe, torch.zeros_like(length), ramp)
    return torch.where(length > max_len, torch.full_like(length, -1.0), penalty)


def overlong_filter_mask(
    truncated: torch.Tensor,  # (B,) bool, True if the sampler cut the response at max_len
) -> torch.Tensor:  # (B,) bool, True for samples to keep in the loss
    """Keep-mask for overlong filtering: drop truncated samples from the loss.

    Apply with ``mask * keep[:, None]``; the aggregation modes do not count rows whose
    mask is empty, so dropped samples change no denominator.
    """
    if truncated.dim() != 1:
        raise ValueError(f"expected truncated (B,), got shape {tuple(truncated.shape)}")
    return ~truncated.bool()
