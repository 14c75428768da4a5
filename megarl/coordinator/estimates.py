"""What the coordinator keeps per trained model, and a step's reports checked before it keeps them.

Per model (`ModelEstimates`): the noise-scale estimate (`noise.NoiseScaleEstimator`, in the
model's batch unit, over samples with reward signal), the smoothed fraction of responses with
signal, the batch unit, and the latest pre-clip gradient norms (for Adam's rescale). They are
read out in responses of the whole rollout, the unit the coordinator plans in: a token-unit
value is divided by the smoothed tokens per response, a signal-sample one by the signal
fraction f (B responses carry f·B useful ones, so B_noise = B_noise,signal/f).

Invariant: `grad_updates`, `check_grad_norms` and `rank_throughputs` are pure; the
coordinator runs them on a step's reports before it changes anything, so a rejected report
(ValueError) leaves it exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.config import CoordinatorConfig
from megarl.coordinator.noise import (
    NoiseScaleEstimator,
    dp_estimates,
    expert_parallel_estimates,
    microbatch_estimates,
    parts_dof,
)
from megarl.coordinator.noise_split import SplitEstimator, effective_group, prompt_split
from megarl.coordinator.records import BatchUnit, ModelGradStats, StepTimings
from megarl.coordinator.throughput import Ema, StepTimeModel

NORM_WINDOW = 32
"""Pre-clip grad norms kept per model (the latest optimizer steps) for Adam's rescale: recent,
since the norm drifts over training (1.2-10.9 in one demo run), and enough for a mean."""


@dataclass(frozen=True, kw_only=True)
class GradUpdate:
    """One model's gradient statistics of one step, checked: what its estimates take."""

    model: str
    unit: BatchUnit
    g2: float
    """|G|² estimate, per sample of ``unit``."""
    tr_sigma: float
    """tr Σ estimate, per sample of ``unit``."""
    dof: float
    """Degrees of freedom of the step's estimate."""
    signal: float
    """Fraction of the step's responses the parts count, in (0, 1]."""
    split: tuple[float, float, float] | None = None
    """(σ_b², σ_w², units per group) of the noise split by prompt, per unit, when measured."""


def grad_updates(
    grads: list[ModelGradStats], lr_ref: Mapping[str, float], units: Mapping[str, BatchUnit]
) -> list[GradUpdate]:
    """One `GradUpdate` per model of ``grads``; ValueError for a model without ``lr_ref``, a
    model twice, a batch unit other than earlier steps' (``units``), or a bad estimate."""
    out: list[GradUpdate] = []
    seen: set[str] = set()
    for g in grads:
        if g.model not in lr_ref:
            raise ValueError(f"model {g.model!r} has no lr_ref in CoordinatorRun (known: {sorted(lr_ref)})")
        if g.model in seen:
            raise ValueError(f"model {g.model!r} appears twice in one step's grads")
        seen.add(g.model)
        if g.batch_unit not in ("responses", "tokens"):
            raise ValueError(f"model {g.model!r}: batch_unit={g.batch_unit!r} must be 'responses' or 'tokens'")
        if units.get(g.model, g.batch_unit) != g.batch_unit:
            raise ValueError(
                f"model {g.model!r} reported batch_unit={g.batch_unit!r} but earlier steps used {units[g.model]!r}"
            )
        if g.source not in ("dp", "microbatch"):
            raise ValueError(f"model {g.model!r}: source={g.source!r} must be 'dp' or 'microbatch'")
        estimate = dp_estimates if g.source == "dp" else microbatch_estimates
        g2, tr_sigma = estimate(g.local_sq_norms, g.local_batches, g.global_sq_norm, grad_average=g.grad_average)
        dof = parts_dof(len(g.local_sq_norms))
        if g.experts is not None:  # EP > 1: the routed experts from their own parts (EP-group unions)
            e = g.experts
            e_g2, e_tr = estimate(e.sq_norms, e.batches, e.global_sq_norm, grad_average=g.grad_average)
            g2, tr_sigma, dof = expert_parallel_estimates(
                (g2, tr_sigma, len(g.local_sq_norms)), (e_g2, e_tr, len(e.sq_norms))
            )
        dof = dof if g.dof is None else g.dof
        if not (dof > 0 and math.isfinite(dof)):
            raise ValueError(f"model {g.model!r}: dof={g.dof} must be finite and > 0")
        for name, value in (("|G|^2", g2), ("tr(Sigma)", tr_sigma)):
            if not math.isfinite(value):
                raise ValueError(f"model {g.model!r}: non-finite {name} estimate {value}")
        signal = 1.0 if g.signal_fraction is None else g.signal_fraction
        if not 0.0 < signal <= 1.0:
            raise ValueError(f"model {g.model!r}: signal_fraction={g.signal_fraction} must be in (0, 1]")
        split = _split(g)
        out.append(
            GradUpdate(model=g.model, unit=g.batch_unit, g2=g2, tr_sigma=tr_sigma, dof=dof, signal=signal, split=split)
        )
    return out


