"""The ONE Megatron ⇄ HF name/layout mapping for Llama-, Qwen2-, Qwen3-, Qwen3-MoE- and Mixtral-family decoders.

Used by weight sync, checkpoint export and ``tools/`` alike, so export and sync can never
disagree. Layouts handled (as Megatron's own converters / Megatron-Bridge treat them):

* ``linear_qkv.weight`` is grouped by query group: for each of the G KV groups, the rows of
  its heads/G query heads, then its key head, then its value head. Each TP rank holds G/TP
  whole groups, so concatenating TP shards along dim 0 keeps the per-group layout.
* ``linear_fc1.weight`` (SwiGLU) is [gate; up] *per TP shard*: the gathered tensor is
  [g0; u0; g1; u1; ...] and is re-split per shard before building ``gate_proj``/``up_proj``.
* Vocabulary rows are padded to a multiple of TP (and ``make_vocab_size_divisible_by``):
  stripped on export, zero-padded on import.
* Biases: Qwen2's q/k/v bias rides in ``linear_qkv.bias`` (grouped like the weight); with
  ``model.linear_bias`` (HF Llama ``attention_bias`` + ``mlp_bias``) ``linear_fc1.bias`` is
  [gate; up] per TP shard like its weight, and the row-parallel ``linear_proj.bias`` /
  ``linear_fc2.bias`` are whole on every TP rank (added after the reduce).
* Qwen3's per-head RMSNorms ``self_attention.{q,k}_layernorm.weight`` ([head_dim], applied to
  every head before RoPE) are whole on every TP rank and map to ``self_attn.{q,k}_norm.weight``.
* head_dim (``model.kv_channels``) may differ from hidden_size / heads: q/k/v/o shapes use it.
* Local layer spec names (``input_layernorm``, ``pre_mlp_layernorm``) and Transformer-Engine
  fused names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) both map.
* MoE (Qwen3-MoE, Mixtral): the router ``mlp.router.weight`` is HF's ``mlp.gate.weight``
  (Mixtral: ``block_sparse_moe.gate.weight``); expert g's ``linear_fc1`` ([gate; up] per TP
  shard, as the dense MLP) and ``linear_fc2`` are HF's ``mlp.experts.{g}.gate_proj/up_proj/down_proj``
  (Mixtral: ``block_sparse_moe.experts.{g}.w1/w3/w2``), in both megatron naming forms
  (:mod:`megarl.checkpoint.experts`). The adapter sees GLOBAL expert indices: EP ranks' local
  indices are renumbered by :mod:`megarl.checkpoint.hf_io`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megarl.checkpoint.experts import HF_EXPERT_NAMES, expert_target, hf_expert_shapes
from megarl.config import ModelConfig
from megarl.config.hf import model_config_from_hf
from megarl.errors import AdapterError

__all__ = ["AdapterError", "LlamaQwen2Adapter", "iter_layer_groups", "model_config_from_hf"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> (HF per-layer suffix or special kind, TP split dim or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", None),
    "self_attention.linear_qkv.weight": ("@qkv.weight", 0),
    "self_attention.linear_qkv.bias": ("@qkv.bias", 0),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "self_attention.linear_proj.bias": ("self_attn.o_proj.bias", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc1.weight": ("@fc1.weight", 0),
    "mlp.linear_fc1.bias": ("@fc1.bias", 0),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
    "mlp.linear_fc2.bias": ("mlp.down_proj.bias", None),
}
_GLOBAL_MAP: dict[str, tuple[str, int | None]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


class LlamaQwen2Adapter:
    """Name/layout mapping for one model config (Llama, Qwen2, Qwen3, Qwen3-MoE or Mixtral family)."""

    def __init__(self, mcfg: ModelConfig) -> None:
        self.cfg = mcfg
        self.experts = HF_EXPERT_NAMES.get(mcfg.arch) if mcfg.is_moe else None
        self.heads = mcfg.num_attention_heads
        self.groups = mcfg.num_query_groups
        self.head_dim = mcfg.head_dim
        self.vocab = mcfg.vocab_size

    # ------------------------------------------------------------------ names

    def hf_shapes(self) -> dict[str, list[int]]:
        """Shapes of every HF tensor of this architecture (an engine's update manifest)."""
        m = self.cfg
        hd, H = m.head_dim, m.hidden_size
        q, kv = m.num_attention_heads * hd, m.num_query_groups * hd
        shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [m.vocab_size, H], "model.norm.weight": [H]}
        if not m.tie_embeddings:
            shapes["lm_head.weight"] = [m.vocab_size, H]
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "input_layernorm.weight": [H],
                    p + "post_attention_layernorm.weight": [H],
                    p + "self_attn.q_proj.weight": [q, H],
                    p + "self_attn.k_proj.weight": [kv, H],
                    p + "self_attn.v_proj.weight": [kv, H],
                    p + "self_attn.o_proj.weight": [H, q],
                }
            )
            if self.experts is not None:
                shapes.update(hf_expert_shapes(p, self.experts, m.num_experts, H, m.expert_ffn_hidden_size))
            else:
                shapes.update(
                    {
                        p + "mlp.gate_proj.weight": [m.ffn_hidden_size, H],
                        p + "mlp.up_proj.weight": [m.ffn_hidden_size, H],
                        p + "mlp.down_proj.weight": [H, m.ffn_hidden_size],
                    }
                )
            if m.arch in ("qwen3", "qwen3_moe"):
                shapes.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
            if m.arch == "qwen2" or m.linear_bias:
                shapes.update(
                    {
                        p + "self_attn.q_proj.bias": [q],
                        p + "self_attn.k_proj.bias": [kv],
                        p + "self_attn.v_proj.bias": [kv],
                    }
                )
            if m.linear_bias:
                shapes.update(
                    {
                        p + "self_attn.o_proj.bias": [H],
                        p + "mlp.gate_proj.bias": [m.ffn_hidden_size],
                        p + "mlp.up_proj.bias": [m.ffn_hidden_size],
                        p + "mlp.down_proj.bias": [H],
                    }
                )
        return shapes

    def split_dim(self, mname: str) -> int | None:
        """TP split dimension of a megatron parameter (None = replicated)."""
        return self._lookup(mname)[1]

    def _lookup(self, mname: str) -> tuple[str, int | None]:
        m = _LAYER.match(mname)
        if m:
            suffix = m.group(2)
            if suffix in _LAYER_MAP:
                return _LAYER_MAP[suffix]
            if self.experts is not None and (expert := expert_target(suffix, self.experts)) is not None:
                return expert
        elif mname in _GLOBAL_MAP:
            return _GLOBAL_MAP[mname]
        raise AdapterError(f"no HF mapping for megatron parameter '{mname}'")

    @staticmethod
    def skip(mname: str) -> bool:
        return mname.endswith("_extra_state")

    # ------------------------------------------------------------------ Megatron -> HF

    def to_hf(self, mname: str, full: torch.Tensor, layer_offset: int, tp: int) -> list[tuple[str, torch.Tensor]]:
        """Map one TP-gathered megatron tensor to its HF tensor(s)."""
        target, _ = self._lookup(mname)
        m = _LAYER.match(mname)
        prefix = f"model.layers.{int(m.group(1)) + layer_offset}." if m else ""
        if target == "@qkv.weight" or target == "@qkv.bias":
            kind = target.split(".")[1]
            q, k, v = self._split_qkv(full)
            return [
                (f"{prefix}self_attn.q_proj.{kind}", q),
                (f"{prefix}self_attn.k_proj.{kind}", k),
                (f"{prefix}self_attn.v_proj.{kind}", v),
            ]
        if target in ("@fc1.weight", "@fc1.bias"):
            kind = target.split(".")[1]
            gate, up = self._split_fc1(full, tp)
            return [(f"{prefix}mlp.gate_proj.{kind}", gate), (f"{prefix}mlp.up_proj.{kind}", up)]
        if target.startswith("@efc1."):
            gate, up = self._split_fc1(full, tp)
            gate_name, up_name = self._gate_up_names(prefix, target)
            return [(gate_name, gate), (up_name, up)]
        if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[: self.vocab]
        return [(prefix + target, full)]

    def _gate_up_names(self, prefix: str, target: str) -> tuple[str, str]:
        """HF gate and up projection names of the expert an ``@efc1.{g}`` target stands for."""
        e, g = self.experts, int(target.removeprefix("@efc1."))
        if e is None:
            raise AdapterError(f"'{target}': {self.cfg.arch} has no experts")
        return prefix + e.expert(g, e.gate), prefix + e.expert(g, e.up)

    def _split_qkv(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per = self.heads // self.groups
        hd = self.head_dim
        grouped = full.reshape(self.groups, (per + 2) * hd, *full.shape[1:])
        q = grouped[:, : per * hd].reshape(self.heads * hd, *full.shape[1:])
        k = grouped[:, per * hd : (per + 1) * hd].reshape(self.groups * hd, *full.shape[1:])
        v = grouped[:, (per + 1) * hd :].reshape(self.groups * hd, *full.shape[1:])
        return q.contiguous(), k.contiguous(), v.contiguous()

    @staticmethod
    def _split_fc1(full: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        shards = full.reshape(tp, 2, full.shape[0] // (2 * tp), *full.shape[1:])
        gate = shards[:, 0].reshape(-1, *full.shape[1:])
        up = shards[:, 1].reshape(-1, *full.shape[1:])
        return gate.contiguous(), up.contiguous()

    # ------------------------------------------------------------------ HF -> Megatron

    def from_hf(
        self,
        mname: str,
        hf: Mapping[str, torch.Tensor],
        layer_offset: int,
        tp: int,
        tp_rank: int,
        shape: torch.Size,
    ) -> torch.Tensor:
        """The TP shard of megatron parameter ``mname`` for ``tp_rank``, built from HF tensors."""
        target, dim = self._lookup(mname)
        m = _LAYER.match(mname)
        prefix = f"model.layers.{int(m.group(1)) + layer_offset}." if m else ""

        def get(name: str) -> torch.Tensor:
            if name not in hf:
                raise AdapterError(f"HF checkpoint lacks '{name}' (needed for '{mname}')")
            return hf[name]

        if target in ("@qkv.weight", "@qkv.bias"):
            kind = target.split(".")[1]
            q = get(f"{prefix}self_attn.q_proj.{kind}")
            k = get(f"{prefix}self_attn.k_proj.{kind}")
            v = get(f"{prefix}self_attn.v_proj.{kind}")
            per, hd = self.heads // self.groups, self.head_dim
            rest = q.shape[1:]
            full = torch.cat(
                [
                    q.reshape(self.groups, per * hd, *rest),
                    k.reshape(self.groups, hd, *rest),
                    v.reshape(self.groups, hd, *rest),
                ],
                dim=1,
            ).reshape(-1, *rest)
        elif target in ("@fc1.weight", "@fc1.bias") or target.startswith("@efc1."):
            # per TP shard [gate; up]
            if target.startswith("@efc1."):
                names = list(self._gate_up_names(prefix, target))
            else:
                names = [f"{prefix}mlp.{w}_proj.{target.split('.')[1]}" for w in ("gate", "up")]
            gate, up = (get(n).chunk(tp, dim=0) for n in names)
            full = torch.cat([torch.cat([g, u], dim=0) for g, u in zip(gate, up)], dim=0)
        elif mname == "output_layer.weight" and "lm_head.weight" not in hf:
            full = get("model.embed_tokens.weight")  # tied embeddings
        else:
            full = get(prefix + target)
        if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
            padded_rows = shape[0] * tp
            if full.shape[0] > padded_rows:
                raise AdapterError(f"'{mname}': HF vocabulary {full.shape[0]} exceeds padded size {padded_rows}")
            pad = full.new_zeros(padded_rows - full.shape[0], *full.shape[1:])
            full = torch.cat([full, pad], dim=0)
        shard = full if dim is None else full.chunk(tp, dim=dim)[tp_rank]
        if shard.shape != shape:
            raise AdapterError(
                f"'{mname}': HF tensors give shape {tuple(shard.shape)} for TP rank {tp_rank}, "
                f"model expects {tuple(shape)}"
            )
        return shard.contiguous()

    # ------------------------------------------------------------------ HF config

    def hf_config(
        self,
        eos_token_id: int | None,
        bos_token_id: int | None,
        pad_token_id: int | None,
        dtype: str | None = None,
    ) -> Any:
        """A transformers config object matching this model exactly.

        ``dtype``: the ``torch_dtype`` to record (e.g. "bfloat16"); default the trainer's dtype.
        """
        c = self.cfg
        common: dict[str, Any] = dict(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.ffn_hidden_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_query_groups,
            max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.norm_eps,
            rope_parameters=_rope_parameters(c),
            tie_word_embeddings=c.tie_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            hidden_act="silu",
            torch_dtype=dtype or ("float32" if c.dtype == "fp32" else "bfloat16"),
        )
        return _family_config(c, common)


def _rope_parameters(c: ModelConfig) -> dict[str, Any]:
    """HF's ``rope_parameters``: default RoPE, or Llama 3's frequency scaling."""
    if c.rope_scaling != "llama3":
        return {"rope_type": "default", "rope_theta": c.rotary_base}
    return {
        "rope_type": "llama3",
        "rope_theta": c.rotary_base,
        "factor": c.rope_scaling_factor,
        "low_freq_factor": c.rope_low_freq_factor,
        "high_freq_factor": c.rope_high_freq_factor,
        "original_max_position_embeddings": c.rope_original_max_position_embeddings,
    }


def _family_config(c: ModelConfig, common: dict[str, Any]) -> Any:
    """The transformers config class of ``c.arch``, with the fields every family shares."""
    if c.arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if c.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # head_dim is no declared field of Qwen3MoeConfig: its attention reads it when present
        return Qwen3MoeConfig(
            **dict(common, head_dim=c.head_dim),
            attention_bias=False,
            num_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn_hidden_size,
            num_experts_per_tok=c.moe_router_topk,
            norm_topk_prob=c.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
        )
    if c.arch == "mixtral":
        from transformers import MixtralConfig

        # intermediate_size is one expert's width; Mixtral's k routing weights are always
        # renormalised (no norm_topk_prob), its attention has no biases and no q/k norms
        return MixtralConfig(
            **dict(common, intermediate_size=c.expert_ffn_hidden_size),
            head_dim=c.head_dim,
            num_local_experts=c.num_experts,
            num_experts_per_tok=c.moe_router_topk,
            sliding_window=None,
            architectures=["MixtralForCausalLM"],
        )
    if c.arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=c.head_dim, attention_bias=False, architectures=["Qwen3ForCausalLM"])
    from transformers import LlamaConfig

    return LlamaConfig(
        **common,
        head_dim=c.head_dim,
        attention_bias=c.linear_bias,
        mlp_bias=c.linear_bias,
        architectures=["LlamaForCausalLM"],
    )


def iter_layer_groups(named: list[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group HF tensors by transformer layer (non-layer tensors form one group).

    A group holds every tensor feeding one fused vLLM weight (q/k/v, gate/up together).
    """
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        key = m.group(1) if m else "_global"
        groups.setdefault(key, []).append((name, t))
    for key in sorted(groups, key=lambda k: (k == "_global", int(k) if k.isdigit() else 0)):
        yield groups[key]
