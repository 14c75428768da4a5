"""What the coordinator is told: its settings (the run config's ``coordinator`` section,
:class:`megarl.config.CoordinatorConfig`, the one definition with the one set of defaults) and
:class:`CoordinatorRun`, the facts of the run it plans for — group size, starting batch, DP
size, the LRs the optimiser sections were tuned with — which the planner derives, never the
user twice. :func:`validate` checks both together, naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarl.config import CoordinatorConfig
from megarl.coordinator.goodput import BatchGrid
from megarl.coordinator.lr_rules import LR_RULES
from megarl.coordinator.samples import SamplesLayout


@dataclass(kw_only=True)
class CoordinatorRun:
    """The run the coordinator plans for (derived from the run config by ``megarl.planning``)."""

    samples_per_prompt: int = 8
    """Responses per prompt (GRPO group size), fixed."""
    initial_prompts: int = 32
    """Prompts per step until the first change."""
    batch_divisor: int = 1
    """Responses per step must be a multiple of this (DP size x probe part x mini-batches; a probe
    part is whole micro-batches holding whole groups, ``megarl.config.cross.probe_part_rows``)."""
    dp_size: int = 1
    """Data-parallel ranks sharing the batch (length of StepPlan.dp_shares)."""
    equal_shares: bool = False
    """Keep the DP shares equal (expert parallelism: every rank of an EP group runs the same
    micro-batches, since each expert all-to-all needs all of them)."""
    lr_ref: dict[str, float] = field(default_factory=dict)
    """Per model: learning rate tuned at b_ref; every observed model must have one."""
    b_ref: dict[str, float] = field(default_factory=dict)
    """Per model: batch (responses per step) at which lr_ref was tuned
    (`CoordinatorConfig.lr_reference_batch`); default the initial batch."""
    batch_models: list[str] | None = None
    """Models whose noise scale decides the batch; None means every observed model."""
    min_batch: int = 1
    """Smallest batch (responses) the grad probes can measure (at DP = 1: two whole-group parts of
    the measured mini-batch); the grid holds no smaller batch, whatever min_prompts says —
    a batch the probe cannot measure would never be left again."""
    mini_batches: int = 1
    """Optimizer steps per rollout and PPO epoch (``algo.mini_batches``): each step trains on
    B/mini_batches responses, the batch McCandlish's model and the LR rules are about."""
    samples_layouts: list[SamplesLayout] = field(default_factory=list)
    """choose=prompts_and_samples: every samples-per-prompt value the coordinator may pick, with
    what it asks of the batch (the starting one among them); empty: S stays samples_per_prompt."""
    clip_grad: float = 0.0
    """Global grad-norm clip of every trained model's optimizer (``optim.clip_grad``; 0 = none):
    Adam is handed min(1, clip_grad/|g|)·g, which the second-moment rescale follows."""

    @property
    def initial_batch(self) -> int:
        """initial_prompts x samples_per_prompt, responses."""
        return self.initial_prompts * self.samples_per_prompt


