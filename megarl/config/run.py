"""The whole run config: weight sync, coordinator and run sections, and :class:`RunConfig`
that holds one of each section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.algo import AlgoConfig, CriticConfig, WarmStartConfig
from megarl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megarl.config.rollout import DataConfig, RewardConfig, RolloutConfig
from megarl.config.tracking import TrackingConfig


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["auto", "shm", "http", "nccl", "cuda_ipc"] = "auto"
    """How buckets reach the engines: shm (files in this host's /dev/shm), http (bytes in a
    request body; engines on any host), nccl (GPU broadcast), cuda_ipc (GPU memory shared with
    colocated engines); auto = shm if every engine is on this host, else http."""
    bucket_mb: float = 64.0
    """Target bucket size, MiB."""
    integrity_check: bool = True
    """After a sync, compare engine vs trainer logprobs on a fixed sequence (see integrity_every)."""
    integrity_every: int = 1
    """Check every N-th policy version (1 = every sync). The first sync, and the first sync
    after an engine restart, are always checked: a wrong mapping or a bad reload shows there."""
    integrity_tol: float = 1e-3
    """Max |Δ logprob| the integrity check allows (fp32)."""


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
    """Smallest prompts per step the coordinator may choose (at DP = 1 it also keeps two
    micro-batches in the measured mini-batch: one gives the noise estimate nothing to read)."""
    max_prompts: int = 256
    """Largest prompts per step (memory / KV cache / dataset bound)."""
    grid_factor: float = 1.4142135623730951
    """Ratio between neighbouring candidate prompt counts (> 1)."""
    min_gain: float = 0.05
    """Switch only if predicted goodput improves by more than this fraction (hysteresis)."""
    warmup_steps: int = 1
    """Observed steps before the first batch change, steps (see also min_dof)."""
    min_dof: float = 6.0
    """Degrees of freedom (parts - 1, summed over steps) the noise estimate needs before the
    first batch change; the first change then goes straight to the goodput optimum."""
    cooldown_steps: int = 3
    """Steps after a change before the next one, steps."""
    track_factor: float = 2.0
    """After the first jump, one change moves the batch by at most this factor (0: any): a
    settled estimate drifts, so a larger move is more likely noise than news (docs/COORDINATOR.md §2)."""
    ema_beta: float = 0.9
    """EMA decay per step of |G|², tr(Σ) (each step weighted by its degrees of freedom),
    per-rank throughput and timings."""
    ema_dof: float = 0.0
    """Horizon of the noise estimate's EMA in degrees of freedom instead of steps (0: ``ema_beta``
    per step): a step whose parts give d degrees of freedom decays the older ones by
    exp(-d/ema_dof), so the estimate holds ~ema_dof degrees of freedom at any batch. With a
    per-step decay its precision follows the batch (B/mbs parts a step): a small batch gets a
    wide band and is held by it (docs/COORDINATOR.md §1, "Horizon in degrees of freedom")."""
    band_z: float = 2.0
    """Width of the B_noise band in (approximate) standard errors; the batch is kept while it
    lies between the goodput optima at the band's two ends (hysteresis)."""
    band_ratio: float = 4.0
    """The hold band's upper end is capped at r·B_noise (0: no cap). While |G|² is not resolved
    from zero the band has no upper end, and without the cap any too-large batch would be held
    (docs/COORDINATOR.md §2)."""
    unresolved_as_infinite: bool = False
    """Count a model whose EMA(|G|²) is <= 0 (|G|² not resolved from zero) as B_noise = inf in
    the batch decision, instead of keeping the batch until the estimate turns positive. Keeping
    makes the decision one-sided: it then acts only on readings taken after |G|² came out high,
    which are biased low, the more so the smaller the batch (docs/COORDINATOR.md §2). A move on
    an unresolved estimate is limited to ``track_factor``, the first one included. Off: on the
    time-to-target benchmark it won from a large start and lost from a small one (§5)."""
    lr_rule: Literal["none", "linear", "sqrt", "adascale", "surge"] = "sqrt"
    """How LR follows the batch from (lr_reference_batch, lr_ref = optim.lr / critic.lr);
    surge: Adam's optimum rises then falls in B, peaking at B_noise (docs/COORDINATOR.md §3)."""
    lr_reference_batch: int = 0
    """Responses per step at which optim.lr / critic.lr were validated; every planned LR scales
    from it (0 = the configured batch, rollout.num_prompts × samples_per_prompt)."""
    lr_min: float = 0.0
    """Lower clip of every planned LR."""
    lr_max: float = 1.0e-2
    """Upper clip of every planned LR."""
    noise_kind: str = "plain"
    """Which noise scale drives decisions: "plain" (raw gradients) or "adam" (each part's
    gradient times Adam's preconditioner 1/(√v̂+ε) before the step; needs
    parallel.use_distributed_optimizer false). Measured not better and dependent on the batch
    through v̂ (docs/COORDINATOR.md §1, §5 session 21): "plain" is the default."""
    noise_calibration: float = 1.0
    """Multiplier on B_simple. The proxy reads low (Merrill et al. 2025, under Adam): four
    time-to-target sweeps put the online median at 0.33-0.54 of the fitted critical batch, and 2
    or 3 was faster than 1 on paired seeds there; but with 2 the demo reversed its batch on 2 of
    4 runs (0 with 1), so the default stays 1 (docs/COORDINATOR.md §5, sessions 20 and 22)."""
    microbatch_parts: bool = True
    """Noise parts = every micro-batch on every DP rank (needs PP = 1; one grad-buffer copy per
    micro-batch of the measured update); False = one part per DP rank."""
    adam_rescale: bool = True
    """On a batch change, scale Adam's second moments by the predicted change of E[g²]
    (docs/COORDINATOR.md §3), so the first updates at the new batch match the plan."""
    time_window: int = 32
    """Latest times kept per batch size by each step-time least-squares fit, steps."""
    prior_fixed_fraction: float = 0.3
    """Assumed batch-independent fraction of a phase's time until two batch sizes were seen, for
    the phases that cannot measure theirs (generation; the log-prob forwards and the update
    measure it: time outside their micro-batch work)."""


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
    eval_every_samples: int = 0
    """Validation each time the responses trained pass a multiple of N (replaces ``eval_every``
    when > 0): evenly spaced in samples when the coordinator changes the batch."""
    max_samples: int = 0
    """Stop once this many responses are trained (0 = no limit; ``steps`` still caps)."""
    tensorboard: bool = True
    """Also write TensorBoard events (false drops "tensorboard" from ``trackers``)."""
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["jsonl", "tensorboard"]
    )
    """Where rank 0 sends the metrics: jsonl (always written: run_dir/metrics.jsonl), tensorboard,
    wandb, mlflow; a tracker not installed or failing is dropped with one warning (docs/TRACKING.md)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """W&B / MLflow run settings: project, run name, group, tags, URI (train.tracking.*)."""
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
    evals_past_target: int = 0
    """Validations run after the one that reached ``target_val_reward`` before stopping (a
    smoothed curve needs points on both sides of its crossing)."""
    target_window: int = 1
    """Validations averaged for the target test: the run has reached ``target_val_reward`` once
    the mean of its last ``target_window`` validations does (1 = the latest alone). One lucky
    validation then does not end a time-to-target run; a centred smoother over ±h validations
    has crossed the target with its window complete when the mean of the last 2h+1 has."""


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The actor's (and reference's) architecture and size, or an HF folder to start from (``model.init_from``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer ranks split the actor and reference: tensor / pipeline / data parallel sizes, micro-batches."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's Adam optimizer: peak and minimum LR, schedule, warm-up, weight decay, eps, gradient clip."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where prompts come from (built-in task, JSONL, Parquet, datasets folder), their fields, chat template."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Which reward functions score a response, their weights, and the worker processes that run them."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: prompts × samples per step, lengths, sampling, the vLLM engines and their resources."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL algorithm: advantage estimator, PPO clip, KL, loss aggregation, DAPO filters, TIS."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model (its own Adam): LR, warm-up, value clip, initialisation, its own parallel layout."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised steps on the reference answers before RL (teaches the answer format)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the actor's weights reach the engines after every optimizer step, and the integrity check."""
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    """The critical-batch-size coordinator: gradient-noise estimates choose the rollout batch and LR."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run: steps, seed, output folder, validation cadence, checkpoints, stop rules, trackers."""

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
