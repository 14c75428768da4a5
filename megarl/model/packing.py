"""Padding-free sequence packing of a token-budget micro-batch (``parallel.pack_sequences``).

A token-budget micro-batch (``megarl.model.microbatch``) still pads its rows to its own longest
one (~10% of the tokens with mixed 5–256-token responses). Packed, its rows run as ONE row of
``T = Σ lengths`` tokens, each sequence's first ``lengths[i]`` columns back to back, in the
megatron ``thd`` layout (``PackedSeqParams(qkv_format="thd", cu_seqlens=...)``):

* RoPE restarts at position 0 for every sequence (megatron's ``apply_rotary_pos_emb`` with
  ``cu_seqlens`` rotates each sequence by its own positions);
* attention is block-diagonal causal: a token sees only earlier tokens of its own sequence —
  Transformer Engine's varlen kernels with ``transformer_impl: transformer_engine`` (GPU), the
  local spec's :class:`megarl.model.sdpa.SDPAttention` otherwise (one fused causal call per
  sequence, :func:`megarl.model.sdpa.varlen_causal_attention`: no work on the masked blocks);
* every other layer is per-token, so each packed token's output equals the padded row's.

For a training loss the last stage's output is unpacked to the micro-batch's padded
``(b, width, ...)`` layout right after the forward (:meth:`Packing.unpack`, zeros at padding,
differentiable), so every loss function reads what the padded token-budget path gives it.
Forward-only passes (log-probs, entropy, values) work token by token: they run on the packed
output and only their ``(1, T)`` results are unpacked. Exactness needs each row's ``length`` to
cover every position a consumer reads (``row_lengths``: last response position + 2);
positions at or beyond it read zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.model.microbatch import MicroBatch


@dataclass(frozen=True)
class Packing:
    """Where each packed token of one micro-batch comes from."""

    lengths: torch.Tensor  # (b,) long, real columns of each row, >= 1
    width: int
    """Columns of the padded micro-batch (>= every length)."""
    index: torch.Tensor  # (T,) long, flat position row × width + column of each packed token
    positions: torch.Tensor  # (1, T) long, column of each packed token (restarts at 0 per row)
    cu_seqlens: torch.Tensor  # (b + 1,) int32, [0, l0, l0 + l1, ...]

    @classmethod
    def of(cls, lengths: torch.Tensor, width: int) -> Packing:
        lengths = lengths.long().cpu()
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(f"expected lengths (b,) with b >= 1, got shape {tuple(lengths.shape)}")
        if int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise ValueError(f"row lengths {lengths.tolist()} must lie in [1, width={width}]")
        starts = torch.arange(lengths.numel()) * width
        cols = torch.cat([torch.arange(int(n)) for n in lengths])
        index = torch.repeat_interleave(starts, lengths) + cols
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        return cls(lengths, width, index, cols[None], cu)

    @property
    def tokens(self) -> int:
        """T: real tokens of the micro-batch."""
        return int(self.index.numel())

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(b, width, ...) -> (1, T, ...): each row's first ``lengths[i]`` columns, in row order."""
        b = int(self.lengths.numel())
        if tuple(x.shape[:2]) != (b, self.width):
            raise ValueError(f"expected ({b}, {self.width}, ...) to pack, got {tuple(x.shape)}")
        return x.reshape(b * self.width, *x.shape[2:])[self.index.to(x.device)][None]

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) -> (b, width, ...) with zeros at padding; gradients flow to ``y``."""
        if y.shape[0] != 1 or y.shape[1] != self.tokens:
            raise ValueError(f"expected (1, {self.tokens}, ...) to unpack, got {tuple(y.shape)}")
        b = int(self.lengths.numel())
        flat = y.new_zeros(b * self.width, *y.shape[2:])
        flat = flat.index_copy(0, self.index.to(y.device), y[0])
        return flat.reshape(b, self.width, *y.shape[2:])

    def seq_params(self, device: torch.device | str, pad: int = 0) -> Any:
        """megatron's ``PackedSeqParams`` for the ``thd`` layout (self-attention: q = kv);
        ``pad`` > 0: the packed row carries that many padding tokens after the real ones
        (sequence parallelism: the row's length must divide by TP), a sequence of their own."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        if pad:
            cu = torch.cat([cu, cu[-1:] + pad])
        cu = cu.to(device)
        longest = max(int(self.lengths.max()), pad)
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )


def packings_of(groups: list[MicroBatch]) -> list[Packing | None]:
    """Each micro-batch's packing (None for one that runs padded)."""
    return [None if g.lengths is None else Packing.of(g.lengths, g.width) for g in groups]
