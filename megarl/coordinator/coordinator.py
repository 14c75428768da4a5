"""Critical-batch-size coordinator: gradient statistics + timings in, a step plan out.

Each step the trainer reports, per trained model, the squared norms of the rank-local
gradients and of the all-reduced gradient (`ModelGradStats`), and the phase timings
(`StepTimings`). The coordinator turns them into:

1. a noise scale per model, B_simple = EMA(tr Σ)/EMA(|G|²) (`noise.py`, McCandlish et al.
   2018), converted to **responses** (the batch unit of the plan; a token-unit estimate is
   divided by the smoothed tokens per response);
2. a step-time model t(B) = t_gen(B) + t_train(B) + t_other (`throughput.py`);
3. the prompt count maximising goodput(B) = B/t(B)·(B_noise + B0)/(B_noise + B) on a
   geometric grid, with hysteresis (`goodput.py`, Pollux OSDI'21). With several models the
   smallest B_noise decides (the most batch-sensitive model);
4. a learning rate per model from its reference (b_ref, lr_ref) and the planned batch
   (`lr_rules.py`), clipped to [lr_min, lr_max];
5. per-DP-rank shares of the batch proportional to each rank's smoothed training throughput
   (responses/s), so that ranks finish together.

Protocol: `observe(step, ...)` after step `step` finished; `next_plan()` returns the plan for
step `last observed + 1` (step 0 before any observation). The plan is cached per step, so
repeated calls return the same object, and the coordinator assumes the plan is executed.

Records live in `records.py`, settings in `config.py`.

Invariants: pure Python, single process, deterministic. `state_dict()` holds only JSON
types, and a coordinator restored from it produces identical plans for identical inputs.
"""

from __future__ import annotations

import math
from typing import Any

from megarl.config import CoordinatorConfig
from megarl.coordinator.config import CoordinatorRun, grid, validate
from megarl.coordinator.goodput import choose_batch, goodput
from megarl.coordinator.lr_rules import LrInputs, apply_lr_rule
from megarl.coordinator.noise import (
    KIND_ADAM,
    KIND_PLAIN,
    NoiseKind,
    NoiseScaleEstimator,
    dp_estimates,
    microbatch_estimates,
)
from megarl.coordinator.records import BatchUnit, ModelGradStats, StepPlan, StepTimings
from megarl.coordinator.throughput import Ema, StepTimeModel

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorRun", "ModelGradStats", "StepPlan", "StepTimings"]

STATE_VERSION = 1

_GradUpdate = tuple[str, BatchUnit, tuple[float, float], tuple[float, float] | None]
"""(model, batch unit, (|G|², tr Σ), preconditioned (|G|², tr Σ) or None)."""