def _split(g: ModelGradStats) -> tuple[float, float, float] | None:
    """(σ̂_b², σ̂_w², n_eff) of a report with the halves' readings (`noise_split.prompt_split`)."""
    if g.split_sq_norms is None:
        return None
    if g.source != "microbatch" or g.experts is not None or g.grad_average != "samples":
        raise ValueError(
            f"model {g.model!r}: the noise split needs source='microbatch', EP = 1, grad_average='samples'"
        )
    halves = g.split_halves or []
    if len(g.split_sq_norms) != len(g.local_sq_norms) or len(halves) != len(g.local_sq_norms):
        raise ValueError(
            f"model {g.model!r}: {len(g.split_sq_norms)} split norms and {len(halves)} halves for "
            f"{len(g.local_sq_norms)} parts"
        )
    pairs = [(float(h[0]), float(h[1])) for h in halves]
    between, within = prompt_split(g.local_sq_norms, g.local_batches, g.global_sq_norm, g.split_sq_norms, pairs)
    if not (math.isfinite(between) and math.isfinite(within)):
        raise ValueError(f"model {g.model!r}: non-finite noise split ({between}, {within})")
    return between, within, effective_group(g.local_batches)


def check_grad_norms(norms: Mapping[str, Sequence[float]], lr_ref: Mapping[str, float]) -> None:
    """ValueError for a model without ``lr_ref`` or a norm that is negative or not finite."""
    for model, values in norms.items():
        if model not in lr_ref:
            raise ValueError(f"grad_norms names model {model!r}, which has no lr_ref (known: {sorted(lr_ref)})")
        if not all(v >= 0 and math.isfinite(v) for v in values):
            raise ValueError(f"grad_norms[{model!r}]={values} must be finite and >= 0")


def rank_throughputs(t: StepTimings, dp_size: int, planned_shares: list[float] | None) -> list[float]:
    """Per-rank responses/s of this step (empty when rank timings were not reported). Without
    per-rank sample counts each rank trained its share of the rollout: ``planned_shares`` (the
    step's plan, if it was planned here) or equal shares."""
    if t.rank_train_s is None:
        return []
    d = dp_size
    if len(t.rank_train_s) != d:
        raise ValueError(f"rank_train_s has {len(t.rank_train_s)} entries, dp_size={d}")
    if t.rank_train_samples is not None:
        samples = list(t.rank_train_samples)
        if len(samples) != d:
            raise ValueError(f"rank_train_samples has {len(samples)} entries, dp_size={d}")
    else:
        shares = planned_shares or [1.0 / d] * d
        samples = [s * t.rollout_responses for s in shares]
    out = []
    for r, (n, sec) in enumerate(zip(samples, t.rank_train_s, strict=True)):
        if not (sec > 0 and math.isfinite(sec)):
            raise ValueError(f"rank_train_s[{r}]={sec} must be finite and > 0 seconds")
        if not n >= 0:
            raise ValueError(f"rank_train_samples[{r}]={n} must be >= 0")
        out.append(n / sec)
    return out


