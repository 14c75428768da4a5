"""The ``coordinator`` section: the critical-batch-size coordinator's settings, and its own
checks at load time. The coordinator itself checks them again with the facts of the run
(:func:`megarl.coordinator.config.validate`); what they need from the optimizer, the layout
and the starting batch is :mod:`megarl.config.cross`'s rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from megarl.config.rules import fail

if TYPE_CHECKING:
    from megarl.config.parallel import ParallelConfig
    from megarl.config.rollout import RolloutConfig


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

    choose: Literal["total", "prompts_and_samples"] = "total"
    """What the planner chooses: "total" the prompts per step at the configured samples per prompt;
    "prompts_and_samples" both, from the noise split by prompt (σ_b²/P + σ_w²/(P·S),
    docs/COORDINATOR.md §2), samples per prompt in [min_samples_per_prompt, max_samples_per_prompt] and a
    multiple of 2 × parallel.micro_batch_size (each group's halves in whole micro-batches)."""
    noise_split: bool = False
    """Measure the gradient noise split by prompt (``coord/noise_between``, ``coord/noise_within``) while choosing
    the total: each probe part is one GRPO group whose halves are read apart (needs
    parallel.micro_batch_size to divide samples_per_prompt/2; one more grad-buffer copy during
    the measured update). Always on with choose=prompts_and_samples."""
    prompt_cost_s: float = 0.0
    """With choose=prompts_and_samples: seconds a step spends per prompt beside its responses' cost
    (a prompt prefill the engine does not share over its samples, a per-prompt environment); the
    step-time model is per response and cannot separate it at one samples-per-prompt value."""
    min_samples_per_prompt: int = 2
    """Fewest samples per prompt choose=prompts_and_samples may pick (>= 2: a group-based
    advantage needs a baseline from the group's other samples)."""
    max_samples_per_prompt: int = 64
    """Most samples per prompt choose=prompts_and_samples may pick (engine memory, dataset bound)."""

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("warmup_steps", "cooldown_steps", "lr_reference_batch")

    def validate(self) -> None:
        """A known noise kind and choice; samples-per-prompt bounds >= 2 and ordered; a reference batch >= 0."""
        if self.noise_kind not in ("plain", "adam"):
            fail(
                "coordinator.noise_kind",
                self.noise_kind,
                "must be 'plain' (raw gradients) or 'adam' (Adam-preconditioned)",
            )
        if self.choose not in ("total", "prompts_and_samples"):
            fail("coordinator.choose", self.choose, "must be 'total' or 'prompts_and_samples'")
        if not self.prompt_cost_s >= 0:
            fail("coordinator.prompt_cost_s", self.prompt_cost_s, "must be >= 0 seconds per prompt")
        if self.min_samples_per_prompt < 2:
            fail(
                "coordinator.min_samples_per_prompt",
                self.min_samples_per_prompt,
                "must be >= 2 (a group-based advantage needs a baseline from the group's other samples)",
            )
        if self.max_samples_per_prompt < self.min_samples_per_prompt:
            fail(
                "coordinator.max_samples_per_prompt",
                self.max_samples_per_prompt,
                f"must be >= coordinator.min_samples_per_prompt={self.min_samples_per_prompt}",
            )
        if self.lr_reference_batch < 0:
            fail(
                "coordinator.lr_reference_batch",
                self.lr_reference_batch,
                "must be >= 0 responses (0 = the configured batch)",
            )

    def check_sequence_parallel(self, sequence_parallel: bool) -> None:
        """The grad probe reads each rank's gradients before megatron's finalisation, where
        sequence parallelism sums the TP ranks' parts of the norms' and routers' gradients."""
        if self.enabled and sequence_parallel:
            fail(
                "parallel.sequence_parallel",
                True,
                "with coordinator.enabled: its grad probe reads gradients before the TP sum that sequence "
                "parallelism needs for norms and routers (each TP rank holds its own positions' part)",
            )

    def check_samples_layout(self, r: RolloutConfig, p: ParallelConfig) -> None:
        """choose=prompts_and_samples (a cross-section rule, run by ``megarl.config.cross``): the
        starting group inside the bounds, its halves in whole micro-batches (the noise split reads
        them), and no layout whose probe parts are not micro-batches."""
        if not self.min_samples_per_prompt <= r.samples_per_prompt <= self.max_samples_per_prompt:
            fail(
                "rollout.samples_per_prompt",
                r.samples_per_prompt,
                f"must lie in [coordinator.min_samples_per_prompt={self.min_samples_per_prompt}, "
                f"coordinator.max_samples_per_prompt={self.max_samples_per_prompt}] with "
                "coordinator.choose=prompts_and_samples",
            )
        if r.samples_per_prompt % (2 * p.micro_batch_size):
            fail(
                "parallel.micro_batch_size",
                p.micro_batch_size,
                f"must divide rollout.samples_per_prompt/2={r.samples_per_prompt / 2:g} with coordinator.choose="
                "prompts_and_samples (the noise split reads each group's halves as whole micro-batches)",
            )
        for field, value, rule in (
            ("parallel.pipeline_parallel", p.pipeline_parallel, 1),
            ("parallel.expert_parallel", p.expert_parallel, 1),
            ("parallel.max_tokens_per_micro_batch", p.max_tokens_per_micro_batch, 0),
            ("coordinator.microbatch_parts", self.microbatch_parts, True),
        ):
            if value != rule:
                fail(
                    field,
                    value,
                    f"must be {rule} with coordinator.choose=prompts_and_samples (probe parts are micro-batches)",
                )