class Coordinator:
    """Stateful planner; see the module docstring for the protocol."""

    def __init__(self, config: CoordinatorConfig, run: CoordinatorRun):
        validate(config, run)
        self.config = config
        self.run = run
        self.grid = grid(config, run)
        self._last_step = -1
        self._observed = 0
        self._prompts = run.initial_prompts
        self._last_switch_step: int | None = None
        self._noise: dict[str, NoiseScaleEstimator] = {}
        self._noise_adam: dict[str, NoiseScaleEstimator] = {}
        self._units: dict[str, BatchUnit] = {}
        self._time = StepTimeModel(
            window=config.time_window,
            prior_fixed_fraction=config.prior_fixed_fraction,
            ema_beta=config.ema_beta,
        )
        self._rank_tput = [Ema(config.ema_beta) for _ in range(run.dp_size)]
        self._plan: StepPlan | None = None

    # ----------------------------------------------------------------- observe
    def observe(self, step: int, grads: list[ModelGradStats], timings: StepTimings) -> None:
        """Record gradient statistics and timings of the finished step `step`.

        Everything is validated before any state changes, so a rejected call (ValueError)
        leaves the coordinator exactly as it was.
        """
        if step <= self._last_step:
            raise ValueError(f"observe(step={step}) after step {self._last_step}: steps must increase")
        updates = self._grad_updates(grads)
        timings.validate()
        rank_tput = self._rank_throughputs(step, timings)
        for model, unit, plain, adam in updates:
            self._units[model] = unit
            self._estimator(self._noise, model, KIND_PLAIN).update(*plain)
            if adam is not None:
                self._estimator(self._noise_adam, model, KIND_ADAM).update(*adam)
        self._time.observe(
            responses=timings.rollout_responses,
            tokens=timings.rollout_tokens,
            generate_s=timings.generate_s,
            train_s=timings.train_s,
            other_s=timings.other_s,
        )
        for ema, x in zip(self._rank_tput, rank_tput, strict=True) if rank_tput else ():
            ema.update(x)
        self._last_step = step
        self._observed += 1

    def _estimator(self, table: dict[str, NoiseScaleEstimator], model: str, kind: NoiseKind) -> NoiseScaleEstimator:
        if model not in table:
            table[model] = NoiseScaleEstimator(self.config.ema_beta, kind, self.config.band_z)
        return table[model]

    def _grad_updates(self, grads: list[ModelGradStats]) -> list[_GradUpdate]:
        """Per model: (name, unit, (|G|², tr Σ), preconditioned pair or None); no mutation."""
        out: list[_GradUpdate] = []
        seen: set[str] = set()
        for g in grads:
            if g.model not in self.run.lr_ref:
                raise ValueError(
                    f"model {g.model!r} has no lr_ref in CoordinatorRun (known: {sorted(self.run.lr_ref)})"
                )
            if g.model in seen:
                raise ValueError(f"model {g.model!r} appears twice in one step's grads")
            seen.add(g.model)
            if g.batch_unit not in ("responses", "tokens"):
                raise ValueError(f"model {g.model!r}: batch_unit={g.batch_unit!r} must be 'responses' or 'tokens'")
            if self._units.get(g.model, g.batch_unit) != g.batch_unit:
                raise ValueError(
                    f"model {g.model!r} reported batch_unit={g.batch_unit!r} but earlier steps "
                    f"used {self._units[g.model]!r}"
                )
            if g.source not in ("dp", "microbatch"):
                raise ValueError(f"model {g.model!r}: source={g.source!r} must be 'dp' or 'microbatch'")
            estimate = dp_estimates if g.source == "dp" else microbatch_estimates
            plain = estimate(g.local_sq_norms, g.local_batches, g.global_sq_norm, grad_average=g.grad_average)
            adam: tuple[float, float] | None = None
            if g.precond_local_sq_norms is not None and g.precond_global_sq_norm is not None:
                adam = estimate(
                    g.precond_local_sq_norms,
                    g.local_batches,
                    g.precond_global_sq_norm,
                    grad_average=g.grad_average,
                )
            elif self.config.noise_kind == KIND_ADAM:
                raise ValueError(
                    "noise_kind='adam' needs precond_local_sq_norms and precond_global_sq_norm "
                    f"for model {g.model!r}; got None"
                )
            for name, value in (("|G|^2", plain[0]), ("tr(Sigma)", plain[1])):
                if not math.isfinite(value):
                    raise ValueError(f"model {g.model!r}: non-finite {name} estimate {value}")
            out.append((g.model, g.batch_unit, plain, adam))
        return out

    def _rank_throughputs(self, step: int, t: StepTimings) -> list[float]:
        """Per-rank responses/s of this step (empty when rank timings were not reported)."""
        if t.rank_train_s is None:
            return []
        d = self.run.dp_size
        if len(t.rank_train_s) != d:
            raise ValueError(f"rank_train_s has {len(t.rank_train_s)} entries, dp_size={d}")
        if t.rank_train_samples is not None:
            samples = list(t.rank_train_samples)
            if len(samples) != d:
                raise ValueError(f"rank_train_samples has {len(samples)} entries, dp_size={d}")
        else:
            shares = self._plan.dp_shares if self._plan and self._plan.step == step else None
            shares = shares or [1.0 / d] * d
            samples = [s * t.rollout_responses for s in shares]
        out = []
        for r, (n, sec) in enumerate(zip(samples, t.rank_train_s, strict=True)):
            if not (sec > 0 and math.isfinite(sec)):
                raise ValueError(f"rank_train_s[{r}]={sec} must be finite and > 0 seconds")
            if not n >= 0:
                raise ValueError(f"rank_train_samples[{r}]={n} must be >= 0")
            out.append(n / sec)
        return out

    def noise_estimator(self, model: str, kind: NoiseKind = KIND_PLAIN) -> NoiseScaleEstimator | None:
        """The raw estimator of `kind` for `model` (in the model's batch unit), if observed."""
        return (self._noise_adam if kind == KIND_ADAM else self._noise).get(model)

    # -------------------------------------------------------------------- plan
    def _decision_estimator(self, model: str) -> NoiseScaleEstimator | None:
        """The estimator of kind `config.noise_kind` for `model` (None if never observed)."""
        table = self._noise_adam if self.config.noise_kind == KIND_ADAM else self._noise
        return table.get(model)

    def _b_noise_responses(self, model: str, est: NoiseScaleEstimator | None) -> float | None:
        """Calibrated B_simple of `est` in responses (None while unresolved)."""
        b = est.b_simple if est is not None else None
        return None if b is None else self._to_responses(model, b * self.config.noise_calibration)

    def _to_responses(self, model: str, value: float) -> float | None:
        """Convert a per-sample quantity in the model's unit (B or tr Σ) to responses."""
        if self._units.get(model, "responses") == "responses":
            return value
        tpr = self._time.tokens_per_response
        return None if not tpr else value / tpr

    def _decision_b_noise(self) -> float | None:
        models = self.run.batch_models or sorted(self._noise)
        values = [self._b_noise_responses(m, self._decision_estimator(m)) for m in models]
        known = [v for v in values if v is not None]
        return min(known) if known and len(known) == len(values) else None

    def _lr(self, model: str, b: int) -> float:
        cfg = self.config
        lr_ref = self.run.lr_ref[model]
        if not cfg.adapt:
            return lr_ref
        est = self._decision_estimator(model)
        g2 = est.g2 if est is not None else None
        tr = est.tr_sigma if est is not None else None
        tr_resp = None if tr is None else self._to_responses(model, tr * cfg.noise_calibration)
        inputs = LrInputs(
            b=float(b),
            b_ref=float(self.run.b_ref.get(model, self.run.initial_batch)),
            lr_ref=lr_ref,
            g2=g2 if tr_resp is not None else None,
            tr_sigma=tr_resp,
            b_noise=self._b_noise_responses(model, est),
        )
        return apply_lr_rule(cfg.lr_rule, inputs, lr_min=cfg.lr_min, lr_max=cfg.lr_max)

    def _dp_shares(self) -> list[float]:
        d = self.run.dp_size
        values = [e.value for e in self._rank_tput]
        if not self.config.adapt or any(v is None or v <= 0 for v in values):
            return [1.0 / d] * d
        tput = [float(v) for v in values if v is not None]
        total = sum(tput)
        return [v / total for v in tput]

    def _choose(self, step: int, b_noise: float | None) -> tuple[int, str]:
        cfg = self.config
        cur = self._prompts
        if not cfg.adapt:
            return cur, "disabled"
        if self._observed < cfg.warmup_steps:
            return cur, f"warmup ({self._observed}/{cfg.warmup_steps} steps observed)"
        if self._last_switch_step is not None and step - self._last_switch_step < cfg.cooldown_steps:
            return cur, f"cooldown (changed at step {self._last_switch_step})"
        if b_noise is None:
            return cur, "keep: noise scale not resolved yet"
        if not self._time.ready:
            return cur, "keep: no timings yet"
        choice = choose_batch(
            self.grid, b_noise, self._time, cur, min_gain=cfg.min_gain, b0=float(self.run.initial_batch)
        )
        return choice.num_prompts, choice.reason

    def next_plan(self) -> StepPlan:
        """Plan for step last_observed + 1 (cached: repeated calls return the same plan)."""
        step = self._last_step + 1
        if self._plan is not None and self._plan.step == step:
            return self._plan
        b_noise = self._decision_b_noise()
        prompts, reason = self._choose(step, b_noise)
        if prompts != self._prompts:
            self._prompts = prompts
            self._last_switch_step = step
        b = prompts * self.run.samples_per_prompt
        predicted: float | None = None
        if b_noise is not None and self._time.ready:
            predicted = goodput(float(b), b_noise, float(self.run.initial_batch), self._time.predict(b))
        self._plan = StepPlan(
            step=step,
            num_prompts=prompts,
            samples_per_prompt=self.run.samples_per_prompt,
            lr={m: self._lr(m, b) for m in sorted(self.run.lr_ref)},
            dp_shares=self._dp_shares(),
            predicted_goodput=predicted,
            b_noise={m: self._b_noise_responses(m, self._decision_estimator(m)) for m in sorted(self._noise)},
            reason=reason,
        )
        return self._plan

    # ----------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics path; unknown values are NaN, unbounded ones inf.

        Noise keys use the decision estimator (`noise_kind`); b_noise* are in responses,
        g2/tr_sigma in the model's own batch unit; lr, batch and goodput_pred (B0-equivalent
        responses/s, B0 = initial batch) describe the latest plan.
        """
        nan = math.nan
        out: dict[str, float] = {}
        scale = self.config.noise_calibration
        for m in sorted(self._noise):
            est = self._decision_estimator(m)
            bn = self._b_noise_responses(m, est)
            band = est.band() if est is not None else None
            lo = None if band is None else self._to_responses(m, band[0] * scale)
            hi = None if band is None else self._to_responses(m, band[1] * scale)
            g2 = est.g2 if est is not None else None
            tr = est.tr_sigma if est is not None else None
            out[f"coord/b_noise/{m}"] = nan if bn is None else bn
            out[f"coord/b_noise_low/{m}"] = nan if lo is None else lo
            out[f"coord/b_noise_high/{m}"] = nan if hi is None else hi
            out[f"coord/g2/{m}"] = nan if g2 is None else g2
            out[f"coord/tr_sigma/{m}"] = nan if tr is None else tr
            other = self._noise_adam if self.config.noise_kind == KIND_PLAIN else self._noise
            if m in other:
                bo = self._b_noise_responses(m, other[m])
                out[f"coord/b_noise_{other[m].kind}/{m}"] = nan if bo is None else bo
        b = self._prompts * self.run.samples_per_prompt
        out["coord/batch"] = float(b)
        out["coord/prompts"] = float(self._prompts)
        plan = self._plan
        for m in sorted(self.run.lr_ref):
            out[f"coord/lr/{m}"] = plan.lr[m] if plan is not None else self._lr(m, b)
        pg = plan.predicted_goodput if plan is not None else None
        out["coord/goodput_pred"] = nan if pg is None else pg
        tpr = self._time.tokens_per_response
        out["coord/tokens_per_response"] = nan if tpr is None else tpr
        out["coord/gen_tokens_per_s"] = self._time.generation_tokens_per_s(b) if self._time.ready else nan
        for r, share in enumerate((plan.dp_shares if plan is not None else None) or self._dp_shares()):
            out[f"coord/dp_share/{r}"] = share
        return out

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (config excluded: pass the same config on resume)."""
        return {
            "version": STATE_VERSION,
            "last_step": self._last_step,
            "observed": self._observed,
            "prompts": self._prompts,
            "last_switch_step": self._last_switch_step,
            "units": dict(self._units),
            "noise": {m: e.state_dict() for m, e in self._noise.items()},
            "noise_adam": {m: e.state_dict() for m, e in self._noise_adam.items()},
            "time": self._time.state_dict(),
            "rank_tput": [e.state_dict() for e in self._rank_tput],
            "plan": None if self._plan is None else self._plan.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output into a coordinator built with the same config."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"coordinator state version {state.get('version')!r}, expected {STATE_VERSION}")
        if len(state["rank_tput"]) != self.run.dp_size:
            raise ValueError(
                f"coordinator state has {len(state['rank_tput'])} DP ranks, config dp_size={self.run.dp_size}"
            )
        self._last_step = int(state["last_step"])
        self._observed = int(state["observed"])
        self._prompts = int(state["prompts"])
        lss = state["last_switch_step"]
        self._last_switch_step = None if lss is None else int(lss)
        units: dict[str, BatchUnit] = {}
        for m, u in state["units"].items():
            if u not in ("responses", "tokens"):
                raise ValueError(f"coordinator state: units[{m!r}]={u!r} is not a batch unit")
            units[m] = "responses" if u == "responses" else "tokens"
        self._units = units
        self._noise = {}
        for m, s in state["noise"].items():
            self._estimator(self._noise, m, KIND_PLAIN).load_state_dict(s)
        self._noise_adam = {}
        for m, s in state["noise_adam"].items():
            self._estimator(self._noise_adam, m, KIND_ADAM).load_state_dict(s)
        self._time.load_state_dict(state["time"])
        for e, s in zip(self._rank_tput, state["rank_tput"], strict=True):
            e.load_state_dict(s)
        self._plan = None if state["plan"] is None else StepPlan.from_dict(state["plan"])
