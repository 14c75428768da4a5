"""The ``model`` section: the actor's (and reference's) architecture, or the HF folder it starts
from (``init_from``), and its checks. With ``init_from`` the run checks the architecture that
folder's config.json describes, the one it builds: ``megarl.config.validate`` calls
:meth:`ModelConfig.validate` on :func:`megarl.config.hf.resolved_model`, which first checks the
folder itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from megarl.config.rules import fail


@dataclass(kw_only=True)
class ModelConfig:
    arch: Literal["llama", "qwen2", "qwen3"] = "llama"
    """HF architecture family used for export and the vLLM engines (qwen3: RMSNorm on each
    query and key head before RoPE, megatron's qk_layernorm)."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width (channels)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """KV heads (GQA groups); equal to num_attention_heads for MHA."""
    kv_channels: int = 0
    """Channels per attention head (HF head_dim; megatron kv_channels); 0 = hidden_size /
    num_attention_heads. Qwen3 and some Llamas have head_dim × heads ≠ hidden_size."""
    ffn_hidden_size: int = 256
    """SwiGLU inner width."""
    vocab_size: int = 0
    """Tokenizer vocabulary (0 = take it from the tokenizer)."""
    max_position_embeddings: int = 128
    """Longest sequence (prompt + response) in tokens."""
    rotary_base: float = 10000.0
    """RoPE theta (fractional values are kept)."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """RoPE frequency scaling (HF rope_scaling rope_type); llama3 = Llama 3.1/3.2 long-context."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: low frequencies are divided by this factor."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max / this are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max / this are kept."""
    rope_original_max_position_embeddings: int = 8192
    """llama3 scaling: context length the model was pretrained on, tokens."""
    linear_bias: bool = False
    """Biases on every linear layer (HF Llama attention_bias and mlp_bias together); Qwen2's
    QKV-only bias comes with arch=qwen2."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share input embedding and LM head."""
    init_std: float = 0.02
    """Std of the normal weight init (random init only)."""
    init_from: str = ""
    """HF model folder to start from ('' = random init + optional warm start)."""
    tokenizer: str = "auto"
    """'builtin' (SentencePiece trained on the task: the demo), 'hf' (the tokenizer, chat template
    and generation config of init_from's folder), a folder path, or 'auto' = 'hf' when
    init_from holds tokenizer files, else 'builtin'."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer spec: megatron 'local' (CPU and GPU) or Transformer Engine (GPU only)."""
    attention: Literal["sdpa", "unfused"] = "sdpa"
    """Core attention of the local spec: torch's fused scaled_dot_product_attention, or
    megatron's unfused DotProductAttention (scores materialised). Same math."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype of the trainer (bf16 is GPU only)."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, or hidden_size / num_attention_heads."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("kv_channels", "vocab_size")

    def validate(self) -> None:
        """The architecture is one megatron can build and the HF mapping can express."""
        _check_architecture(self)


def _check_architecture(m: ModelConfig) -> None:
    if m.linear_bias and m.arch != "llama":
        fail("model.linear_bias", m.linear_bias, f"is a Llama option; arch={m.arch} has its own bias layout")
    if m.arch == "qwen2" and m.head_dim * m.num_attention_heads != m.hidden_size:
        fail(
            "model.kv_channels",
            m.kv_channels,
            f"arch=qwen2 needs head_dim × num_attention_heads = hidden_size={m.hidden_size} "
            "(vLLM's Qwen2 derives head_dim from it)",
        )
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        fail(
            "model.rope_high_freq_factor",
            m.rope_high_freq_factor,
            f"must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} (llama3 RoPE scaling)",
        )
    if not m.kv_channels and m.hidden_size % m.num_attention_heads:
        fail(
            "model.hidden_size",
            m.hidden_size,
            f"must be divisible by model.num_attention_heads={m.num_attention_heads}",
        )
    if m.num_attention_heads % m.num_query_groups:
        fail(
            "model.num_query_groups",
            m.num_query_groups,
            f"must divide model.num_attention_heads={m.num_attention_heads}",
        )
