"""The consistency rules of a run config: :func:`validate` (``megarl.config.validate``).

Every rule fails with :class:`megarl.config.ConfigError` naming the field, its value and the
rule, before any process group starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config.rules import fail, walk
from megarl.config.tracking import check_trackers

if TYPE_CHECKING:
    from megarl.config.model import ModelConfig
    from megarl.config.run import RunConfig


def validate(cfg: RunConfig, world_size: int) -> None:
    """Every rule, section by section, before any process group starts; the first broken one
    raises ConfigError naming the field, the value and the rule."""
    _positive(cfg)
    _finite(cfg)
    _rates_and_sampling(cfg)
    _paths(cfg)
    m = resolved_model(cfg)
    _model(m)
    _parallel(cfg, m, world_size)
    _rollout(cfg, m)
    _algo(cfg)
    _pipeline(cfg)
    _coordinator(cfg)
    _devices(cfg, m)
    _stopping(cfg)
    check_trackers(cfg.train.trackers, cfg.train.tracking)


def _stopping(cfg: RunConfig) -> None:
    """train: a stop past the target needs a target and validations to count."""
    t = cfg.train
    if t.target_window > 1 and not t.target_val_reward:
        fail("train.target_window", t.target_window, "needs train.target_val_reward > 0")
    if t.evals_past_target and not t.target_val_reward:
        fail("train.evals_past_target", t.evals_past_target, "needs train.target_val_reward > 0")
    if t.evals_past_target and not (t.eval_every or t.eval_every_samples):
        fail(
            "train.evals_past_target",
            t.evals_past_target,
            "counts mid-run validations: set train.eval_every or train.eval_every_samples",
        )


def _model(m: ModelConfig) -> None:
    """model: the architecture is one megatron can build and the HF mapping can express."""
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


def _parallel(cfg: RunConfig, m: ModelConfig, world_size: int) -> None:
    """parallel (and the critic's layout): TP/PP split the model; batches split over DP."""
    p = cfg.parallel
    if m.num_attention_heads % p.tensor_parallel:
        fail(
            "parallel.tensor_parallel",
            p.tensor_parallel,
            f"does not divide model.num_attention_heads={m.num_attention_heads}",
        )
    if m.num_query_groups % p.tensor_parallel:
        fail(
            "parallel.tensor_parallel",
            p.tensor_parallel,
            f"does not divide model.num_query_groups={m.num_query_groups}",
        )
    if m.ffn_hidden_size % p.tensor_parallel:
        fail(
            "parallel.tensor_parallel",
            p.tensor_parallel,
            f"does not divide model.ffn_hidden_size={m.ffn_hidden_size}",
        )
    if m.num_layers % p.pipeline_parallel:
        fail("parallel.pipeline_parallel", p.pipeline_parallel, f"does not divide model.num_layers={m.num_layers}")
    if world_size % (p.tensor_parallel * p.pipeline_parallel):
        fail(
            "parallel",
            f"TP×PP={p.tensor_parallel * p.pipeline_parallel}",
            f"does not divide the trainer world size {world_size}",
        )
    dp = world_size // (p.tensor_parallel * p.pipeline_parallel)
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
    _token_budget(cfg, m, dp)
    _probe_parts(cfg, dp)
    _validate_critic_layout(cfg, world_size)


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


def probe_min_batch(cfg: RunConfig, dp: int, critic_dp: int | None = None) -> int:
    """Smallest batch (responses) whose gradient noise the grad probe can measure: at DP = 1 its
    parts are the measured mini-batch's whole-group runs of micro-batches (`probe_part_rows`),
    and one part gives no estimate."""
    if min(dp, critic_dp or dp) > 1:
        return 1  # parts are DP ranks (or their micro-batches): at least two
    return 2 * probe_part_rows(cfg) * cfg.algo.mini_batches


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
    need = probe_min_batch(cfg, dp, _critic_dp(cfg, dp))
    if cfg.batch_size < need:
        size = f"parallel.micro_batch_size={p.micro_batch_size}"
        if part != p.micro_batch_size:  # micro-batches joined into whole groups
            size = f"lcm({size}, rollout.samples_per_prompt={r.samples_per_prompt})"
        fail(
            "rollout.num_prompts×samples_per_prompt",
            cfg.batch_size,
            f"must be >= 2 × {size} × algo.mini_batches={m} = {need} with coordinator.enabled at DP = 1: "
            "the noise estimate's parts are the measured mini-batch's micro-batches (joined into whole "
            "GRPO groups), and one part measures no noise",
        )


def _token_budget(cfg: RunConfig, m: ModelConfig, dp: int) -> None:
    """parallel.max_tokens_per_micro_batch: every row fits, and the grad probe keeps random parts;
    parallel.pack_sequences: packs budget micro-batches, with an attention that takes them."""
    p, r = cfg.parallel, cfg.rollout
    budget = p.max_tokens_per_micro_batch
    if p.pack_sequences and not budget:
        fail(
            "parallel.pack_sequences", True, "packs token-budget micro-batches: set parallel.max_tokens_per_micro_batch"
        )
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


def _rollout(cfg: RunConfig, m: ModelConfig) -> None:
    """rollout: lengths fit the model's context and the engines' KV cache; engine layout."""
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > m.max_position_embeddings:
        fail(
            "rollout.max_prompt_len+max_response_len",
            r.max_prompt_len + r.max_response_len,
            f"exceeds model.max_position_embeddings={m.max_position_embeddings}"
            + (f" (from {m.init_from}/config.json)" if m.init_from else ""),
        )
    if not 0 <= r.min_response_len <= r.max_response_len:
        fail("rollout.min_response_len", r.min_response_len, f"must be in [0, max_response_len={r.max_response_len}]")
    check_kv_cache(cfg, m)  # (each reward is imported and checked by megarl.prelaunch.check_run)
    if r.engine_tp < 1:
        fail("rollout.engine_tp", r.engine_tp, "must be >= 1")
    if r.engine_lease_s and r.engine_lease_s < 15:
        fail("rollout.engine_lease_s", r.engine_lease_s, "must be 0 (off) or >= 15 s (3 heartbeats of 5 s)")
    if m.num_query_groups % r.engine_tp:
        fail("rollout.engine_tp", r.engine_tp, f"does not divide model.num_query_groups={m.num_query_groups}")


def _pipeline(cfg: RunConfig) -> None:
    """rollout.max_staleness: a lagging batch needs the behaviour policy in the loss, and a
    generation that runs alone (one round, engines awake while the trainer works)."""
    r, a = cfg.rollout, cfg.algo
    if r.max_staleness not in (0, 1, 2):
        fail("rollout.max_staleness", r.max_staleness, "must be 0 (generate, then train), 1 or 2")
    if r.max_staleness == 0:
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


def _algo(cfg: RunConfig) -> None:
    """algo: known estimators and aggregation modes, clip ranges, overlong shaping."""
    r = cfg.rollout
    if cfg.algo.clip_low >= 1 or cfg.algo.clip_low < 0:
        fail("algo.clip_low", cfg.algo.clip_low, "must be in [0, 1)")
    if cfg.algo.name == "ppo" and cfg.algo.advantage != "gae":
        fail("algo.advantage", cfg.algo.advantage, "must be 'gae' when algo.name='ppo' (critic)")
    if cfg.algo.name == "grpo" and cfg.algo.advantage == "gae":
        fail("algo.advantage", "gae", "needs a critic: set algo.name='ppo'")
    from megarl.algo import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES

    if cfg.algo.advantage not in ADVANTAGE_ESTIMATORS:
        fail("algo.advantage", cfg.algo.advantage, f"must be one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if cfg.algo.loss_agg not in LOSS_AGG_MODES:
        fail("algo.loss_agg", cfg.algo.loss_agg, f"must be one of {list(LOSS_AGG_MODES)}")
    if cfg.algo.overlong_buffer_len >= r.max_response_len:
        fail(
            "algo.overlong_buffer_len",
            cfg.algo.overlong_buffer_len,
            f"must be < rollout.max_response_len={r.max_response_len}",
        )
    if cfg.algo.dual_clip and cfg.algo.dual_clip <= 1:
        fail("algo.dual_clip", cfg.algo.dual_clip, "must be > 1 (or 0 = off)")


def _coordinator(cfg: RunConfig) -> None:
    """coordinator: what it needs from the optimizer and the starting batch."""
    r = cfg.rollout
    c = cfg.coordinator
    if c.enabled and cfg.optim.clip_grad <= 0:
        fail(
            "optim.clip_grad",
            cfg.optim.clip_grad,
            "must be > 0 with coordinator.enabled (its grad norm is reused)",
        )
    if c.noise_kind not in ("plain", "adam"):
        fail("coordinator.noise_kind", c.noise_kind, "must be 'plain' (raw gradients) or 'adam' (Adam-preconditioned)")
    if c.enabled and c.noise_kind == "adam" and cfg.parallel.use_distributed_optimizer:
        fail(
            "parallel.use_distributed_optimizer",
            True,
            "must be false with coordinator.noise_kind='adam': the distributed optimizer keeps one DP "
            "rank's shard of Adam's second moments, and the probe weighs whole local gradients",
        )
    if c.lr_reference_batch < 0:
        fail(
            "coordinator.lr_reference_batch", c.lr_reference_batch, "must be >= 0 responses (0 = the configured batch)"
        )
    if c.enabled and not c.min_prompts <= r.num_prompts <= c.max_prompts:
        fail(
            "rollout.num_prompts",
            r.num_prompts,
            f"must lie in [coordinator.min_prompts={c.min_prompts}, coordinator.max_prompts={c.max_prompts}]",
        )


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


def _validate_critic_layout(cfg: RunConfig, world_size: int) -> None:
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


def _positive(cfg: RunConfig) -> None:
    zero_means_actor = ("critic.parallel.tensor_parallel", "critic.parallel.pipeline_parallel")
    for path, value in walk(cfg):
        if path in zero_means_actor and value == 0:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            nonneg = (
                "vocab_size",
                "steps",
                "warmup_steps",
                "eval_every",
                "eval_every_samples",
                "max_samples",
                "evals_past_target",
                "overlong_buffer_len",
                "save_every",
                "min_response_len",
                "logprob_micro_batch_size",
                "max_tokens_per_micro_batch",
                "max_tasks_per_worker",
                "worker_memory_mb",
                "kv_channels",
                "lr_reference_batch",
                "max_staleness",
                "engine_threads",
                "engine_logprobs_every",
                "stop_after_failed_steps",
            )
            if value < 0 or (value == 0 and not path.endswith(nonneg)):
                fail(path, value, "must be a positive integer")


def _finite(cfg: RunConfig) -> None:
    """No NaN or infinity in any float setting (a NaN reward or KL weight surfaces steps later as
    NaN weights, blamed on the weight sync)."""
    for path, value in walk(cfg):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            fail(path, value, "must be a finite number")


def _rates_and_sampling(cfg: RunConfig) -> None:
    """Float settings with a sign or range rule, and sampling that cannot feed the estimator."""
    o, r, a = cfg.optim, cfg.rollout, cfg.algo
    for name in ("clip_high", "kl_coef", "entropy_coef", "kl_target", "kl_horizon"):
        if getattr(a, name) < 0:
            fail(f"algo.{name}", getattr(a, name), "must be >= 0")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(a, name) <= 1:
            fail(f"algo.{name}", getattr(a, name), "must be in [0, 1]")
    if cfg.critic.value_clip < 0:
        fail("critic.value_clip", cfg.critic.value_clip, "must be >= 0 (0: no clipping)")
    for name, value in (("optim.lr", o.lr), ("critic.lr", cfg.critic.lr), ("warm_start.lr", cfg.warm_start.lr)):
        if not value > 0:
            fail(name, value, "must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        fail("optim.min_lr", o.min_lr, f"must be in [0, optim.lr={o.lr}]")
    if not 0 < o.adam_eps or not 0 <= o.adam_beta1 < 1 or not 0 <= o.adam_beta2 < 1:
        fail(
            "optim.adam_beta1/adam_beta2/adam_eps", (o.adam_beta1, o.adam_beta2, o.adam_eps), "need β in [0, 1), ε > 0"
        )
    if o.clip_grad < 0 or o.weight_decay < 0:
        fail("optim.clip_grad/weight_decay", (o.clip_grad, o.weight_decay), "must be >= 0")
    if r.temperature < 0:
        fail("rollout.temperature", r.temperature, "must be >= 0")
    if r.temperature == 0 and r.samples_per_prompt > 1:
        fail(
            "rollout.temperature",
            0.0,
            f"is greedy decoding: the rollout.samples_per_prompt={r.samples_per_prompt} samples of a prompt "
            "would be identical (use a temperature > 0, or samples_per_prompt=1 with a non-group estimator)",
        )
    if not 0 < r.top_p <= 1:
        fail("rollout.top_p", r.top_p, "must be in (0, 1]")
    group_estimators = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")
    if a.advantage in group_estimators and r.samples_per_prompt < 2:
        fail(
            "rollout.samples_per_prompt",
            r.samples_per_prompt,
            f"must be >= 2 with algo.advantage='{a.advantage}' (a group of one has no baseline: "
            "every advantage, and so the loss, would be exactly 0)",
        )
    if not r.kv_cache_gb > 0:
        fail("rollout.kv_cache_gb", r.kv_cache_gb, "must be > 0 (KV cache per engine, GiB)")
    for name, value in (
        ("rollout.engine_start_timeout_s", r.engine_start_timeout_s),
        ("rollout.request_timeout_s", r.request_timeout_s),
    ):
        if not value > 0:
            fail(name, value, "must be > 0")


def _paths(cfg: RunConfig) -> None:
    """Files and folders the run reads or writes, before any process starts."""
    run_dir = Path(cfg.train.run_dir)
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            fail("train.run_dir", cfg.train.run_dir, f"cannot be created: {parent} is a file")
    src = cfg.model.init_from
    if src:
        folder = Path(src)
        if not folder.is_dir():
            fail("model.init_from", src, "does not exist (expected an HF model folder)")
        if not (folder / "config.json").is_file():
            fail("model.init_from", src, "has no config.json: not an HF model folder")
        if not list(folder.glob("*.safetensors")):
            fail("model.init_from", src, "has no *.safetensors weights")


def resolved_model(cfg: RunConfig) -> ModelConfig:
    """The model the run will build: ``model`` itself, or its shape from ``model.init_from``."""
    m = cfg.model
    if not m.init_from:
        return m
    from megarl.config.hf import model_config_from_hf

    cfg_file = Path(m.init_from) / "config.json"
    try:
        hf_cfg = json.loads(cfg_file.read_text())
        return model_config_from_hf(hf_cfg, m)
    except json.JSONDecodeError as e:
        fail("model.init_from", m.init_from, f"{cfg_file} is not valid JSON ({e.msg}, line {e.lineno})")
    except (KeyError, ValueError) as e:  # AdapterError, UnsupportedHFModel: the key and value named
        reason = e.args[0] if len(e.args) == 1 else e
        if type(e) is KeyError:  # a key the model's shape needs is absent
            reason = f"missing key {reason!r}"
        fail("model.init_from", m.init_from, f"{cfg_file}: {reason}")


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
