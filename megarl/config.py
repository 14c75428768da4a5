"""Typed run configuration: one small kw_only dataclass per component.

``load_config(path, overrides)`` reads YAML, applies ``--set a.b=c`` overrides, rejects
unknown keys and wrong types (naming the dotted field), and :meth:`RunConfig.validate`
checks cross-field rules before any process group starts. Every error is a
:class:`ConfigError` that names the field, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megarl.errors import ConfigError

__all__ = ["ConfigError", "RunConfig", "load_config"]


@dataclass(kw_only=True)
class ModelConfig:
    arch: Literal["llama", "qwen2"] = "llama"
    """HF architecture family used for export and the vLLM engines."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width (channels)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """KV heads (GQA groups); equal to num_attention_heads for MHA."""
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
        return self.hidden_size // self.num_attention_heads


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
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron distributed optimizer)."""


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final LR of the cosine schedule."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up, optimizer steps."""
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


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin:arithmetic"
    """'builtin:arithmetic', a .jsonl/.parquet file or an HF datasets save_to_disk folder
    (or several, comma-separated)."""
    prompt_key: str = "prompt"
    """Field holding the prompt text in file rows."""
    messages_key: str = "messages"
    """Field holding OpenAI-style chat turns ([{role, content}]); used instead of the prompt."""
    chat_template: str = "auto"
    """'auto' (the HF tokenizer's own template: applied to chat rows and to plain prompts as one
    user turn), 'none' (plain prompts as raw text), or a Jinja template file."""
    system_prompt: str = ""
    """System turn put first in every templated prompt that has none ('' = none)."""
    answer_key: str = "answer"
    """Field holding the reference answer in file rows."""
    num_train: int = 20000
    """Built-in task: training prompts generated."""
    num_val: int = 128
    """Validation prompts (built-in: generated; files: the last rows)."""
    max_operand: int = 50
    """Built-in arithmetic task: operands are drawn from [0, max_operand)."""
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    """What to do with a prompt longer than rollout.max_prompt_len (always counted)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded, resumable)."""
    seed: int = 1234
    """Seed of the built-in task's data (and so of its tokenizer); separate from train.seed."""
    reward: str = ""
    """Deprecated alias of ``reward.fn`` (one built-in name); use the ``reward`` section."""


@dataclass(kw_only=True)
class RewardConfig:
    fn: list[str] = field(default_factory=list)
    """Reward functions: built-in names (arithmetic, exact_match, answer_prefix, math),
    'package.module:function' or 'path/to/file.py:function' (megarl/rollout/reward_runner.py
    documents the signature). Empty = 'arithmetic' for built-in data, else 'exact_match'."""
    weights: list[float] = field(default_factory=list)
    """Weight of each reward in ``fn``; a sample's reward is the weighted sum. Empty = all 1."""
    timeout_s: float = 10.0
    """Per-call limit of a reward in the worker pool, seconds; past it the worker is killed."""
    workers: int = 2
    """Reward worker processes on rank 0 (started only for rewards that run isolated)."""
    max_tasks_per_worker: int = 1000
    """Calls a worker serves before it is replaced (bounds slow memory leaks; 0 = never)."""
    worker_memory_mb: int = 0
    """Address-space limit of each worker, MiB (a reward over it fails with MemoryError; 0 = none)."""
    failed_reward: float = 0.0
    """Reward of a sample whose reward call raised, timed out or crashed its worker."""
    isolate_builtins: bool = False
    """Run the built-in rewards in the worker pool too (default: in-process, they are trusted)."""


@dataclass(kw_only=True)
class RolloutConfig:
    num_prompts: int = 16
    """Prompts per RL step."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group size)."""
    max_prompt_len: int = 24
    """Prompt limit, tokens."""
    max_response_len: int = 12
    """Response limit, tokens."""
    min_response_len: int = 0
    """EOS is suppressed until a response has this many tokens (vLLM min_tokens; 0 = off)."""
    seeded: bool = True
    """Per-prompt sampling seeds: samples are reproducible (exact resume, same samples on any
    engine). False = the engines' own RNG: faster with many short responses (vLLM draws
    seeded requests one by one), but a resumed run samples differently."""
    temperature: float = 1.0
    """Sampling temperature (logprobs on both sides use logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    num_engines: int = 1
    """vLLM engines started by megarl (ignored when engine_addresses is set)."""
    engine_tp: int = 1
    """Tensor-parallel size of each engine."""
    engine_addresses: list[str] = field(default_factory=list)
    """host:port of engines started elsewhere (e.g. by srun); empty = start locally."""
    kv_cache_gb: float = 0.25
    """KV cache per engine on CPU, GiB."""
    engine_start_timeout_s: float = 300.0
    """Give up on an engine that is not healthy after this long, seconds."""
    request_timeout_s: float = 600.0
    """HTTP timeout for one engine request, seconds."""
    engine_lease_s: float = 120.0
    """Engines megarl starts exit after this long without a request or heartbeat (sent every
    5 s) from the trainer, seconds; they also exit as soon as the trainer process is gone.
    0 = no lease. Engines started by SLURM take MEGARL_ENGINE_LEASE_S instead."""
    dump_rollouts: bool = False
    """Rank 0 appends every step's prompt ids, response ids and texts to run_dir/rollouts.jsonl."""
    colocate: bool = False
    """Engines share the trainer's GPUs: vLLM sleep mode frees their memory while the trainer
    works (sleep after generation, wake weights before a sync, KV cache after it). CUDA only."""