class ModelEstimates:
    """Per trained model: noise estimate, signal fraction, batch unit, recent pre-clip norms;
    B_noise and its band read in responses of the rollout (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig, mini_batches: int, time_model: StepTimeModel):
        self.config, self.mini_batches = config, mini_batches
        self.time = time_model
        """The coordinator's step-time model: its smoothed tokens per response converts token units."""
        self.noise: dict[str, NoiseScaleEstimator] = {}
        self.signal: dict[str, Ema] = {}  # per model: fraction of responses its parts count
        self.units: dict[str, BatchUnit] = {}
        self.split: dict[str, SplitEstimator] = {}
        """Per model: the noise split by prompt (models whose probe reads it)."""
        self.norms: dict[str, list[tuple[float, float]]] = {}
        """Per model: (rollout responses, pre-clip |g|²) of its latest optimizer steps."""

    def record(
        self, updates: list[GradUpdate], norms: Mapping[str, Sequence[float]], responses: int, samples: int
    ) -> None:
        """Keep one step's checked statistics (``responses``: the step's rollout responses,
        ``samples``: its samples per prompt)."""
        for model, values in norms.items():
            kept = self.norms.setdefault(model, [])
            kept.extend((float(responses), v * v) for v in values)
            del kept[:-NORM_WINDOW]
        for u in updates:
            self.units[u.model] = u.unit
            self.estimator(u.model).update(u.g2, u.tr_sigma, dof=u.dof)
            self.signal.setdefault(u.model, Ema(self.config.ema_beta)).update(u.signal)
            if u.split is not None:
                est = self.split.setdefault(u.model, SplitEstimator(self.config.ema_beta, self.config.ema_dof))
                between, within, units = u.split
                est.update(between, within, units / samples, dof=u.dof)

    def estimator(self, model: str) -> NoiseScaleEstimator:
        if model not in self.noise:
            self.noise[model] = NoiseScaleEstimator(self.config.ema_beta, self.config.band_z, self.config.ema_dof)
        return self.noise[model]

    def signal_fraction(self, model: str) -> float:
        """Smoothed fraction of responses `model`'s parts count (1 before any step)."""
        f = self.signal[model].value if model in self.signal else None
        return 1.0 if f is None else f

    def to_responses(self, model: str, value: float) -> float | None:
        """Convert a per-sample quantity in the model's unit (B or tr Σ) to responses."""
        if self.units.get(model, "responses") == "responses":
            return value
        tpr = self.time.tokens_per_response
        return None if not tpr else value / tpr

    def b_noise_responses(self, model: str, b: float | None, calibrated: bool = True) -> float | None:
        """Batch-like quantity `b` of `model` (B_simple or a band end) in responses of the whole
        rollout, times ``noise_calibration`` unless ``calibrated`` is False (None while
        unresolved; inf stays inf)."""
        if b is None:
            return None
        r = self.to_responses(model, b * (self.config.noise_calibration if calibrated else 1.0))
        return None if r is None else r / self.signal_fraction(model)

    def b_noise(self, model: str, calibrated: bool = True) -> float | None:
        """`model`'s B_simple in responses of the rollout (None while unknown)."""
        est = self.noise.get(model)
        return self.b_noise_responses(model, est.b_simple if est is not None else None, calibrated)

    def per_rollout(self, b_noise: float | None) -> float | None:
        """A per-sample noise scale as the rollout batch whose optimizer steps reach it: a step
        trains on B/m of the rollout's B responses (m = mini_batches), and McCandlish's
        efficiency is per step, (B_noise + B0/m)/(B_noise + B/m) = (m·B_noise + B0)/(m·B_noise + B),
        so goodput over rollout batches takes m·B_noise."""
        return None if b_noise is None else b_noise * self.mini_batches

    def band_responses(self, model: str) -> tuple[float, float] | None:
        band = self.noise[model].band() if model in self.noise else None
        if band is None:
            return None
        lo, hi = (self.b_noise_responses(model, x) for x in band)
        return None if lo is None or hi is None else (lo, hi)

    def band_per_rollout(self, model: str) -> tuple[float, float] | None:
        band = self.band_responses(model)
        return None if band is None else (band[0] * self.mini_batches, band[1] * self.mini_batches)

    def share(self, model: str, samples: int) -> float | None:
        """The within-prompt share ω of `model`'s per-response noise at ``samples`` per prompt."""
        split = self.split.get(model)
        return None if split is None else split.share(samples)

    def metrics(self, samples: int) -> dict[str, float]:
        """Per model ``coord/*`` scalars of its estimates (`Coordinator.metrics` documents them);
        ``samples``: the current samples per prompt."""
        nan = math.nan
        out: dict[str, float] = {}
        for m in sorted(self.noise):
            est = self.noise[m]
            bn = self.b_noise(m)
            band = self.band_responses(m)
            out[f"coord/b_noise/{m}"] = nan if bn is None else bn
            out[f"coord/b_noise_low/{m}"] = nan if band is None else band[0]
            out[f"coord/b_noise_high/{m}"] = nan if band is None else band[1]
            out[f"coord/g2/{m}"] = nan if est.g2 is None else est.g2
            out[f"coord/tr_sigma/{m}"] = nan if est.tr_sigma is None else est.tr_sigma
            out[f"coord/noise_dof/{m}"] = est.dof
            out[f"coord/signal_fraction/{m}"] = self.signal_fraction(m)
        for m, split in sorted(self.split.items()):  # per unit of the model's batch unit, like tr_sigma
            out[f"coord/noise_between/{m}"] = nan if split.between is None else split.between
            out[f"coord/noise_within/{m}"] = nan if split.within is None else split.within
            share = split.share(samples)
            out[f"coord/noise_within_share/{m}"] = nan if share is None else share
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON types: ``units``, ``noise``, ``signal``, ``grad_norms`` (keys of the coordinator's state)."""
        return {
            "units": dict(self.units),
            "noise": {m: e.state_dict() for m, e in self.noise.items()},
            "signal": {m: e.state_dict() for m, e in self.signal.items()},
            "grad_norms": {m: [list(x) for x in v] for m, v in self.norms.items()},
            "split": {m: e.state_dict() for m, e in self.split.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the keys `state_dict` writes (from the coordinator's whole state)."""
        units: dict[str, BatchUnit] = {}
        for m, u in state["units"].items():
            if u not in ("responses", "tokens"):
                raise ValueError(f"coordinator state: units[{m!r}]={u!r} is not a batch unit")
            units[m] = "responses" if u == "responses" else "tokens"
        self.units = units
        self.noise = {}
        for m, s in state["noise"].items():
            self.estimator(m).load_state_dict(s)
        self.signal = {}
        for m, s in state["signal"].items():
            self.signal.setdefault(m, Ema(self.config.ema_beta)).load_state_dict(s)
        # (absent from checkpoints written before the rescale followed clipping: none kept)
        self.norms = {m: [(float(b), float(sq)) for b, sq in v] for m, v in state.get("grad_norms", {}).items()}
        self.split = {}
        for m, s in state.get("split", {}).items():  # (absent before the noise split)
            self.split[m] = SplitEstimator(self.config.ema_beta, self.config.ema_dof)
            self.split[m].load_state_dict(s)
