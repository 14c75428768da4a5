"""What a run counts across its steps, and the summary it ends with.

:class:`Progress` is the loop's counter (a checkpoint part, so a resumed run validates and
stops where the uninterrupted one would): responses trained, the validation cadence, the
target test and the early stop, and the time to the target on its own clock (RL seconds less
validation, this process's, not checkpointed). :class:`RunSummary` is the record ``train``
returns and the trackers keep as the run's summary (``summary.json``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from megarl.config import TrainConfig


@dataclass
class RLClock:
    """RL seconds since :meth:`start`, less the validations' (the time-to-target measure)."""

    t0: float = 0.0
    validation_s: float = 0.0

    def start(self) -> None:
        self.t0, self.validation_s = time.perf_counter(), 0.0

    def validated(self, seconds: float) -> None:
        self.validation_s += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.validation_s


@dataclass
class Progress:
    """What the loop counts across steps and when it stops early."""

    samples: int = 0
    """Responses trained so far."""
    reached_step: int = 0
    """The step whose validation first reached ``train.target_val_reward`` (0 = not yet)."""
    evals_since: int = 0
    """Validations after that one."""
    recent: list[float] = field(default_factory=list)
    """The last ``train.target_window`` validations (the target test averages them)."""
    clock: RLClock = field(default_factory=RLClock)
    """This process's RL time less validation (not checkpointed)."""

    def count(self, responses: int, step: int, t: TrainConfig) -> bool:
        """Add a step's responses; whether a validation is due after it (``train.eval_every_samples``
        when set, else ``train.eval_every``)."""
        before, self.samples = self.samples, self.samples + responses
        if t.eval_every_samples:
            return before // t.eval_every_samples < self.samples // t.eval_every_samples
        return bool(t.eval_every) and step % t.eval_every == 0

    def stop(self, step: int, val: float | None, t: TrainConfig) -> str | None:
        """After a step and its validation (``val``, None if none ran): why the run stops now,
        or None. The target stop waits ``train.evals_past_target`` further validations."""
        if t.target_val_reward and val is not None:
            self.recent = [*self.recent, float(val)][-t.target_window :]
            if self.reached_step:
                self.evals_since += 1
            elif len(self.recent) == t.target_window and self.target_mean() >= t.target_val_reward:
                self.reached_step = step
        return self.done(t)

    def target_mean(self) -> float:
        """Mean of the validations the target test averages (after the first)."""
        return statistics.fmean(self.recent)

    def reached_now(self, step: int) -> bool:
        """Whether ``step``'s validation is the one that reached the target."""
        return bool(self.reached_step) and self.reached_step == step

    def done(self, t: TrainConfig) -> str | None:
        """Why the run is over by its counts (a run resumed from its last step's checkpoint
        takes no further step), or None."""
        if self.reached_step and self.evals_since >= t.evals_past_target:
            return f"validation reached {t.target_val_reward:g} at step {self.reached_step}"
        if t.max_samples and self.samples >= t.max_samples:
            return f"{self.samples} responses trained (train.max_samples={t.max_samples})"
        return None

    def state_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["clock"]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name == "clock":
                continue
            if f.name == "recent":  # (absent from checkpoints written before target_window)
                self.recent = [float(v) for v in state.get("recent", [])]
            else:
                setattr(self, f.name, int(state[f.name]))


SUMMARY_KEYS = {
    "warm_start_final_nll": "warm_start/final_nll",
    "warm_start_final_exact": "warm_start/final_exact",
    "warm_start_steps": "warm_start/steps",
    "val_reward_start": "val/reward_start",
    "val_reward_end": "val/reward_end",
}
"""Summary fields logged under another name (the rest under their own)."""


@dataclass
class RunSummary:
    """The run's end record (rank 0 logs it; the trackers keep it as the run summary). A field
    left None did not happen in this run (no warm start, no target, not preempted...)."""

    resumed_from_step: int | None = None
    warm_start_final_nll: float | None = None
    """The warm start's last supervised NLL."""
    warm_start_final_exact: float | None = None
    """Its last step's share of examples reproduced exactly, teacher-forced (``megarl.warm_start``)."""
    warm_start_steps: int | None = None
    """Its steps taken (``warm_start.stop_at_exact`` may stop it before ``warm_start.steps``)."""
    warm_start_s: float | None = None
    """Seconds of warm start (part of ``startup_s``)."""
    val_reward_start: float | None = None
    """Validation reward before the first RL step (a fresh run)."""
    startup_s: float | None = None
    """Process groups, models, engines, warm start, first sync."""
    engine_wait_s: float | None = None
    """Part of ``startup_s``: rank 0 blocked on engine start-up."""
    preempted_at_step: int | None = None
    time_to_target_s: float | None = None
    """RL seconds less validation until the target was reached (:class:`RLClock`)."""
    steps_to_target: int | None = None
    samples_to_target: int | None = None
    rl_wall_s: float | None = None
    val_reward_end: float | None = None
    wall_s: float | None = None
    shutdown_s: float | None = None
    steps: int | None = None

    def reached(self, progress: Progress) -> None:
        """The target reached now: its time, steps and responses."""
        self.time_to_target_s = progress.clock.elapsed()
        self.steps_to_target = progress.reached_step
        self.samples_to_target = progress.samples

    def as_dict(self) -> dict[str, float]:
        """What happened, under the names the metrics use."""
        return {
            SUMMARY_KEYS.get(f.name, f.name): getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
