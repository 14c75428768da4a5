"""Loss aggregation that does not depend on how the global batch is split.

A per-token loss ``l_it`` (sequence i, token t, valid where ``m_it = 1``) is reduced to one
scalar. Every mode is written as ``numerator / D`` where the numerator is a *sum over
sequences* and the denominator ``D`` is computed once over the GLOBAL batch (all
data-parallel ranks, all micro-batches). Hence for any partition of the rows into parts
``P_k`` (micro-batches, DP shards, uneven sizes allowed)::

    sum_k aggregate(l[P_k], m[P_k], mode=..., global_denominator=D) == aggregate(l, m, ..., D)

exactly, and so are the gradients. (A per-micro-batch *mean* would weight tokens by the
size of the micro-batch they happen to land in.) With ``n_i = sum_t m_it``, ``N_tok`` the
valid tokens and ``N_seq`` the sequences with at least one valid token in the global
batch:

* ``token-mean``              ``sum_i sum_t l_it / N_tok``  (DAPO, Yu et al. 2025, §3.3
  token-level policy-gradient loss);
* ``seq-mean-token-mean``     ``sum_i (sum_t l_it / n_i) / N_seq``  (GRPO, Shao et al. 2024,
  eq. (3));
* ``seq-mean-token-sum``      ``sum_i sum_t l_it / N_seq``;
* ``seq-mean-token-sum-norm`` ``sum_i sum_t l_it / (N_seq * fixed_normalizer)``, with a
  constant such as the maximum response length (Dr. GRPO, Liu et al. 2025: removes the
  1/|o_i| length bias).

Sequences without valid tokens contribute 0 and are not counted in ``N_seq``, so padding
rows (e.g. to even out micro-batches) change nothing.

Usage: ``stats = denominator_stats(mask)`` on each rank's full share of the step, all-reduce
(sum) the counts, ``D = make_denominator(mode, tokens=..., seqs=..., fixed_normalizer=...)``,
then ``aggregate`` each micro-batch with that ``D`` and *sum* the resulting losses (or
gradients). If the framework averages gradients over data-parallel ranks or divides by the
number of micro-batches, multiply the loss by that factor to undo it: the objective here is
already normalised globally.
"""

from __future__ import annotations

import torch

from megarl.algo.masked import as_bool_mask, check_same_shape, masked_fill_zero

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode '{mode}'; valid options: {', '.join(LOSS_AGG_MODES)}")


def denominator_stats(
    mask: torch.Tensor,  # (b, T) 1 on response tokens of this rank's share
) -> dict[str, torch.Tensor]:  # {"tokens": () float, "seqs": () float}
    """Local counts to all-reduce (sum) before ``make_denominator``.

    ``tokens``: valid tokens; ``seqs``: rows with at least one valid token. Float64
    tensors on ``mask``'s device, so they can be all-reduced as they are.
    """
    if mask.dim() != 2:
        raise ValueError(f"expected mask (b, T), got shape {tuple(mask.shape)}")
    m = as_bool_mask(mask)
    return {
        "tokens": m.sum(dtype=torch.float64),
        "seqs": m.any(dim=1).sum(dtype=torch.float64),
    }


def make_denominator(
    mode: str,
    *,
    tokens: float | torch.Tensor,
    seqs: float | torch.Tensor,
    fixed_normalizer: float | None = None,
) -> float:
    """Global denominator for ``mode`` from global counts (see module docstring).

    An empty batch gives 1.0 (its numerator is 0, so the loss is 0, not NaN).
    """
    _check_mode(mode)
    n_tok, n_seq = float(tokens), float(seqs)
    if n_tok < 0 or n_seq < 0:
        raise ValueError(f"counts must be >= 0, got tokens={n_tok}, seqs={n_seq}")
    if mode == "token-mean":
        denom = n_tok
    elif mode == "seq-mean-token-sum-norm":
        if fixed_normalizer is None or fixed_normalizer <= 0:
            raise ValueError(
                f"mode 'seq-mean-token-sum-norm' needs fixed_normalizer > 0 (e.g. the max "
                f"response length), got {fixed_normalizer}"
            )
        denom = n_seq * float(fixed_normalizer)
    else:
        denom = n_seq
    return denom if denom > 0 else 1.0


def global_denominator(
    mode: str,
    mask: torch.Tensor,  # (B, T) 1 on response tokens of the WHOLE global batch
    *,
    fixed_normalizer: float | None = None,
) -> float:
    """``make_denominator`` from a mask that already covers the whole global batch."""
    stats = denominator_stats(mask)
    return make_denominator(mode, tokens=stats["tokens"], seqs=stats["seqs"], fixed_normalizer=fixed_normalizer)


def aggregate(
    per_token_loss: torch.Tensor,  # (b, T) loss l_it of a micro-batch / shard
    mask: torch.Tensor,  # (b, T) 1 on response tokens
    *,
    mode: str,
    global_denominator: float,
) -> torch.Tensor:  # () this part's share of the global objective
    """Sum-style share of the global loss: summed over parts it gives the full value."""
    _check_mode(mode)
    check_same_shape(per_token_loss=per_token_loss, mask=mask)
    if global_denominator <= 0:
        raise ValueError(f"global_denominator={global_denominator} must be > 0")
    m = as_bool_mask(mask)
    loss = masked_fill_zero(per_token_loss, m)
    if mode == "seq-mean-token-mean":
        n_i = m.sum(dim=1).clamp(min=1).to(loss.dtype)  # (b,)
        numerator = (loss.sum(dim=1) / n_i).sum()
    else:
        numerator = loss.sum()
    return numerator / global_denominator
