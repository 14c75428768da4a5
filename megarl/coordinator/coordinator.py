"""Critical-batch-size coordinator: gradient statistics + timings in, a step plan out.

Each step the trainer reports, per trained model, the squared norms of the rank-local
gradients and of the all-reduced gradient (`ModelGradStats`), the optimizer's pre-clip
gradient norm at each of its steps, and the phase timings (`StepTimings`). The coordinator
turns them into:

1. a noise scale per model, B_simple = EMA(tr Σ)/EMA(|G|²) with each step weighted by its
   degrees of freedom (`noise.py`, McCandlish et al. 2018), converted to **responses** (the
   batch unit of the plan: a token-unit estimate is divided by the smoothed tokens per
   response, and an estimate over responses with reward signal by the smoothed fraction f
   of such responses — B responses carry f·B useful ones, so B_noise = B_noise,signal/f);
2. a step-time model t(B) = t_gen(B) + t_logprobs(B) + t_train(B) + t_other (`throughput.py`);
3. the prompt count maximising goodput(B) = B/t(B)·(B_noise + B0/m)/(B_noise + B/m) on a
   geometric grid (m = `mini_batches`: McCandlish's model is per optimizer step, and a step
   trains on B/m of the rollout's B responses) (`goodput.py`, Pollux OSDI'21): a first jump straight to the argmax once the
   estimate has `min_dof` degrees of freedom, then a hold while the batch lies inside the
   band of optima of the B_noise band (`decisions.py`). With several models the smallest
   B_noise decides (the most batch-sensitive model);
4. a learning rate per model from its reference (b_ref = `lr_reference_batch`, lr_ref) and
   the planned batch (`lr_rules.py`, batches per optimizer step), clipped to [lr_min, lr_max],
   and on a batch change the factor for Adam's second moments: the change of the post-clip
   squared norm the optimizer is handed (`decisions.adam_v_scale`, from the raw estimate and the
   recent pre-clip norms);
5. per-DP-rank shares of the batch proportional to each rank's smoothed training throughput
   (responses/s), so that ranks finish together — equal under expert parallelism
   (`CoordinatorRun.equal_shares`: an EP group's ranks must run the same micro-batches).

Protocol: `observe(step, ...)` after step `step` finished; `next_plan()` returns the plan for
step `last observed + 1` (step 0 before any observation). The plan is cached per step, so
repeated calls return the same object, and the coordinator assumes the plan is executed.

Records live in `records.py`, settings in `config.py`, the per-model estimates (and the
checks a step's reports pass before they are kept) in `estimates.py`.

Invariants: pure Python, single process, deterministic. `state_dict()` holds only JSON
types, and a coordinator restored from it produces identical plans for identical inputs.
"""

from __future__ import annotations

import math
from typing import Any

from megarl.config import CoordinatorConfig
from megarl.coordinator.config import CoordinatorRun, grid, validate
from megarl.coordinator.decisions import adam_v_scale, hold_or_move, jump, limit_move
from megarl.coordinator.estimates import ModelEstimates, check_grad_norms, grad_updates, rank_throughputs
from megarl.coordinator.goodput import goodput
from megarl.coordinator.lr_rules import LrInputs, apply_lr_rule
from megarl.coordinator.noise import NoiseScaleEstimator
from megarl.coordinator.noise_split import effective_batch
from megarl.coordinator.records import ModelGradStats, StepPlan, StepTimings
from megarl.coordinator.samples import best_prompts_and_samples, near
from megarl.coordinator.throughput import Ema, StepTimeModel

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorRun", "ModelGradStats", "StepPlan", "StepTimings"]

