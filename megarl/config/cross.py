"""The rules that span sections, and :func:`validate` (``megarl.config.validate``), which runs
every rule of a run config in order. Across sections: the model against the layouts, the batch
against the DP ranks and the noise probe, the rollout against the model's context and the
engines' KV cache, the algorithm against the rollout, the coordinator against the optimizer,
and what this machine can run (:func:`check`, in this order). Each section's rules about its
own fields sit beside them, in its ``validate()``.

The order of :func:`validate` is the order errors are reported in (of two problems, the first is named): every
field's generic rules (ints positive, floats finite: :mod:`megarl.config.rules`), then the sections' and these.

The probe's part size (:func:`probe_part_rows`, :func:`probe_min_batch`) is defined here, not
by its owner ``megarl.planning``: the config's check needs it at load time, and the config is
the layer every other one imports (``megarl.planning`` and ``megarl.update`` import it from here).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megarl.config.hf import resolved_model
from megarl.config.rules import fail, finite_floats, positive_ints

if TYPE_CHECKING:
    from megarl.config.model import ModelConfig
    from megarl.config.run import RunConfig


def validate(cfg: RunConfig, world_size: int) -> None:
    """Every rule, before any process group starts; the first broken one raises ConfigError
    naming the field, the value and the rule. (data, reward and weight_sync have no rules of
    their own here: rewards are imported and checked by ``megarl.prelaunch``, transports against
    what this machine runs by ``cross``.)

    The order keeps the one it had as one list of rules as closely as a ``validate()`` per section
    allows: first the sections whose rules came first, then those the cross rules rely on (KV cache
    size, model shape, algorithm), the cross rules, last coordinator and train (nothing relies on)."""
    positive_ints(cfg)
    finite_floats(cfg)
    for section in (cfg.critic, cfg.optim, cfg.warm_start, cfg.rollout):
        section.validate()
    m = resolved_model(cfg.model)  # (init_from checked first: a folder with config.json and weights)
    m.validate()
    cfg.parallel.validate()
    cfg.algo.validate()
    cfg.env.validate()
    check(cfg, m, world_size)
    cfg.coordinator.validate()
    cfg.train.validate()


def check(cfg: RunConfig, m: ModelConfig, world_size: int) -> None:
    """Every cross-section rule, ``m`` the model the run builds (``model.init_from``'s, when set)."""
    _group_estimator(cfg)
    _parallel(cfg, m, world_size)
    _rollout_vs_model(cfg, m)
    if cfg.algo.overlong_buffer_len >= cfg.rollout.max_response_len:
        fail(
            "algo.overlong_buffer_len",
            cfg.algo.overlong_buffer_len,
            f"must be < rollout.max_response_len={cfg.rollout.max_response_len}",
        )
    _pipeline(cfg)
    _coordinator(cfg)
    _devices(cfg, m)
    cfg.algo.check_model(m, bool(cfg.env.fn or cfg.env.agent), cfg.parallel.sequence_parallel)  # routing replay
    cfg.env.check_single_turn(cfg.rollout.sampling_seed, cfg.train.val_metric)


def _group_estimator(cfg: RunConfig) -> None:
    """A group-baseline estimator needs a group of at least two samples."""
    a, r = cfg.algo, cfg.rollout
    group_estimators = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")
    if a.advantage in group_estimators and r.samples_per_prompt < 2:
        fail(
            "rollout.samples_per_prompt",
            r.samples_per_prompt,
            f"must be >= 2 with algo.advantage='{a.advantage}' (a group of one has no baseline: "
            "every advantage, and so the loss, would be exactly 0)",
        )


def _parallel(cfg: RunConfig, m: ModelConfig, world_size: int) -> None:
    """parallel (and the critic's layout): TP/PP split the model; batches split over DP."""
    p = cfg.parallel
    for name, size in (
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
    ):
        if size % p.tensor_parallel:
            fail("parallel.tensor_parallel", p.tensor_parallel, f"does not divide {name}={size}")
    if m.num_layers % p.pipeline_parallel:
        fail("parallel.pipeline_parallel", p.pipeline_parallel, f"does not divide model.num_layers={m.num_layers}")
    if world_size % (p.tensor_parallel * p.pipeline_parallel):
        fail(
            "parallel",
            f"TP×PP={p.tensor_parallel * p.pipeline_parallel}",
            f"does not divide the trainer world size {world_size}",
        )
    dp = world_size // (p.tensor_parallel * p.pipeline_parallel)
    p.check_experts(m, dp)
    _batches_split(cfg, dp)
    _token_budget(cfg, m, dp)
    _probe_parts(cfg, dp)
    _critic_layout(cfg, world_size)


def _batches_split(cfg: RunConfig, dp: int) -> None:
    """The RL batch, the forward-only micro-batches and the warm start's batch split over DP."""
    p = cfg.parallel
    if cfg.batch_size % (dp * p.micro_batch_size * cfg.algo.mini_batches):
        fail(
            "rollout.num_prompts×samples_per_prompt",
            cfg.batch_size,
            f"must be divisible by DP={dp} × parallel.micro_batch_size="
            f"{p.micro_batch_size} × algo.mini_batches={cfg.algo.mini_batches}",
        )
    if p.logprob_micro_batch_size and cfg.batch_size % (dp * p.logprob_micro_batch_size):
        fail(
            "parallel.logprob_micro_batch_size",
            p.logprob_micro_batch_size,
            f"× DP={dp} must divide rollout.num_prompts×samples_per_prompt={cfg.batch_size}",
        )
    if cfg.warm_start.steps and cfg.warm_start.batch_size % (dp * p.micro_batch_size):
        fail(
            "warm_start.batch_size",
            cfg.warm_start.batch_size,
            f"must be divisible by DP={dp} × parallel.micro_batch_size={p.micro_batch_size}",
        )


def _critic_dp(cfg: RunConfig, dp: int) -> int:
    """The critic's DP size (its own layout, else the actor's; the actor's ``dp`` without a critic)."""
    p = cfg.parallel
    return cfg.critic_layout(dp * p.tensor_parallel * p.pipeline_parallel)[2] if cfg.algo.name == "ppo" else dp


def probe_part_rows(cfg: RunConfig) -> int:
    """Rows of the grad probe's smallest part: whole micro-batches holding whole GRPO groups,
    lcm(micro_batch_size, samples_per_prompt). A group's responses share their prompt and, under
    a group-centred advantage, are negatively correlated; a part that splits a group is not
    independent of the others, which the two-batch estimate assumes (it biases B_noise high)."""
    return math.lcm(cfg.parallel.micro_batch_size, cfg.rollout.samples_per_prompt)


def probe_min_batch(part_rows: int, mini_batches: int, dp: int, critic_dp: int | None = None, ep: int = 1) -> int:
    """Smallest batch (responses) whose gradient noise the grad probe can measure: at DP = 1 its
    parts are the measured mini-batch's whole-group runs of micro-batches (``part_rows``:
    `probe_part_rows`, ``mini_batches``: algo.mini_batches), and one part gives no estimate.
    At expert parallelism ``ep`` the experts' parts are unions over each EP group: with one EP
    group (DP = EP) each rank needs two runs."""
    if min(dp, critic_dp or dp) // ep > 1:
        return 1  # parts are DP ranks or EP groups (or their micro-batches): at least two
    return 2 * part_rows * mini_batches * ep


def _probe_parts(cfg: RunConfig, dp: int) -> None:
    """coordinator.enabled: every DP rank's share of the measured mini-batch is whole probe parts
    (whole groups in whole micro-batches), and at DP = 1 the starting batch gives it two."""
    if not cfg.coordinator.enabled:
        return
    p, r, m = cfg.parallel, cfg.rollout, cfg.algo.mini_batches
    part, ranks = probe_part_rows(cfg), math.lcm(dp, _critic_dp(cfg, dp))
    if cfg.batch_size % (ranks * part * m):
        fail(
            "rollout.num_prompts×samples_per_prompt",
            cfg.batch_size,
            f"must be divisible by DP={ranks} × lcm(parallel.micro_batch_size={p.micro_batch_size}, "
            f"rollout.samples_per_prompt={r.samples_per_prompt}) × algo.mini_batches={m} = {ranks * part * m} "
            "with coordinator.enabled: the noise probe's parts must hold whole GRPO groups (a split "
            "group's responses are negatively correlated, which biases B_noise high)",
        )
    ep = p.expert_parallel
    if ep > 1 and dp // ep < 2 and (p.pipeline_parallel > 1 or not cfg.coordinator.microbatch_parts):
        fail(
            "parallel.expert_parallel",
            ep,
            f"must be at most DP/2={dp // 2} with coordinator.enabled and DP ranks as the noise probe's parts "
            "(parallel.pipeline_parallel > 1 or coordinator.microbatch_parts=false): the experts' parts are "
            "then the EP groups, and one part measures no noise",
        )
    need = probe_min_batch(part, m, dp, _critic_dp(cfg, dp), ep)
    if cfg.batch_size < need:
        size = f"parallel.micro_batch_size={p.micro_batch_size}"
        if part != p.micro_batch_size:  # micro-batches joined into whole groups
            size = f"lcm({size}, rollout.samples_per_prompt={r.samples_per_prompt})"
        where, times = ("at DP = 1", "") if ep == 1 else (f"at DP = EP = {ep}", f" × EP={ep}")
        experts = "" if ep == 1 else "; the experts' parts are their unions over the EP group"
        fail(
            "rollout.num_prompts×samples_per_prompt",
            cfg.batch_size,
            f"must be >= 2 × {size} × algo.mini_batches={m}{times} = {need} with coordinator.enabled {where}: "
            "the noise estimate's parts are the measured mini-batch's micro-batches (joined into whole "
            f"GRPO groups{experts}), and one part measures no noise",
        )


def _token_budget(cfg: RunConfig, m: ModelConfig, dp: int) -> None:
    """parallel.max_tokens_per_micro_batch: every row fits, and the grad probe keeps random parts;
    parallel.pack_sequences: with an attention that takes packed rows."""
    p, r = cfg.parallel, cfg.rollout
    budget = p.max_tokens_per_micro_batch  # (pack_sequences without one: ParallelConfig.validate)
    if p.pack_sequences and m.transformer_impl == "local" and m.attention != "sdpa":
        fail(
            "parallel.pack_sequences",
            True,
            f"needs model.attention=sdpa with the local spec (got {m.attention!r}: megatron's unfused "
            "attention refuses packed sequences)",
        )
    if not budget:
        return
    longest = r.max_prompt_len + r.max_response_len
    if budget < longest:
        fail(
            "parallel.max_tokens_per_micro_batch",
            budget,
            f"must be 0 (off) or >= rollout.max_prompt_len + max_response_len = {longest} (one whole row)",
        )
    if cfg.coordinator.enabled and min(dp, _critic_dp(cfg, dp)) == 1:
        fail(
            "parallel.max_tokens_per_micro_batch",
            budget,
            "needs DP > 1 (actor and critic) with coordinator.enabled: at DP = 1 the noise estimate's "
            "small batches are micro-batches, which the token budget groups by length (not random "
            "samples of the batch, so tr(Σ) would be biased); use 0 or more DP ranks",
        )


def _rollout_vs_model(cfg: RunConfig, m: ModelConfig) -> None:
    """rollout: lengths fit the model's context and the engines' KV cache; engine TP splits the KV heads."""
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > m.max_position_embeddings:
        fail(
            "rollout.max_prompt_len+max_response_len",
            r.max_prompt_len + r.max_response_len,
            f"exceeds model.max_position_embeddings={m.max_position_embeddings}"
            + (f" (from {m.init_from}/config.json)" if m.init_from else ""),
        )
    if cfg.env.fn and r.max_prompt_len + cfg.env.budget(r.max_response_len) > m.max_position_embeddings:
        fail(
            "env.max_tokens",
            cfg.env.max_tokens,
            f"= {cfg.env.budget(r.max_response_len)} ids after a prompt of up to rollout.max_prompt_len="
            f"{r.max_prompt_len} exceeds model.max_position_embeddings={m.max_position_embeddings} "
            "(0 = env.max_turns × rollout.max_response_len)",
        )
    check_kv_cache(cfg, m)  # (each reward is imported and checked by megarl.prelaunch.check_run)
    if m.num_query_groups % r.engine_tp:
        fail("rollout.engine_tp", r.engine_tp, f"does not divide model.num_query_groups={m.num_query_groups}")


def _pipeline(cfg: RunConfig) -> None:
    """rollout.max_staleness: a lagging batch needs the behaviour policy in the loss, and a
    generation that runs alone (one round, engines awake while the trainer works)."""
    r, a = cfg.rollout, cfg.algo
    if r.max_staleness == 0:  # (0, 1 or 2: RolloutConfig.validate)
        return
    if a.tis_cap <= 0:
        fail(
            "algo.tis_cap",
            a.tis_cap,
            f"must be > 0 with rollout.max_staleness={r.max_staleness}: the samples come from an older policy "
            "and decoupled PPO weights each token by min(π_prox/π_behaviour, tis_cap) (e.g. algo.tis_cap=2)",
        )
    if a.dynamic_sampling:
        fail(
            "algo.dynamic_sampling",
            True,
            f"is not supported with rollout.max_staleness={r.max_staleness} (refill rounds would run while "
            "the trainer updates; use max_staleness=0)",
        )
    if r.colocate:
        fail(
            "rollout.colocate",
            True,
            f"cannot overlap generation with the update (rollout.max_staleness={r.max_staleness}): "
            "colocated engines sleep while the trainer holds the GPUs",
        )


def _coordinator(cfg: RunConfig) -> None:
    """coordinator: what it needs from the optimizer, its layout and the starting batch."""
    r, c = cfg.rollout, cfg.coordinator
    if c.enabled and cfg.optim.clip_grad <= 0:
        fail("optim.clip_grad", cfg.optim.clip_grad, "must be > 0 with coordinator.enabled (its grad norm is reused)")
    c.check_sequence_parallel(cfg.parallel.sequence_parallel)
    if c.enabled and c.noise_kind == "adam" and cfg.parallel.use_distributed_optimizer:
        fail(
            "parallel.use_distributed_optimizer",
            True,
            "must be false with coordinator.noise_kind='adam': the distributed optimizer keeps one DP "
            "rank's shard of Adam's second moments, and the probe weighs whole local gradients",
        )
    if c.enabled and not c.min_prompts <= r.num_prompts <= c.max_prompts:
        fail(
            "rollout.num_prompts",
            r.num_prompts,
            f"must lie in [coordinator.min_prompts={c.min_prompts}, coordinator.max_prompts={c.max_prompts}]",
        )
    if c.enabled and c.choose == "prompts_and_samples":
        c.check_samples_layout(r, cfg.parallel)


CPU_ENGINE_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention runs (``CPUAttentionBackend.get_supported_head_sizes`` of the
pinned vLLM; ``tests/config`` checks they agree)."""


def _devices(cfg: RunConfig, m: ModelConfig) -> None:
    """GPU-only choices (NCCL / CUDA IPC transports, colocation, bf16, Transformer Engine), and
    what the local CPU engines can run."""
    r = cfg.rollout
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not r.engine_addresses and m.head_dim not in CPU_ENGINE_HEAD_DIMS:
        fail(
            "model.init_from" if cfg.model.init_from else "model.kv_channels",
            cfg.model.init_from or m.kv_channels,
            f"gives head_dim={m.head_dim} (hidden_size / num_attention_heads or kv_channels), which vLLM's CPU "
            f"attention cannot run (supported: {', '.join(map(str, CPU_ENGINE_HEAD_DIMS))})",
        )
    if not cuda and not r.engine_addresses and m.is_moe and m.hidden_size % 32:
        fail(
            "model.hidden_size",
            m.hidden_size,
            "is not a multiple of 32, which vLLM's CPU fused-MoE kernel needs for a mixture-of-experts model",
        )
    if cfg.weight_sync.transport in ("nccl", "cuda_ipc") and not cuda:
        fail("weight_sync.transport", cfg.weight_sync.transport, "needs CUDA; use 'auto', 'shm' or 'http' on CPU")
    if r.colocate and not cuda:
        fail("rollout.colocate", r.colocate, "needs CUDA (vLLM sleep mode); use colocate=false on CPU")
    if r.colocate and cfg.weight_sync.transport == "nccl":
        fail(
            "weight_sync.transport",
            "nccl",
            "cannot reach colocated engines (NCCL refuses two ranks on one GPU); use 'cuda_ipc' or 'auto'",
        )
    if m.dtype == "bf16" or m.transformer_impl == "transformer_engine":
        if not cuda:
            fail(
                "model.dtype/transformer_impl",
                f"{m.dtype}/{m.transformer_impl}",
                "needs CUDA; use dtype=fp32 and transformer_impl=local on CPU",
            )


def _critic_layout(cfg: RunConfig, world_size: int) -> None:
    """The critic's own layout (``critic.parallel``) must split the model and the batch."""
    c, m = cfg.critic.parallel, cfg.model
    if not (c.tensor_parallel or c.pipeline_parallel):
        return
    if cfg.algo.name != "ppo":
        fail("critic.parallel", f"TP={c.tensor_parallel}, PP={c.pipeline_parallel}", "needs algo.name='ppo' (critic)")
    tp, pp, dp = cfg.critic_layout(world_size)
    field_tp, field_pp = "critic.parallel.tensor_parallel", "critic.parallel.pipeline_parallel"
    for name, size in (
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
    ):
        if size % tp:
            fail(field_tp, tp, f"does not divide {name}={size}")
    if m.num_layers % pp:
        fail(field_pp, pp, f"does not divide model.num_layers={m.num_layers}")
    cfg.parallel.check_sequence_parallel(m, tp, field_tp)
    cfg.parallel.check_critic_expert_tp(m)
    if world_size % (tp * pp):
        fail("critic.parallel", f"TP×PP={tp}×{pp}", f"does not divide the trainer world size {world_size}")
    p, mb = cfg.parallel, cfg.algo.mini_batches
    if cfg.batch_size % (dp * p.micro_batch_size * mb):
        fail(
            "rollout.num_prompts×samples_per_prompt",
            cfg.batch_size,
            f"must be divisible by the critic's DP={dp} × parallel.micro_batch_size={p.micro_batch_size} × "
            f"algo.mini_batches={mb}",
        )
    if cfg.coordinator.enabled and dp == 1 and pp > 1:
        fail(field_pp, pp, "with coordinator.enabled needs the critic's DP > 1 or PP = 1 (noise estimate)")


def check_kv_cache(cfg: RunConfig, m: ModelConfig) -> None:
    """Each engine's KV cache must hold one whole sequence of the model's context, which vLLM
    requires at start; measured in its blocks (128 tokens on CPU, 16 on GPU)."""
    import torch

    r = cfg.rollout
    block = 16 if torch.cuda.is_available() else 128
    per_token = 2 * m.num_layers * max(1, m.num_query_groups // r.engine_tp) * m.head_dim * 4  # K and V, fp32
    need_tokens = -(-m.max_position_embeddings // block) * block
    have_tokens = int(r.kv_cache_gb * (1 << 30)) // per_token // block * block
    if have_tokens < need_tokens:
        fail(
            "rollout.kv_cache_gb",
            r.kv_cache_gb,
            f"holds {have_tokens} KV tokens per engine; one sequence of model.max_position_embeddings="
            f"{m.max_position_embeddings} needs {need_tokens} ({need_tokens * per_token / (1 << 30):.4g} GiB)",
        )
