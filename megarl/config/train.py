"""The ``train`` section: the run's steps, seed, output folder, validation cadence, checkpoints,
stop rules and trackers (``train.tracking``: :mod:`megarl.config.tracking`), and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from megarl.config.rules import fail
from megarl.config.tracking import TrackingConfig


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
    val_metric: Literal["reward", "answer_prob"] = "reward"
    """What each validation measures (logged as ``val/reward``, read by ``target_val_reward``):
    ``reward``, the mean reward of one greedy response per validation prompt (the engines);
    ``answer_prob``, the mean over validation prompts of the probability the actor gives the
    row's reference answer (``data.answer_key``, then EOS) after its prompt, teacher-forced at
    temperature 1 by the trainer's own forward: exact, no sampling. Single-turn rollouts."""
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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = (
        "steps",
        "eval_every",
        "eval_every_samples",
        "max_samples",
        "save_every",
        "evals_past_target",
    )

    def validate(self) -> None:
        """run_dir can be created; a stop past the target needs a target and validations to
        count; each tracker is named once and its settings are usable."""
        run_dir = Path(self.run_dir)
        for parent in (run_dir, *run_dir.parents):
            if parent.exists() and not parent.is_dir():
                fail("train.run_dir", self.run_dir, f"cannot be created: {parent} is a file")
        self._check_stopping()
        for name in self.trackers:
            if list(self.trackers).count(name) > 1:
                fail("train.trackers", self.trackers, f"names {name!r} twice")
        self.tracking.validate()

    def _check_stopping(self) -> None:
        if self.target_window > 1 and not self.target_val_reward:
            fail("train.target_window", self.target_window, "needs train.target_val_reward > 0")
        if self.evals_past_target and not self.target_val_reward:
            fail("train.evals_past_target", self.evals_past_target, "needs train.target_val_reward > 0")
        if self.evals_past_target and not (self.eval_every or self.eval_every_samples):
            fail(
                "train.evals_past_target",
                self.evals_past_target,
                "counts mid-run validations: set train.eval_every or train.eval_every_samples",
            )
