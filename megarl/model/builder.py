"""Build megatron-core GPTModels (actor, reference, critic) and their optimizer from config.

A Llama/Qwen2/Qwen3-style decoder: RMSNorm, SwiGLU (``gated_linear_unit`` + SiLU), RoPE (optionally
Llama 3 scaled, ``megarl.model.rope``), GQA, head_dim from ``model.kv_channels``, Qwen3's
per-head q/k RMSNorm (``qk_layernorm``); linear biases: none, Qwen2's QKV bias, or all
(``model.linear_bias``, HF Llama ``attention_bias`` + ``mlp_bias``). The layer spec is megatron's ``local`` spec
(CPU and GPU) or Transformer Engine's (GPU only), selected by ``model.transformer_impl``.

Loss scaling convention: ``calculate_per_token_loss=True`` and a finalize function that
never divides by a token count. Every loss megarl returns is already normalised by a
denominator computed over the GLOBAL batch (``megarl.algo.aggregation``), so summing
gradients over micro-batches and DP ranks gives exactly the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megarl.config import ModelConfig, OptimConfig, ParallelConfig
from megarl.distributed import ParallelDims
from megarl.model.rope import apply_rope_scaling


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 8) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by × TP``."""
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def transformer_config(mcfg: ModelConfig, pcfg: ParallelConfig) -> Any:
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if mcfg.dtype == "bf16" else torch.float32
    return TransformerConfig(
        **_moe_fields(mcfg, pcfg),
        num_layers=mcfg.num_layers,
        hidden_size=mcfg.hidden_size,
        num_attention_heads=mcfg.num_attention_heads,
        num_query_groups=mcfg.num_query_groups,
        ffn_hidden_size=mcfg.ffn_hidden_size,
        kv_channels=mcfg.head_dim,
        tensor_model_parallel_size=pcfg.tensor_parallel,
        pipeline_model_parallel_size=pcfg.pipeline_parallel,
        sequence_parallel=pcfg.sequence_parallel,
        normalization="RMSNorm",
        layernorm_epsilon=mcfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=mcfg.linear_bias,
        add_qkv_bias=mcfg.arch == "qwen2",
        qk_layernorm=_qk_norm(mcfg),  # also makes finalize_model_grads sum their grads over TP
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        init_method_std=mcfg.init_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=mcfg.dtype == "bf16",
        calculate_per_token_loss=True,
    )


def _qk_norm(mcfg: ModelConfig) -> bool:
    return mcfg.arch in ("qwen3", "qwen3_moe")


def _moe_fields(mcfg: ModelConfig, pcfg: ParallelConfig) -> dict[str, Any]:
    """TransformerConfig's MoE fields: the router of Qwen3-MoE (HF ``Qwen3MoeTopKRouter``: softmax
    over all experts in fp32, top-k, optionally renormalised) and Mixtral (``MixtralTopKRouter``:
    the same, always renormalised, the k weights kept in fp32), and megatron's alltoall token
    dispatcher. Renormalised, softmax-then-top-k equals megatron's top-k of the logits then a
    softmax over the k (``moe_router_pre_softmax=False``): softmax is monotone, so the same k are
    chosen, and renormalising cancels the partition function over the other experts.
    Unnormalised, it is ``moe_router_pre_softmax=True``. Router dtype: HF computes the logits in
    the model's dtype and softmaxes them in fp32; ``moe_router_fp32`` computes the logits in fp32
    too (the same numbers in an fp32 model; in bf16 megarl's logits are the more precise ones)."""
    if not mcfg.is_moe:
        return {}
    return dict(
        num_moe_experts=mcfg.num_experts,
        moe_ffn_hidden_size=mcfg.expert_ffn_hidden_size,
        moe_router_topk=mcfg.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not mcfg.moe_norm_topk_prob,
        moe_router_dtype="fp32" if mcfg.moe_router_fp32 else None,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=mcfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=mcfg.moe_z_loss_coeff or None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=mcfg.moe_grouped_gemm,
        expert_model_parallel_size=pcfg.expert_parallel,
        expert_tensor_parallel_size=pcfg.expert_tp,
    )


