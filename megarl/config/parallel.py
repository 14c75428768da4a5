"""The ``parallel`` section: how the trainer ranks split the actor and reference (TP / PP / DP /
EP), micro-batches and token budgets, and its own checks (:meth:`ParallelConfig.check_experts`
needs the model and DP, so :mod:`megarl.config.cross` calls it). The other rules it shares with
the model, the batch and the world size are :mod:`megarl.config.cross`'s."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from megarl.config.rules import fail

if TYPE_CHECKING:
    from megarl.config.model import ModelConfig


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size of actor and reference."""
    pipeline_parallel: int = 1
    """Pipeline-parallel stages."""
    data_parallel: int = 1
    """Data-parallel replicas; trainer world size = TP × PP × DP."""
    expert_parallel: int = 1
    """Expert-parallel size (MoE models): each layer's experts are split over this many DP ranks,
    each holding model.num_experts / EP of them; tokens travel to their experts through
    megatron's alltoall dispatcher. Must divide model.num_experts and DP. A MoE model at
    tensor_parallel > 1 needs sequence_parallel."""
    expert_tensor_parallel: int = 0
    """Expert tensor-parallel size (megatron's expert_tensor_parallel_size): 0 = tensor_parallel
    (each expert split over TP like a dense MLP), or 1 (each expert whole on every TP rank, the
    usual MoE layout: each TP rank runs its own sequence-parallel slice of tokens through whole
    experts, whose gradients are then summed over the TP ranks with the expert-data-parallel
    reduction), or any other divisor of tensor_parallel (each expert split over that many
    consecutive TP ranks, e.g. 2 at TP 4: each pair of TP ranks runs its tokens through the
    experts split in two). Sizes not dividing tensor_parallel are refused, and any size other
    than tensor_parallel with a critic on its own layout (critic.parallel)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: outside attention and the MLP's TP-split matmuls (norms,
    residuals, dropout, the MoE router) each TP rank holds 1/TP of the sequence, halving those
    activations per rank at TP 2; all-gather / reduce-scatter replace the TP all-reduces.
    Micro-batches whose width (packed: token count) TP does not divide run right-padded by a few
    positions, cut off again at the output. Same log-probs and gradients. Needs
    tensor_parallel > 1; required for a mixture-of-experts model at tensor_parallel > 1
    (megatron refuses MoE training under TP without it)."""
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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = (
        "logprob_micro_batch_size",
        "max_tokens_per_micro_batch",
        "expert_tensor_parallel",
    )

    def validate(self) -> None:
        """pack_sequences packs token-budget micro-batches; sequence parallelism splits the
        sequence over TP ranks."""
        if self.sequence_parallel and self.tensor_parallel == 1:
            fail(
                "parallel.sequence_parallel",
                True,
                "splits the sequence over TP ranks: needs parallel.tensor_parallel > 1",
            )
        if self.pack_sequences and not self.max_tokens_per_micro_batch:
            fail(
                "parallel.pack_sequences",
                True,
                "packs token-budget micro-batches: set parallel.max_tokens_per_micro_batch",
            )

    def check_sequence_parallel(self, m: ModelConfig, tp: int, field: str) -> None:
        """A MoE model at TP > 1 (``field``: the actor's or the critic's TP) trains only with
        sequence parallelism: megatron's MoELayer raises in training without it."""
        if m.is_moe and tp > 1 and not self.sequence_parallel:
            fail(
                "parallel.sequence_parallel",
                False,
                f"with a mixture-of-experts model at {field}={tp}: megatron trains MoE layers under TP only "
                "with sequence parallelism (set parallel.sequence_parallel: true)",
            )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size megatron builds (0 resolved to tensor_parallel)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    def check_critic_expert_tp(self, m: ModelConfig) -> None:
        """A critic on its own layout shares the actor's expert groups (built for the actor's TP):
        expert TP below TP is refused beside it."""
        etp, tp = self.expert_tensor_parallel, self.tensor_parallel
        if m.is_moe and etp and etp != tp:
            fail(
                "parallel.expert_tensor_parallel",
                etp,
                f"differs from parallel.tensor_parallel={tp} with a critic on its own layout (critic.parallel): "
                "the critic's layout shares the actor's expert groups, built for the actor's TP",
            )

    def critic(self, tp: int, pp: int, dp: int) -> ParallelConfig:
        """This section for the critic's own layout (``critic.parallel``): sequence parallelism
        only where that layout has TP > 1 (megatron refuses it at TP 1); expert TP = the
        layout's TP unless it is the actor's TP (expert TP < TP is refused beside a critic
        layout of its own, :meth:`check_critic_expert_tp`)."""
        sp = self.sequence_parallel and tp > 1
        etp = self.expert_tensor_parallel if tp == self.tensor_parallel else 0
        return replace(
            self,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            data_parallel=dp,
            sequence_parallel=sp,
            expert_tensor_parallel=etp,
        )

    def check_experts(self, m: ModelConfig, dp: int) -> None:
        """Expert parallelism splits a MoE model's experts over DP ranks (megatron's expert
        layout, expert TP = TP: EP × TP must divide the TP × DP ranks of a pipeline stage; at
        expert TP < TP the EP group spans TP ranks first, and EP dividing DP is kept as the rule)."""
        ep, tp = self.expert_parallel, self.tensor_parallel
        if ep > 1 and not m.is_moe:
            fail("parallel.expert_parallel", ep, f"needs a mixture-of-experts model (model.arch={m.arch} is dense)")
        if m.is_moe and m.num_experts % ep:
            fail("parallel.expert_parallel", ep, f"does not divide model.num_experts={m.num_experts}")
        if dp % ep:
            fail(
                "parallel.expert_parallel",
                ep,
                f"does not divide the data-parallel size {dp} (EP × TP={ep * tp} must divide TP × DP={dp * tp}, "
                "megatron's expert layout)",
            )
        if m.is_moe and m.expert_ffn_hidden_size % tp:
            fail("parallel.tensor_parallel", tp, f"does not divide the experts' width {m.expert_ffn_hidden_size}")
        self.check_sequence_parallel(m, tp, "parallel.tensor_parallel")
        etp = self.expert_tensor_parallel
        if etp < 0 or (etp and tp % etp):
            fail(
                "parallel.expert_tensor_parallel",
                etp,
                f"must be 0 (= parallel.tensor_parallel) or divide parallel.tensor_parallel={tp}: each expert is "
                "split over that many consecutive TP ranks",
            )
        if ep > 1 and self.max_tokens_per_micro_batch:
            fail(
                "parallel.max_tokens_per_micro_batch",
                self.max_tokens_per_micro_batch,
                f"with parallel.expert_parallel={ep}: DP ranks may then run different numbers of micro-batches, "
                "and every expert all-to-all needs all EP ranks",
            )
