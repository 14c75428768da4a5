"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local spec.

Megatron's local ``DotProductAttention`` materialises the (b·heads, s, s) scores, masks and
soft-maxes them in separate passes and keeps the probabilities for backward; on CPU that is
memory-bound work of the same order as the projections for a few hundred tokens.
torch's SDPA runs a fused (flash-style) kernel on CPU and GPU. Same math: causal mask,
``softmax_scale``, grouped K/V heads expanded per query group. Anything the fused call
does not cover (an explicit mask, query-key layer scaling, attention dropout in training,
sliding windows, softmax offsets) falls back to megatron's implementation.

Packed sequences (megatron's ``thd`` layout, ``megarl.model.packing``) run one fused causal
call per sequence (:func:`varlen_causal_attention`): the block-diagonal causal mask without
computing the masked blocks. Megatron's own local attention refuses ``thd``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def varlen_causal_attention(
    q: torch.Tensor,  # (T, heads, d) packed sequences
    k: torch.Tensor,  # (T, heads, d) (K/V groups already expanded to heads)
    v: torch.Tensor,  # (T, heads, d)
    cu_seqlens: torch.Tensor,  # (n + 1,) sequence boundaries, [0, l0, l0 + l1, ..., T]
    scale: float | None,
) -> torch.Tensor:  # (T, heads, d)
    """Causal attention within each packed sequence (= attention under a block-diagonal causal
    mask over the packed row), one fused call per sequence."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs = [
        F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=scale)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)


class SDPAttention(DotProductAttention):  # type: ignore[misc]
    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        cfg = self.config
        mask_type = attn_mask_type or self.attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        if (
            attention_mask is not None
            or mask_type != AttnMaskType.causal
            or cfg.apply_query_key_layer_scaling
            or self.softmax_offset is not None
            or cfg.window_size is not None
            or dropout > 0.0
            or attention_bias is not None
            or (packed_seq_params is not None and packed_seq_params.qkv_format != "thd")
        ):
            return super().forward(  # type: ignore[no-any-return]
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if packed_seq_params is not None:  # thd: [T, heads, d], batch dimension squeezed
            if rep > 1:
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale)
            return out.reshape(query.shape[0], 1, self.hidden_size_per_partition)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