def block_spec(mcfg: ModelConfig, tcfg: Any, pp_rank: int) -> Any:
    """The decoder spec GPTModel builds: the layer spec, or under sequence parallelism with the
    local spec this stage's block of them with megarl's SP-capable norms (``megarl.model.seqpar``;
    Transformer Engine's norms support it themselves)."""
    spec = layer_spec(mcfg)
    if not tcfg.sequence_parallel or mcfg.transformer_impl == "transformer_engine":
        return spec
    from megarl.model import seqpar

    return seqpar.block_spec(tcfg, seqpar.layer_spec_for(spec), pp_rank)


def layer_spec(mcfg: ModelConfig) -> Any:
    experts = mcfg.num_experts or None  # every layer's MLP a MoELayer (megatron moe_layer_freq=1)
    if mcfg.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=mcfg.moe_grouped_gemm, qk_layernorm=_qk_norm(mcfg)
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # qwen3: per-head RMSNorm (torch.nn.RMSNorm, eps=norm_eps) on q and k before RoPE; its
    # [head_dim] weights are whole on every TP rank. MoE: megatron's SequentialMLP, one
    # ColumnParallel/RowParallel pair per local expert (the legacy GroupedMLP needs bf16 and
    # the grouped_gemm package, TE's needs a GPU)
    spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm", qk_layernorm=_qk_norm(mcfg))
    if mcfg.attention == "sdpa":
        from megarl.model.sdpa import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


@dataclass
class Model:
    """A megatron model on this rank plus the objects that travel with it."""

    module: torch.nn.Module
    """The (DDP-wrapped when trainable) GPTModel stage of this rank."""
    config: Any
    """megatron TransformerConfig."""
    dims: ParallelDims
    vocab_size: int
    """Unpadded vocabulary."""
    padded_vocab: int
    optimizer: Any = None
    scheduler: Any = None
    probe: Any = None
    """megarl.model.grad_stats.GradProbe when the coordinator measures this model."""
    expert_load: Any = None
    """megarl.model.expert_load.ExpertLoad: tokens per routed expert in training forwards (a
    MoE actor built with ``track_experts``)."""
    routes: Any = None
    """megarl.model.routes.RouteReplay when its MoE routes are recorded and replayed (the
    actor with ``algo.router_replay: trainer``, attached by ``megarl.update.PolicyUpdater``)."""
    microbatch_s: float = 0.0
    """Seconds this rank spent on micro-batch work (forward/backward schedules less their
    pipeline fill and drain), summed over calls: callers read differences. What a phase spends
    beyond it (optimizer steps, collectives after the schedule) is the coordinator's measured
    fixed cost of that phase (`megarl.coordinator.throughput`)."""

    @property
    def core(self) -> torch.nn.Module:
        """The unwrapped GPTModel."""
        m: Any = self.module
        while hasattr(m, "module"):
            m = m.module
        return m  # type: ignore[no-any-return]


def build_gpt(
    mcfg: ModelConfig,
    pcfg: ParallelConfig,
    dims: ParallelDims,
    *,
    value_head: bool = False,
    trainable: bool = True,
    optim: OptimConfig | None = None,
    seed: int = 0,
    track_experts: bool = False,
) -> Model:
    """Build this rank's GPTModel stage on ``dims``' layout; wrap in megatron DDP + optimizer
    when trainable. ``pcfg`` must describe the same TP/PP as ``dims``; ``seed`` seeds weight
    init on a non-global layout (:func:`megarl.distributed.layout_rng`); ``track_experts``:
    a MoE model counts the tokens each expert receives in training (``Model.expert_load``)."""
    from megatron.core.models.gpt import GPTModel

    from megarl.distributed import layout_rng

    if mcfg.vocab_size <= 0:
        raise ValueError("model.vocab_size must be set (from the tokenizer) before building")
    mine = (pcfg.tensor_parallel, pcfg.pipeline_parallel, pcfg.expert_parallel, pcfg.expert_tp)
    if mine != (dims.tp, dims.pp, dims.ep, dims.expert_tp):
        raise ValueError(
            f"parallel config TP×PP×EP×ETP={'×'.join(map(str, mine))} does not match the process groups' "
            f"layout {dims.tp}×{dims.pp}×{dims.ep}×{dims.expert_tp}"
        )
    tcfg = transformer_config(mcfg, pcfg)
    padded = padded_vocab_size(mcfg.vocab_size, pcfg.tensor_parallel)
    with layout_rng(dims, seed):
        gpt = GPTModel(
            config=tcfg,
            transformer_layer_spec=block_spec(mcfg, tcfg, dims.pp_rank),
            vocab_size=padded,
            max_sequence_length=mcfg.max_position_embeddings,
            pre_process=dims.is_first_stage,
            post_process=dims.is_last_stage,
            share_embeddings_and_output_weights=mcfg.tie_embeddings,
            position_embedding_type="rope",
            # megatron hints int, but computes base ** (i/d) in float: int() would change the model
            rotary_base=mcfg.rotary_base,  # type: ignore[arg-type]
            parallel_output=True,
            pg_collection=dims.pgs,
        )
    apply_rope_scaling(gpt, mcfg)
    if value_head:
        from megarl.model.value_head import attach_value_head

        attach_value_head(gpt, tcfg, dims)
    gpt.to(dims.device)
    model = Model(gpt, tcfg, dims, mcfg.vocab_size, padded)
    if track_experts and mcfg.is_moe:
        from megarl.model.expert_load import ExpertLoad

        model.expert_load = ExpertLoad(model)
    if pcfg.expert_tp != pcfg.tensor_parallel:
        _reduce_experts_over_tp(gpt)
    if not trainable:
        gpt.eval()
        for p in gpt.parameters():
            p.requires_grad_(False)
        return model
    _wrap_for_training(model, pcfg, optim or OptimConfig())
    return model


