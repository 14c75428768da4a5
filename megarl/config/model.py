"""Run config sections for the model and how it is trained: architecture, parallel
layout, optimizer (one kw_only dataclass each; every field documented with its unit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size of actor and reference."""
    pipeline_parallel: int = 1
    """Pipeline-parallel stages."""
    data_parallel: int = 1
    """Data-parallel replicas; trainer world size = TP × PP × DP."""
    micro_batch_size: int = 8
    """Sequences per micro-batch on one DP rank."""
    logprob_micro_batch_size: int = 0
    """Rows per micro-batch of the forward-only passes (old/reference log-probs, values);
    no activations are kept, so it can be larger than micro_batch_size. 0 = micro_batch_size."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one micro-batch, tokens (rows × the group's longest row, padding
    included); 0 = off (fixed micro_batch_size rows padded to the batch's longest). When set,
    each DP rank's rows (balanced over DP by tokens) are grouped by length and cut to their
    own longest row, in training and forward-only passes; micro_batch_size and
    logprob_micro_batch_size then only fix how the batch divides. Must be ≥
    rollout.max_prompt_len + max_response_len (the longest row runs alone)."""
    pack_sequences: bool = False
    """Run each token-budget micro-batch padding-free: its rows back to back in one packed row,
    positions restarting per sequence, block-diagonal causal attention (megatron's ``thd``
    layout: Transformer Engine's varlen attention with transformer_impl=transformer_engine,
    one fused SDPA call per sequence with the local spec). Same loss and gradients. Needs
    max_tokens_per_micro_batch > 0, and model.attention=sdpa with the local spec."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron distributed optimizer)."""
    cpu_keep_freed_memory: bool = True
    """CPU trainer ranks only: glibc keeps freed memory for reuse instead of returning every
    block over 32 MiB to the kernel (whose pages then fault in again on the next step's
    activations and gradients). The ranks hold their peak memory, as a GPU caching allocator
    does. False = the C library's defaults."""


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final LR of the cosine schedule."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up; the cosine decays over ``train.steps`` − ``warmup_steps`` steps at
    the starting batch, counted in responses trained (the coordinator may change the batch)."""
    warmup_steps: int = 0
    """Linear warm-up, RL steps at the starting batch: over warmup_steps × rollout.num_prompts ×
    samples_per_prompt responses trained (``megarl.planning.schedule_lr``)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.999
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam ε."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""