def grid(settings: CoordinatorConfig, run: CoordinatorRun, layout: SamplesLayout | None = None) -> BatchGrid:
    """The candidate prompt counts the coordinator chooses from (at ``layout``'s samples per
    prompt, default the run's)."""
    x = layout or SamplesLayout(
        samples=run.samples_per_prompt, batch_divisor=run.batch_divisor, min_batch=run.min_batch
    )
    return BatchGrid(
        samples_per_prompt=x.samples,
        min_prompts=max(settings.min_prompts, -(-x.min_batch // x.samples)),
        max_prompts=settings.max_prompts,
        factor=settings.grid_factor,
        divisor=x.batch_divisor,
    )


def validate(settings: CoordinatorConfig, run: CoordinatorRun) -> None:
    """Raise ValueError naming the field, its value and the rule."""
    s = settings
    if run.initial_batch < run.min_batch:
        raise ValueError(
            f"initial batch {run.initial_batch} responses is below min_batch={run.min_batch}, the smallest "
            "batch whose gradient noise the probes can measure"
        )
    g = grid(s, run)
    g.validate()
    if not g.is_valid(run.initial_prompts):
        raise ValueError(
            f"initial_prompts={run.initial_prompts} must lie in [min_prompts="
            f"{s.min_prompts}, max_prompts={s.max_prompts}] and make "
            f"initial_prompts x samples_per_prompt={run.samples_per_prompt} divisible "
            f"by batch_divisor={run.batch_divisor}"
        )
    if run.mini_batches < 1:
        raise ValueError(f"mini_batches={run.mini_batches} must be >= 1")
    if not (run.clip_grad >= 0 and math.isfinite(run.clip_grad)):
        raise ValueError(f"clip_grad={run.clip_grad} must be 0 (no clipping) or a finite norm > 0")
    if run.dp_size < 1:
        raise ValueError(f"dp_size={run.dp_size} must be >= 1")
    if not s.min_gain >= 0:
        raise ValueError(f"min_gain={s.min_gain} must be >= 0")
    if s.warmup_steps < 0 or s.cooldown_steps < 0:
        raise ValueError(f"warmup_steps={s.warmup_steps} and cooldown_steps={s.cooldown_steps} must be >= 0")
    if not 0.0 <= s.ema_beta < 1.0:
        raise ValueError(f"ema_beta={s.ema_beta} must be in [0, 1)")
    if not (s.ema_dof >= 0 and math.isfinite(s.ema_dof)):
        raise ValueError(f"ema_dof={s.ema_dof} must be 0 (per-step ema_beta) or > 0 degrees of freedom")
    if not (s.track_factor == 0 or s.track_factor > 1):
        raise ValueError(f"track_factor={s.track_factor} must be 0 (no limit) or > 1")
    if not (s.band_ratio == 0 or s.band_ratio >= 1):
        raise ValueError(f"band_ratio={s.band_ratio} must be 0 (no cap) or >= 1")
    if not s.band_z > 0:
        raise ValueError(f"band_z={s.band_z} must be > 0")
    if s.noise_kind not in ("plain", "adam"):
        raise ValueError(f"noise_kind={s.noise_kind!r} must be 'plain' or 'adam'")
    if not s.min_dof >= 0:
        raise ValueError(f"min_dof={s.min_dof} must be >= 0 degrees of freedom")
    if not s.noise_calibration > 0:
        raise ValueError(f"noise_calibration={s.noise_calibration} must be > 0")
    if s.lr_rule not in LR_RULES:
        raise ValueError(f"lr_rule={s.lr_rule!r} must be one of {sorted(LR_RULES)}")
    if not 0.0 <= s.lr_min <= s.lr_max:
        raise ValueError(f"need 0 <= lr_min={s.lr_min} <= lr_max={s.lr_max}")
    for name, b in run.b_ref.items():
        if not b > 0:
            raise ValueError(f"b_ref[{name!r}]={b} must be > 0 responses")
    for name, lr in run.lr_ref.items():
        if not lr > 0:
            raise ValueError(f"lr_ref[{name!r}]={lr} must be > 0")
    for name in run.batch_models or []:
        if name not in run.lr_ref:
            raise ValueError(f"batch_models contains {name!r}, which has no lr_ref (known: {sorted(run.lr_ref)})")
    if s.choose == "prompts_and_samples":
        _check_layouts(s, run)
    if s.time_window < 2:
        raise ValueError(f"time_window={s.time_window} must be >= 2")
    if not 0.0 <= s.prior_fixed_fraction < 1.0:
        raise ValueError(f"prior_fixed_fraction={s.prior_fixed_fraction} must be in [0, 1)")


def _check_layouts(s: CoordinatorConfig, run: CoordinatorRun) -> None:
    """choose=prompts_and_samples: the run's S among its layouts, each inside the bounds with a grid."""
    found = sorted(x.samples for x in run.samples_layouts)
    if run.samples_per_prompt not in found:
        raise ValueError(f"samples_layouts {found} must include samples_per_prompt={run.samples_per_prompt}")
    for x in run.samples_layouts:
        if not s.min_samples_per_prompt <= x.samples <= s.max_samples_per_prompt:
            raise ValueError(
                f"samples_layouts: samples={x.samples} must lie in [min_samples_per_prompt="
                f"{s.min_samples_per_prompt}, max_samples_per_prompt={s.max_samples_per_prompt}]"
            )
        grid(s, run, x).validate()