def _reduce_experts_over_tp(gpt: Any) -> None:
    """Expert TP below TP (experts whole on every TP rank, or split over TP / ETP groups of
    ETP ranks): each such group runs its own sequence-parallel slice of tokens through its expert
    shards, so their gradients must be summed over the groups (the TP ranks holding the same
    shard) as well. megatron's DDP does that (over the expert-data-parallel group, TP × DP /
    (ETP × EP) ranks) only for parameters flagged ``allreduce=False``, which megatron's expert
    layers set only at EP > 1: at EP 1 the gradients would be reduced over DP alone and the TP
    ranks' experts would drift apart. Flagging them also gives them megatron's expert optimizer
    (norms over the expert TP × PP group: each expert shard counted once)."""
    for name, p in gpt.named_parameters():
        if ".mlp.experts." in f".{name}":
            p.allreduce = False


def _no_token_scaling_finalize(
    pre_hook: Callable[[list[Any]], None] | None = None, post_hook: Callable[[list[Any]], None] | None = None
) -> Callable:
    """finalize_model_grads that never divides by token counts (see module docstring);
    ``pre_hook`` / ``post_hook`` see the model chunks before / after the DP reduction."""
    from megatron.core.distributed import finalize_model_grads

    def finalize(model: list[Any], num_tokens: Any = None, **kwargs: Any) -> None:
        if pre_hook is not None:
            pre_hook(model)
        finalize_model_grads(model, None, **kwargs)
        if post_hook is not None:
            post_hook(model)

    return finalize


def _wrap_for_training(model: Model, pcfg: ParallelConfig, ocfg: OptimConfig) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=pcfg.use_distributed_optimizer,
        bucket_size=None,
    )
    pgs = model.dims.pgs
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model.module, pg_collection=pgs)
    model.module = ddp

    def pre_reduce(chunks: list[Any]) -> None:
        if model.probe is not None:
            model.probe.before_reduce(chunks[0])

    def post_reduce(chunks: list[Any]) -> None:
        if model.probe is not None:
            model.probe.after_reduce(chunks[0])

    model.config.finalize_model_grads_func = _no_token_scaling_finalize(pre_reduce, post_reduce)
    model.config.grad_scale_func = None
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=ocfg.lr,
        min_lr=ocfg.min_lr,
        weight_decay=ocfg.weight_decay,
        adam_beta1=ocfg.adam_beta1,
        adam_beta2=ocfg.adam_beta2,
        adam_eps=ocfg.adam_eps,
        clip_grad=ocfg.clip_grad,
        bf16=model.config.bf16,
        params_dtype=model.config.params_dtype,
        use_distributed_optimizer=pcfg.use_distributed_optimizer,
    )
    # megatron refuses gloo side groups with an explicit collection; megarl's optimizer-state
    # format (fully_reshardable, checkpoint/optim_state.py) gathers over the DP group itself
    model.optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False, pg_collection=pgs)


def set_lr(model: Model, lr: float) -> None:
    for group in model.optimizer.param_groups:
        group["lr"] = lr
