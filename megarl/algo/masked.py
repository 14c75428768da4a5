"""Masked reductions shared by the advantage, KL and loss code.

A mask marks the response tokens that take part in the RL objective: it may be bool or
float and is read as binary (``mask != 0``). Positions outside the mask may hold garbage,
even NaN or inf, so every function *selects* with ``torch.where`` instead of multiplying
by the mask (``nan * 0`` is ``nan``). Reductions over an empty selection return 0, never
NaN, so a batch whose responses are all empty is harmless.

Whitening follows the PPO practice of normalising advantages over the batch
(Schulman et al. 2017; Andrychowicz et al. 2021, "What Matters in On-Policy RL", §3.5):
``x̂ = (x - mean) / sqrt(var + eps)`` with mean and the population variance taken over the
valid tokens only.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask != 0`` as a bool tensor (no copy if it is bool already)."""
    return mask if mask.dtype == torch.bool else mask != 0


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the arguments when their shapes differ."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"expected tensors of the same shape, got {listed}")


def masked_fill_zero(
    x: torch.Tensor,  # (...) values; anything allowed outside the mask
    mask: torch.Tensor,  # (...) 1 where x is valid
) -> torch.Tensor:
    """``x`` where ``mask``, exactly 0 elsewhere (NaN outside the mask is dropped)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(
    x: torch.Tensor,  # (...) values
    mask: torch.Tensor,  # (...) 1 where x counts
    dim: int | None = None,
) -> torch.Tensor:
    """Sum of ``x`` over the valid positions (all dims, or along ``dim``)."""
    filled = masked_fill_zero(x, mask)
    return filled.sum() if dim is None else filled.sum(dim=dim)


def masked_count(
    mask: torch.Tensor,  # (...) 1 where a position counts
    dim: int | None = None,
) -> torch.Tensor:
    """Number of valid positions, as a float tensor."""
    m = as_bool_mask(mask).to(torch.float32)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(
    x: torch.Tensor,  # (...) values
    mask: torch.Tensor,  # (...) 1 where x counts
    dim: int | None = None,
) -> torch.Tensor:
    """Mean of ``x`` over the valid positions; 0 where there are none."""
    total = masked_sum(x, mask, dim)
    count = masked_count(mask, dim).to(total.dtype)
    return total / count.clamp(min=1.0)


def masked_var(
    x: torch.Tensor,  # (...) values
    mask: torch.Tensor,  # (...) 1 where x counts
    *,
    unbiased: bool = False,
) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (scalar); 0 for fewer than 2 values.

    ``unbiased=False`` (default) divides by n, ``unbiased=True`` by n - 1 (Bessel).
    """
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = masked_count(mask).to(sq.dtype)
    denom = n - 1.0 if unbiased else n
    return torch.where(n > 1.0, sq / denom.clamp(min=1.0), torch.zeros_like(sq))


def masked_whiten(
    x: torch.Tensor,  # (...) values, e.g. (B, T) advantages
    mask: torch.Tensor,  # (...) 1 on valid tokens
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` over all valid positions: ``(x - mean) / sqrt(var + eps)``.

    Population variance (divide by n). ``shift_mean=False`` only rescales and keeps the
    mean. The result is 0 outside the mask.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=False)
    centred = x - mean
    whitened = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return masked_fill_zero(whitened, mask)
