"""The ``parallel`` section: how the trainer ranks split the actor and reference (TP / PP / DP),
micro-batches and token budgets, and its own check. The rules it shares with the model, the
batch and the world size are :mod:`megarl.config.cross`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megarl.config.rules import fail


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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("logprob_micro_batch_size", "max_tokens_per_micro_batch")

    def validate(self) -> None:
        """pack_sequences packs token-budget micro-batches."""
        if self.pack_sequences and not self.max_tokens_per_micro_batch:
            fail(
                "parallel.pack_sequences",
                True,
                "packs token-budget micro-batches: set parallel.max_tokens_per_micro_batch",
            )