STATE_VERSION = 2
"""2: degrees-of-freedom weighted noise EMAs, log-prob time model, signal fraction (and,
optional in it, the recent pre-clip grad norms)."""


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
        self._samples = run.samples_per_prompt
        """Samples per prompt of the latest plan (changes only with choose=prompts_and_samples)."""
        self._last_switch_step: int | None = None
        self._settled = False  # the first decision (jump to the argmax) was taken
        self._time = StepTimeModel(
            window=config.time_window,
            prior_fixed_fraction=config.prior_fixed_fraction,
            ema_beta=config.ema_beta,
        )
        self._est = ModelEstimates(config, run.mini_batches, self._time)
        self._rank_tput = [Ema(config.ema_beta) for _ in range(run.dp_size)]
        self._plan: StepPlan | None = None

    # ----------------------------------------------------------------- observe
    def observe(
        self,
        step: int,
        grads: list[ModelGradStats],
        timings: StepTimings,
        grad_norms: dict[str, list[float]] | None = None,
    ) -> None:
        """Record gradient statistics and timings of the finished step `step`; ``grad_norms``:
        per model, the optimizer's global grad norm before clipping at each of its steps this
        rollout (all mini-batches and PPO epochs), which Adam's rescale follows.

        Everything is validated before any state changes, so a rejected call (ValueError)
        leaves the coordinator exactly as it was.
        """
        if step <= self._last_step:
            raise ValueError(f"observe(step={step}) after step {self._last_step}: steps must increase")
        updates = grad_updates(grads, self.run.lr_ref, self._est.units)
        timings.validate()
        planned = self._plan.dp_shares if self._plan and self._plan.step == step else None
        rank_tput = rank_throughputs(timings, self.run.dp_size, planned)
        norms = grad_norms or {}
        check_grad_norms(norms, self.run.lr_ref)
        self._est.record(updates, norms, timings.rollout_responses, self._samples)
        self._time.observe(
            responses=timings.rollout_responses,
            tokens=timings.rollout_tokens,
            generate_s=timings.generate_s,
            logprobs_s=timings.logprobs_s,
            train_s=timings.train_s,
            other_s=timings.other_s,
            train_fixed_s=timings.train_fixed_s,
            logprobs_fixed_s=timings.logprobs_fixed_s,
        )

        for ema, x in zip(self._rank_tput, rank_tput, strict=True) if rank_tput else ():
            ema.update(x)
        self._last_step = step
        self._observed += 1

    def noise_estimator(self, model: str) -> NoiseScaleEstimator | None:
        """The raw estimator for `model` (in the model's batch unit, signal samples), if observed."""
        return self._est.noise.get(model)

    def signal_fraction(self, model: str) -> float:
        """Smoothed fraction of responses `model`'s parts count (1 before any step)."""
        return self._est.signal_fraction(model)

    # -------------------------------------------------------------------- plan
    def _decision_values(self) -> dict[str, float | None]:
        """B_noise of each model that plans the batch, per rollout (`ModelEstimates.per_rollout`);
        an observed but unresolved one is inf with ``unresolved_as_infinite``, else None."""
        est = self._est
        models = self.run.batch_models or sorted(est.noise)
        values = {m: est.per_rollout(est.b_noise(m)) for m in models}
        if self.config.unresolved_as_infinite:
            return {m: math.inf if v is None and m in est.noise else v for m, v in values.items()}
        return values

    def _decision(self) -> tuple[str, float] | None:
        """(model, B_noise in responses) of the model that decides (the smallest B_noise);
        None until every model's is known."""
        values = self._decision_values()
        known = {m: v for m, v in values.items() if v is not None}
        if not known or len(known) != len(values):
            return None
        model = min(known, key=lambda m: known[m])
        return model, known[model]

    def _lr(self, model: str, b: float) -> float:
        cfg = self.config
        lr_ref = self.run.lr_ref[model]
        if not cfg.adapt:
            return lr_ref
        est = self._est.noise.get(model)
        g2 = est.g2 if est is not None else None
        tr = est.tr_sigma if est is not None else None
        tr_resp = None if tr is None else self._est.b_noise_responses(model, tr)
        m = self.run.mini_batches  # the rules are about the optimizer step's batch
        inputs = LrInputs(
            b=b / m,
            b_ref=float(self.run.b_ref.get(model, self.run.initial_batch)) / m,
            lr_ref=lr_ref,
            g2=g2 if tr_resp is not None else None,
            tr_sigma=tr_resp,
            b_noise=self._est.b_noise_responses(model, est.b_simple if est is not None else None),
        )
        return apply_lr_rule(cfg.lr_rule, inputs, lr_min=cfg.lr_min, lr_max=cfg.lr_max)

    def _dp_shares(self) -> list[float]:
        d = self.run.dp_size
        values = [e.value for e in self._rank_tput]
        if not self.config.adapt or self.run.equal_shares or any(v is None or v <= 0 for v in values):
            return [1.0 / d] * d
        tput = [float(v) for v in values if v is not None]
        total = sum(tput)
        return [v / total for v in tput]

    def _choose(self, step: int, decision: tuple[str, float] | None) -> tuple[int, int, str]:
        """(prompts, samples per prompt, why) of the next plan."""
        cfg = self.config
        cur, spp = self._prompts, self._samples
        if not cfg.adapt:
            return cur, spp, "disabled"
        if self._observed < cfg.warmup_steps:
            return cur, spp, f"warmup ({self._observed}/{cfg.warmup_steps} steps observed)"
        if self._last_switch_step is not None and step - self._last_switch_step < cfg.cooldown_steps:
            return cur, spp, f"cooldown (changed at step {self._last_switch_step})"
        if decision is None:
            return cur, spp, "keep: noise scale not resolved yet"
        model, b_noise = decision
        if not self._time.ready:
            return cur, spp, "keep: no timings yet"
        b0 = float(self.run.initial_batch)
        if not self._settled:
            dof = self._est.noise[model].dof
            if dof < cfg.min_dof:
                return cur, spp, f"keep: noise estimate has {dof:.3g} degrees of freedom < min_dof={cfg.min_dof:g}"
        both = self._both(model, b_noise, b0)
        if both is not None:  # choose=prompts_and_samples, and the best S is another one
            self._settled = True
            return both
        if not self._settled:
            self._settled = True
            d = jump(self.grid, b_noise, self._time, cur, b0)
            if math.isinf(b_noise):  # no upper bound yet: a step, not a leap to the grid's top
                step_to = limit_move(self.grid, cur, d.prompts, cfg.track_factor)
                return step_to, spp, f"{d.reason}; |G|² not resolved: limited to {step_to} prompts"
        else:
            band = self._est.band_per_rollout(model)
            d = hold_or_move(
                self.grid, b_noise, band, self._time, cur, min_gain=cfg.min_gain, b0=b0, band_ratio=cfg.band_ratio
            )
            step_to = limit_move(self.grid, cur, d.prompts, cfg.track_factor)
            if step_to != d.prompts:
                return step_to, spp, f"{d.reason}; limited to {step_to} prompts (track_factor={cfg.track_factor:g})"
        return d.prompts, spp, d.reason

    def _both(self, model: str, b_noise: float, b0: float) -> tuple[int, int, str] | None:
        """choose=prompts_and_samples: the (P, S) goodput argmax when its S differs from the current
        one and it gains more than min_gain (any gain for the first decision); None otherwise (the
        prompts are then chosen at the current S as in choose=total), or while the split is unknown."""
        share = self._est.share(model, self._samples)
        if self.config.choose != "prompts_and_samples" or share is None or math.isinf(b_noise):
            return None
        layouts = (
            self.run.samples_layouts
            if not self._settled
            else near(self.run.samples_layouts, self._samples, self.config.track_factor)
        )
        grids = {x.samples: grid(self.config, self.run, x) for x in layouts}
        gain = self.config.min_gain if self._settled else 0.0
        c = best_prompts_and_samples(
            grids,
            b_noise,
            share,
            self._time,
            (self._prompts, self._samples),
            b0=b0,
            min_gain=gain,
            prompt_s=self.config.prompt_cost_s,
            factor=self.config.track_factor if self._settled else 0.0,
        )
        return (c.prompts, c.samples, c.reason) if c.samples != self._samples else None

    def effective_batch(self, prompts: int, samples: int) -> float:
        """The batch at the run's starting S as noisy as ``prompts`` × ``samples`` (the deciding
        model's split, `noise_split.effective_batch`); prompts × samples in choose=total, or while
        the split is unknown: the batch the LR rules and Adam's rescale follow."""
        s0 = self.run.samples_per_prompt
        decision = self._decision() if self.config.choose == "prompts_and_samples" else None
        share = None if decision is None else self._est.share(decision[0], s0)
        return float(prompts * samples) if share is None else effective_batch(prompts, samples, share, s0)

    def next_plan(self) -> StepPlan:
        """Plan for step last_observed + 1 (cached: repeated calls return the same plan)."""
        step = self._last_step + 1
        if self._plan is not None and self._plan.step == step:
            return self._plan
        decision = self._decision()
        b_noise = None if decision is None else decision[1]
        old, old_eff = self._prompts * self._samples, self.effective_batch(self._prompts, self._samples)
        prompts, samples, reason = self._choose(step, decision)
        b = prompts * samples
        v_scale: dict[str, float] = {}
        if (prompts, samples) != (self._prompts, self._samples):
            if self._time.ready:  # what the move was planned on, for the log line (Planner)
                reason += f"; predicted step {self._time.predict(old):.3g} s at {old} -> {self._time.predict(b):.3g} s at {b} responses"
            if samples != self._samples:
                self.grid = next(
                    grid(self.config, self.run, x) for x in self.run.samples_layouts if x.samples == samples
                )
            self._prompts, self._samples = prompts, samples
            self._last_switch_step = step
            if self.config.adam_rescale:
                new_eff = self.effective_batch(prompts, samples)
                v_scale = {m: self._adam_v_scale(m, old_eff, new_eff) for m in sorted(self.run.lr_ref)}
        predicted: float | None = None
        if b_noise is not None and self._time.ready:
            predicted = goodput(float(b), b_noise, float(self.run.initial_batch), self._time.predict(b))
        self._plan = StepPlan(
            step=step,
            num_prompts=prompts,
            samples_per_prompt=samples,
            lr={m: self._lr(m, self.effective_batch(prompts, samples)) for m in sorted(self.run.lr_ref)},
            dp_shares=self._dp_shares(),
            predicted_goodput=predicted,
            b_noise={m: self._est.b_noise(m) for m in sorted(self._est.noise)},
            reason=reason,
            adam_v_scale=v_scale,
        )
        return self._plan

    def _adam_v_scale(self, model: str, old: float, new: float) -> float:
        """Rule 3 of `decisions` for a change old -> new rollout responses: per optimizer step
        (B/m), from the *raw* noise scale (``noise_calibration`` corrects the batch decision,
        not E|g_B|²) and the model's recent pre-clip norms under the run's clip."""
        m = self.run.mini_batches
        return adam_v_scale(
            old / m,
            new / m,
            self._est.b_noise(model, calibrated=False),
            sq_norms=[(b / m, sq) for b, sq in self._est.norms.get(model, [])],
            clip=self.run.clip_grad,
        )

    # ----------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics path; unknown values are NaN, unbounded ones inf.

        b_noise* are in responses of the whole rollout, g2/tr_sigma in the model's own batch
        unit (samples with reward signal); noise_dof is the estimate's discounted degrees of
        freedom; lr, batch and goodput_pred (B0-equivalent responses/s, B0 = initial batch)
        describe the latest plan; noise_between/within (per unit of the model's batch unit) and
        noise_within_share (at the current samples per prompt) are the noise split by prompt.
        """
        nan = math.nan
        out = self._est.metrics(self._samples)
        b = self._prompts * self._samples
        out["coord/batch"] = float(b)
        out["coord/prompts"] = float(self._prompts)
        if self.config.choose == "prompts_and_samples":
            out["coord/samples_per_prompt"] = float(self._samples)
            out["coord/effective_batch"] = self.effective_batch(self._prompts, self._samples)
        plan = self._plan
        for m in sorted(self.run.lr_ref):
            out[f"coord/lr/{m}"] = (
                plan.lr[m] if plan is not None else self._lr(m, self.effective_batch(self._prompts, self._samples))
            )
            if plan is not None and m in plan.adam_v_scale:
                out[f"coord/adam_v_scale/{m}"] = plan.adam_v_scale[m]
        pg = plan.predicted_goodput if plan is not None else None
        out["coord/goodput_pred"] = nan if pg is None else pg
        tpr = self._time.tokens_per_response
        out["coord/tokens_per_response"] = nan if tpr is None else tpr
        out["coord/gen_tokens_per_s"] = self._time.generation_tokens_per_s(b) if self._time.ready else nan
        out["coord/time_eras"] = float(self._time.eras)
        for phase in ("logprobs", "train"):  # the prior's fixed share at one batch size (measured, else the setting)
            out[f"coord/time_fixed_frac/{phase}"] = getattr(self._time, phase).fixed_fraction
        for r, share in enumerate((plan.dp_shares if plan is not None else None) or self._dp_shares()):
            out[f"coord/dp_share/{r}"] = share
        return out

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (config excluded: pass the same config on resume)."""
        est = self._est.state_dict()
        return {
            "version": STATE_VERSION,
            "last_step": self._last_step,
            "observed": self._observed,
            "prompts": self._prompts,
            "last_switch_step": self._last_switch_step,
            "settled": self._settled,
            "units": est["units"],
            "noise": est["noise"],
            "signal": est["signal"],
            "time": self._time.state_dict(),
            "grad_norms": est["grad_norms"],
            "rank_tput": [e.state_dict() for e in self._rank_tput],
            "plan": None if self._plan is None else self._plan.to_dict(),
            **({"split": est["split"], "samples": self._samples} if est["split"] else {}),  # (the noise split)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output into a coordinator built with the same config."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"coordinator state version {state.get('version')!r}, expected {STATE_VERSION} "
                "(version 1 checkpoints predate the degrees-of-freedom weighted estimator: "
                "resume with train.resume=never or coordinator.enabled=false)"
            )
        if len(state["rank_tput"]) != self.run.dp_size:
            raise ValueError(
                f"coordinator state has {len(state['rank_tput'])} DP ranks, config dp_size={self.run.dp_size}"
            )
        self._last_step = int(state["last_step"])
        self._observed = int(state["observed"])
        self._prompts = int(state["prompts"])
        self._samples = int(state.get("samples", self.run.samples_per_prompt))
        if self._samples != self.run.samples_per_prompt:
            self.grid = next(
                grid(self.config, self.run, x) for x in self.run.samples_layouts if x.samples == self._samples
            )
        lss = state["last_switch_step"]
        self._last_switch_step = None if lss is None else int(lss)
        self._settled = bool(state["settled"])
        self._est.load_state_dict(state)  # units, noise, signal, grad_norms
        self._time.load_state_dict(state["time"])
        for e, s in zip(self._rank_tput, state["rank_tput"], strict=True):
            e.load_state_dict(s)
        self._plan = None if state["plan"] is None else StepPlan.from_dict(state["plan"])