@dataclass(kw_only=True)
class AlgoConfig:
    name: Literal["grpo", "ppo"] = "grpo"
    """RL algorithm family."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | drgrpo | rloo | reinforce_pp | reinforce_pp_baseline | gae."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (DAPO clip-higher when > clip_low)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 (0 = off)."""
    kl_coef: float = 0.01
    """KL penalty weight (0 = no reference model forward)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    ppo_epochs: int = 1
    """Passes over one rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap on exp(old - engine) (0 = off)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """KL as a loss term (GRPO style) or as a per-token reward penalty β·KL_t (PPO/RLHF style;
    outcome estimators then read the sequence reward r − β·Σ_t KL_t, as verl)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """Fixed kl_coef, or adaptive toward kl_target (Ziegler et al. 2019)."""
    kl_target: float = 0.1
    """Adaptive controller target KL per token, nats."""
    kl_horizon: float = 10000.0
    """Adaptive controller horizon, samples."""
    gamma: float = 1.0
    """Discount for GAE / REINFORCE++ returns."""
    lam: float = 0.95
    """GAE λ."""
    whiten_advantages: bool = True
    """Whiten token advantages over the batch (GAE, REINFORCE++)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill to the planned batch."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: generation rounds before giving up on a full batch."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong penalty: buffer before max_response_len, tokens (0 = off)."""
    overlong_filter: bool = False
    """Mask truncated responses out of the loss (DAPO overlong filtering)."""


@dataclass(kw_only=True)
class CriticParallelConfig:
    tensor_parallel: int = 0
    """Critic tensor-parallel size (0 = parallel.tensor_parallel, the actor's)."""
    pipeline_parallel: int = 0
    """Critic pipeline stages (0 = parallel.pipeline_parallel). The critic's data-parallel size
    follows: trainer world size / (critic TP × PP)."""


@dataclass(kw_only=True)
class CriticConfig:
    parallel: CriticParallelConfig = field(default_factory=CriticParallelConfig)
    """The critic's own layout over the trainer ranks (unset = the actor's)."""
    lr: float = 1e-4
    """Critic peak learning rate (own optimizer)."""
    warmup_steps: int = 0
    """Critic-only RL steps before the actor starts updating."""
    value_clip: float = 0.2
    """Clip of new values around old values (0 = off)."""
    init_from_actor: bool = True
    """Initialise the critic trunk from the (warm-started) actor; the value head starts at 0."""


@dataclass(kw_only=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the task's reference answers before RL (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate."""
    batch_size: int = 64
    """SFT sequences per step."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["auto", "shm", "http", "nccl", "cuda_ipc"] = "auto"
    """How buckets reach the engines: shm (files in this host's /dev/shm), http (bytes in a
    request body; engines on any host), nccl (GPU broadcast), cuda_ipc (GPU memory shared with
    colocated engines); auto = shm if every engine is on this host, else http."""
    bucket_mb: float = 64.0
    """Target bucket size, MiB."""
    probe: bool = True
    """After each sync, compare engine vs trainer logprobs on a fixed sequence."""
    probe_tol: float = 1e-3
    """Max |Δ logprob| allowed by the probe (fp32)."""


@dataclass(kw_only=True)
class CoordinatorConfig:
    """The critical-batch-size coordinator's settings (docs/COORDINATOR.md). What the run itself
    fixes (group size, starting batch, DP size, reference LRs) the planner derives and passes
    beside these (``megarl.coordinator.config.CoordinatorRun``)."""

    enabled: bool = False
    """Measure gradient noise per model and plan batch + LR (see docs/COORDINATOR.md)."""
    adapt: bool = True
    """Change batch and LR from the estimates (False = measure and log only)."""
    min_prompts: int = 8
    """Smallest prompts per step the coordinator may choose."""
    max_prompts: int = 256
    """Largest prompts per step (memory / KV cache / dataset bound)."""
    grid_factor: float = 1.4142135623730951
    """Ratio between neighbouring candidate prompt counts (> 1)."""
    min_gain: float = 0.05
    """Switch only if predicted goodput improves by more than this fraction (hysteresis)."""
    warmup_steps: int = 10
    """Observed steps before the first batch change, steps."""
    cooldown_steps: int = 5
    """Steps after a change before the next one, steps."""
    ema_beta: float = 0.9
    """EMA decay per step of |G|², tr(Σ), per-rank throughput and timings."""
    band_z: float = 2.0
    """Width of the reported B_noise band in (approximate) standard errors."""
    lr_rule: Literal["none", "linear", "sqrt", "adascale", "surge"] = "sqrt"
    """How LR follows the batch from (b_ref = initial batch, lr_ref = optim.lr / critic.lr)."""
    lr_min: float = 0.0
    """Lower clip of every planned LR."""
    lr_max: float = 1.0e-2
    """Upper clip of every planned LR."""
    noise_kind: Literal["plain", "adam"] = "plain"
    """Which noise scale drives decisions (adam: preconditioned gradients)."""
    noise_calibration: float = 1.0
    """Multiplier on B_simple (Merrill et al. 2025: the proxy can underestimate)."""
    time_window: int = 32
    """Observations kept by each step-time least-squares fit, steps."""
    prior_fixed_fraction: float = 0.3
    """Assumed batch-independent fraction of phase time until two batch sizes were seen."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 20
    """RL optimizer steps."""
    seed: int = 1234
    """Global seed."""
    run_dir: str = "runs/demo"
    """Output folder (metrics, tokenizer, HF exports, checkpoints)."""
    eval_every: int = 10
    """Validation every N steps (0 = only at start and end)."""
    tensorboard: bool = True
    """Also write TensorBoard events."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end and on preemption)."""
    keep_last: int = 2
    """Complete checkpoints kept."""
    async_save: bool = False
    """Periodic checkpoints are staged, then written in the background and committed at the
    next step boundary (preemption and final checkpoints are always synchronous)."""
    resume: str = "auto"
    """'auto' (the newest intact one in run_dir/checkpoints, if any), 'never', or a checkpoint path."""
    target_val_reward: float = 0.0
    """Stop once validation reward reaches this (0 = run all steps); time-to-target runs."""


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def batch_size(self) -> int:
        """Responses per RL step."""
        return self.rollout.num_prompts * self.rollout.samples_per_prompt

    def critic_layout(self, world_size: int) -> tuple[int, int, int]:
        """The critic's (TP, PP, DP) in a trainer world of ``world_size`` ranks."""
        c, p = self.critic.parallel, self.parallel
        tp = c.tensor_parallel or p.tensor_parallel
        pp = c.pipeline_parallel or p.pipeline_parallel
        return tp, pp, world_size // (tp * pp)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError on inconsistent sizes. Runs before any process group starts."""
        from megarl.config_checks import check

        check(self, world_size)


def _walk(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.extend(_walk(v, name + "."))
        else:
            out.append((name, v))
    return out


def _fail(field_name: str, value: Any, rule: str) -> typing.NoReturn:
    raise ConfigError(f"{field_name}={value!r} {rule}")


# --------------------------------------------------------------------------- loading


def _coerce(path: str, tp: Any, value: Any) -> Any:
    """Check/convert ``value`` to the annotated type ``tp``; raise ConfigError naming path."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            _fail(path, value, f"must be one of {list(typing.get_args(tp))}")
        return value
    if origin in (list,):
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if isinstance(value, (int, float)):  # '--set reward.weights=1': a list of one
            value = [value]
        if not isinstance(value, list):
            _fail(path, value, "must be a list")
        return [_coerce(f"{path}[{i}]", item, v) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(path, arg, value)
            except ConfigError:
                continue
        _fail(path, value, f"does not match {tp}")
    if tp is type(None):
        if value is not None:
            _fail(path, value, "must be null")
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        _fail(path, value, "must be a bool")
    if tp is int:
        if isinstance(value, bool):
            _fail(path, value, "must be an int")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        _fail(path, value, "must be an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        _fail(path, value, "must be a float")
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, "must be a string")
        return value
    raise ConfigError(f"{path}: unsupported annotation {tp}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}' (valid: {sorted(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                _fail(path, value, "must be a mapping")
            kwargs[key] = _build(tp, value, path + ".")  # type: ignore[arg-type]
        else:
            kwargs[key] = _coerce(path, tp, value)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw  # not YAML: the text itself (a string field takes it; others say why not)
    return key.strip().split("."), value


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config and apply ``a.b=c`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not valid UTF-8 text (byte offset {e.start})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: invalid YAML ({problem})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        data = loaded
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{k}' is not a section")
        node[keys[-1]] = value
    return _build(RunConfig, data, "")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
