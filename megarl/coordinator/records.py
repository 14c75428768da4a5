"""Records exchanged between the trainer and the coordinator (one step each).

`ModelGradStats` and `StepTimings` flow trainer → coordinator after a step; `StepPlan`
flows back before the next one. Units are stated on every field: batches in responses
(or tokens where `batch_unit="tokens"`), times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megarl.coordinator.noise import GradAverage

BatchUnit = Literal["responses", "tokens"]
GradSource = Literal["dp", "microbatch"]


@dataclass(kw_only=True)
class ExpertGradStats:
    """The routed experts' own parts under expert parallelism (EP > 1), an estimate of their
    own (`noise.expert_parallel_estimates`): each part is the union of one micro-batch run (or
    the whole rows) over the ranks of one EP group, the data the all-to-all brought its experts."""

    sq_norms: list[float]
    """|G_j|² of each part's mean gradient over the expert parameters, each expert once."""
    batches: list[float]
    """Samples behind each entry of sq_norms (an EP group's ranks' together), in the unit of
    the `ModelGradStats` they belong to."""
    global_sq_norm: float
    """|G|² of the expert parameters' all-reduced gradient of the whole mini-batch."""


@dataclass(kw_only=True)
class ModelGradStats:
    """One model's gradient norms for one step (first mini-batch of the rollout)."""

    model: str
    """Model name, e.g. "actor" or "critic"; keys `CoordinatorConfig.lr_ref`."""
    local_sq_norms: list[float]
    """|G_r|² of each rank's local mean gradient before the all-reduce (source="dp"), or of
    each micro-batch's own mean gradient on a single rank (source="microbatch")."""
    local_batches: list[float]
    """Samples behind each entry of local_sq_norms, in `batch_unit`."""
    global_sq_norm: float
    """|G|² of the all-reduced (or accumulated) gradient of the whole mini-batch."""
    dof: float | None = None
    """Degrees of freedom of this step's estimate; None = len(local_sq_norms) - 1 (parts
    that are independent, e.g. whole GRPO groups, see `noise.parts_dof`)."""
    signal_fraction: float | None = None
    """Fraction of the step's responses the parts count: the policy loss has gradient only
    where the advantage is non-zero, so the actor's parts count responses of groups with
    reward signal; None = all (e.g. a value loss)."""
    batch_unit: BatchUnit = "responses"
    """What the loss averages over: "responses" (sequence-mean) or "tokens" (token-mean)."""
    source: GradSource = "dp"
    """Whether the local entries are DP ranks or micro-batches of one rank."""
    grad_average: GradAverage = "samples"
    """How the global gradient weights the parts: "samples" (true sample mean) or "ranks"
    (mean of per-part means); see `noise.dp_estimates`."""
    experts: ExpertGradStats | None = None
    """Under expert parallelism (EP > 1): the routed experts' parts; the norms above then cover
    the other (dense) parameters only. None: the norms above cover every parameter."""
    split_sq_norms: list[float] | None = None
    """The noise split by prompt (each part one GRPO group, source="microbatch"): per part, in the
    order of local_sq_norms, |Σ_{h1} g - Σ_{h2} g|²/n² of its two halves' gradient sums (n its
    units), `noise_split.prompt_split`; None: not measured."""
    split_halves: list[list[float]] | None = None
    """Units [n_1, n_2] of each part's two halves (with split_sq_norms)."""


@dataclass(kw_only=True)
class StepTimings:
    """Wall-clock phase timings of one step."""

    generate_s: float
    """Rollout generation time, seconds."""
    train_s: float
    """Training (all mini-batches / PPO epochs) time, seconds."""
    logprobs_s: float = 0.0
    """Old-policy / reference log-prob and value forward passes over the rollout, seconds
    (linear in the batch, modelled like training)."""
    other_s: float = 0.0
    """Everything else in the step (scoring, advantages, weight sync), seconds."""
    train_fixed_s: float | None = None
    """The part of `train_s` outside its micro-batch work (optimizer steps, pipeline fill and
    drain), or None when not measured: the time model's prior shape at one batch size."""
    logprobs_fixed_s: float | None = None
    """The same for `logprobs_s`."""
    rollout_responses: int
    """Responses generated this step (prompts x samples_per_prompt after any filtering)."""
    rollout_tokens: int
    """Generated (response) tokens this step."""
    rank_train_s: list[float] | None = None
    """Per-DP-rank compute seconds of training, excluding waits in collectives, or None."""
    rank_train_samples: list[float] | None = None
    """Responses each DP rank trained on; None means the shares of this step's plan."""

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        for name in ("generate_s", "logprobs_s", "train_s", "other_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"StepTimings.{name}={value} must be finite and >= 0 seconds")
        for name in ("train_fixed_s", "logprobs_fixed_s"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"StepTimings.{name}={value} must be None or finite and >= 0 seconds")
        if self.rollout_responses <= 0:
            raise ValueError(f"StepTimings.rollout_responses={self.rollout_responses} must be > 0")
        if self.rollout_tokens < 0:
            raise ValueError(f"StepTimings.rollout_tokens={self.rollout_tokens} must be >= 0")


@dataclass(kw_only=True)
class StepPlan:
    """What the trainer should do at `step`."""

    step: int
    """Step this plan is for."""
    num_prompts: int
    """Prompts to sample for the rollout."""
    samples_per_prompt: int
    """Responses per prompt (group size)."""
    lr: dict[str, float]
    """Learning rate per model."""
    dp_shares: list[float] | None
    """Fraction of the batch per DP rank (sums to 1); None = equal rows."""
    predicted_goodput: float | None
    """Predicted B0-equivalent responses/s (B0 = initial batch), None if not predictable."""
    b_noise: dict[str, float | None]
    """Noise scale per model in responses (None while unresolved)."""
    reason: str
    """Why this batch was chosen."""
    adam_v_scale: dict[str, float] = field(default_factory=dict)
    """Per model: factor for Adam's second moments before this step's update (a batch
    change; see `coordinator.adam_v_scale`); models not named keep theirs."""

    @property
    def batch_responses(self) -> int:
        """Responses per step: num_prompts x samples_per_prompt."""
        return self.num_prompts * self.samples_per_prompt

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepPlan:
        """Inverse of `to_dict`."""
        return cls(
            step=int(d["step"]),
            num_prompts=int(d["num_prompts"]),
            samples_per_prompt=int(d["samples_per_prompt"]),
            lr={k: float(v) for k, v in d["lr"].items()},
            dp_shares=None if d["dp_shares"] is None else [float(x) for x in d["dp_shares"]],
            predicted_goodput=None if d["predicted_goodput"] is None else float(d["predicted_goodput"]),
            b_noise={k: None if v is None else float(v) for k, v in d["b_noise"].items()},
            reason=str(d["reason"]),
            adam_v_scale={k: float(v) for k, v in d.get("adam_v_scale", {}).items()},
        )
