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
    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = "llama"
    """HF architecture family used for export and the vLLM engines (qwen3: RMSNorm on each
    query and key head before RoPE, megatron's qk_layernorm; qwen3_moe: qwen3 attention with a
    mixture of routed experts as every layer's MLP, no shared experts; mixtral: llama attention
    with such a mixture, its k routing weights always renormalised, no sliding window)."""
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
    """SwiGLU inner width (qwen3_moe: HF intermediate_size, kept for export; mixtral: each expert's)."""
    num_experts: int = 0
    """Routed experts per layer (HF num_experts / num_local_experts), arch=qwen3_moe or mixtral only; 0 = dense."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU inner width of one expert (HF moe_intermediate_size); 0 = ffn_hidden_size (mixtral: 0 or that)."""
    moe_router_topk: int = 2
    """Experts each token is sent to (HF num_experts_per_tok)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the k chosen experts' routing weights to sum to 1 (HF norm_topk_prob): a softmax
    over the k largest router logits. False: softmax over all experts, then the k largest
    (megatron moe_router_pre_softmax; mixtral: always True)."""
    moe_router_fp32: bool = True
    """Router logits, softmax and top-k in fp32 whatever model.dtype (megatron moe_router_dtype)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss added to the training loss (Switch Transformer,
    Fedus et al. 2021, eq. 4: E·Σᵢ fᵢ·Pᵢ per micro-batch, token-weighted mean over the update's
    micro-batches); 0 = off. HF router_aux_loss_coef only acts in HF training."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5: mean over tokens of
    logsumexp(router logits)², token-weighted over micro-batches like the aux loss); 0 = off."""
    moe_grouped_gemm: bool = False
    """All local experts in one grouped GEMM (Transformer Engine's TEGroupedMLP: GPU, needs
    transformer_impl=transformer_engine); false: a GEMM pair per expert (megatron's SequentialMLP).
    Same math; checkpoints convert between the two naming forms."""
    moe_dead_expert_steps: int = 10
    """Warn in the step log when an expert of the actor receives no tokens in this many
    consecutive RL updates, steps (and again whenever that set of experts changes); 0 = never."""
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

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One expert's SwiGLU inner width."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = (
        "kv_channels",
        "vocab_size",
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_dead_expert_steps",
    )

    def validate(self) -> None:
        """The architecture is one megatron can build and the HF mapping can express."""
        _check_architecture(self)
        _check_experts(self)


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


MOE_ARCHS = ("qwen3_moe", "mixtral")
"""The families whose every layer's MLP is a mixture of routed experts."""


def _check_experts(m: ModelConfig) -> None:
    if m.arch in MOE_ARCHS and not m.is_moe:
        fail("model.num_experts", m.num_experts, f"must be >= 1 with arch={m.arch} (routed experts)")
    if m.is_moe and m.arch not in MOE_ARCHS:
        fail("model.num_experts", m.num_experts, f"needs arch=qwen3_moe or mixtral; arch={m.arch} has a dense MLP")
    if m.arch == "mixtral" and m.moe_ffn_hidden_size not in (0, m.ffn_hidden_size):
        fail(
            "model.moe_ffn_hidden_size",
            m.moe_ffn_hidden_size,
            f"differs from model.ffn_hidden_size={m.ffn_hidden_size}: a Mixtral expert is intermediate_size wide",
        )
    if m.arch == "mixtral" and not m.moe_norm_topk_prob:
        fail("model.moe_norm_topk_prob", False, "must be true: arch=mixtral always renormalises its k routing weights")
    if m.moe_grouped_gemm and not m.is_moe:
        fail("model.moe_grouped_gemm", True, "needs a MoE model (model.num_experts > 0)")
    if m.moe_grouped_gemm and m.transformer_impl != "transformer_engine":
        fail(
            "model.moe_grouped_gemm",
            True,
            f"needs model.transformer_impl=transformer_engine (TE's grouped GEMM, GPU); it is {m.transformer_impl}",
        )
    if m.is_moe and m.moe_router_topk > m.num_experts:
        fail("model.moe_router_topk", m.moe_router_topk, f"exceeds model.num_experts={m.num_experts}")
    for name, value in (("moe_aux_loss_coeff", m.moe_aux_loss_coeff), ("moe_z_loss_coeff", m.moe_z_loss_coeff)):
        if value < 0:
            fail(f"model.{name}", value, "must be >= 0")
