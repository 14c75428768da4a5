"""The RL loop: numbered phases of one step, each in a named timer.

    0 plan → 1 generate → 2 logprobs → 3 advantages → 4 update → 5 sync → 6 observe

With ``rollout.max_staleness`` = k > 0 phase 1 takes the batch generated k steps ahead and
issues the next one, which the fleet generates during phases 2–4 (``megarl.rollout.pipeline``);
the trainer waits for it before the sync. ``timing/step/generate`` is the trainer's wait for
rollouts either way, and ``pipeline/*`` logs each sample's lag and who waited.

The loop holds no algorithm math (``megarl.algo``) and no transport details
(``megarl.weight_sync``); it only calls the phases over the run's components
(``megarl.components``) and logs what they measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from megarl.checkpoint import state
from megarl.components import Components, add_reference_and_critic, build
from megarl.config import RunConfig, TrainConfig, to_dict
from megarl.coordinator import StepPlan
from megarl.fleet import faults
from megarl.metrics import MetricsLogger, Timer
from megarl.update import evaluate, mismatch
from megarl.warm_start import WarmStartSettings, warm_start

log = logging.getLogger("megarl")


def rl_step(c: Components, step: int) -> dict[str, float]:
    assert c.updater is not None
    timer = Timer()
    t0 = time.perf_counter()
    if c.ahead is not None:  # rollout.max_staleness > 0: later steps' batches generate during this update
        with timer("generate"):
            _issue_ahead(c, step)
    plan = c.planner.plan(step)  # batch and LR per model: fixed, or from the coordinator (made ahead if pipelined)
    with timer("generate"):  # 1. sample responses on the fleet and score them (or take the batch made ahead)
        batch, metrics = c.ahead.take(step) if c.ahead is not None else c.rollouts.collect(step, *plan_size(plan))
    lag = c.publisher.version - batch.sample_versions()  # policy versions each sample lags the trainer
    metrics["rollout/responses"] = float(batch.size)  # on every rank (the other rollout stats: rank 0's)
    w0 = microbatch_s(c)
    with timer("logprobs"):  # 2. old-policy / reference log-probs, critic values (Megatron forward)
        if c.fleet is not None and c.ahead is None:  # test-only: an engine killed while idle (fleet/faults.py)
            faults.inject("logprobs", c.publisher.version, c.fleet.engines)
        ev = evaluate(c.cfg, batch, c.actor, c.ref, c.critic)
        metrics.update(mismatch(batch, ev))
    w1 = microbatch_s(c)
    with timer("advantages"):  # 3. pure functions over rewards (+ KL penalty, values)
        adv, adv_metrics = c.advantages(batch, ev)
        metrics.update(adv_metrics)
    with timer("update"):  # 4. Megatron forward/backward + optimizer step(s), actor and critic
        metrics.update(c.updater(batch, adv, ev, plan, step))
    work = {"logprobs": w1 - w0, "update": microbatch_s(c) - w1}  # the rest of each phase is fixed cost
    if c.ahead is not None:  # the fleet finishes what it generates: no update lands mid-generation
        with timer("generate"):
            c.ahead.drain()
    with timer("sync"):  # 5. new weights into every engine
        metrics.update(c.publisher.push())
    with timer("plan"):  # 6. noise estimates + timings -> the coordinator's next plan
        c.planner.observe(step, batch.size, int(batch.response_lens.sum()), timer.times, c.dims, work)
        metrics.update(c.planner.metrics())
    metrics.update(timer.metrics())
    metrics["timing/step/total"] = total = time.perf_counter() - t0
    busy = c.ahead.fleet_busy_s(t0, t0 + total) if c.ahead is not None else timer.times["generate"]
    metrics.update(pipeline_metrics(lag, timer.times["generate"], busy, total))
    return metrics


def microbatch_s(c: Components) -> float:
    """Seconds of micro-batch work this rank's models have done so far (`Model.microbatch_s`)."""
    return sum(m.microbatch_s for m in c.models().values())


def plan_size(plan: StepPlan) -> tuple[int, int]:
    return plan.num_prompts, plan.samples_per_prompt


def _issue_ahead(c: Components, step: int) -> None:
    """Start generating the batches of steps up to ``step + max_staleness`` (all of them at the
    first step, one a step afterwards), each with the plan made for its step now."""
    assert c.ahead is not None
    for s in c.ahead.wanted(step):
        c.ahead.issue(s, *plan_size(c.planner.plan_ahead(s)))


def pipeline_metrics(lag: torch.Tensor, trainer_wait_s: float, fleet_busy_s: float, total_s: float) -> dict[str, float]:
    """Staleness of the step's samples (policy versions behind the trainer) and the fraction of
    the step the trainer waited for rollouts and the fleet sat idle (rank 0's clock)."""
    return {
        "pipeline/staleness_mean": float(lag.float().mean()),
        "pipeline/staleness_max": float(lag.max()),
        "pipeline/trainer_wait_frac": trainer_wait_s / total_s,
        "pipeline/fleet_wait_frac": max(0.0, 1.0 - fleet_busy_s / total_s),
    }


@dataclass
class Progress:
    """What the loop counts across steps and when it stops early (a checkpoint part, so a
    resumed run validates and stops where the uninterrupted one would)."""

    samples: int = 0
    """Responses trained so far."""
    reached_step: int = 0
    """The step whose validation first reached ``train.target_val_reward`` (0 = not yet)."""
    evals_since: int = 0
    """Validations after that one."""
    recent: list[float] = field(default_factory=list)
    """The last ``train.target_window`` validations (the target test averages them)."""

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

    def done(self, t: TrainConfig) -> str | None:
        """Why the run is over by its counts (a run resumed from its last step's checkpoint
        takes no further step), or None."""
        if self.reached_step and self.evals_since >= t.evals_past_target:
            return f"validation reached {t.target_val_reward:g} at step {self.reached_step}"
        if t.max_samples and self.samples >= t.max_samples:
            return f"{self.samples} responses trained (train.max_samples={t.max_samples})"
        return None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name == "recent":  # (absent from checkpoints written before target_window)
                self.recent = [float(v) for v in state.get("recent", [])]
            else:
                setattr(self, f.name, int(state[f.name]))


def _save(c: Components, step: int, progress: Progress, asynchronous: bool = False) -> Any:
    files = {p.name: p for p in c.tok.files()}
    parts = {**c.stateful(), "progress": progress}
    return state.save(c.run_dir, step, c.models(), parts, files, c.cfg.train.keep_last, asynchronous=asynchronous)


def train(cfg: RunConfig, report: Callable[[Path], Path] | None = None) -> dict[str, float]:
    """Warm start (or resume) + RL; returns a summary (rank 0 logs it, and the trackers as their
    run summary). ``report(run_dir)`` draws the report uploaded with ``train.tracking.artifacts``."""
    t_start = time.perf_counter()
    c = build(cfg)
    state.install_preemption_handlers()
    rank0 = c.dims.is_rank0
    summary: dict[str, float] = {}
    metrics_log = None
    ok = False  # the trackers mark a run that raised as failed
    try:
        resume = state.find_resume(cfg.train.run_dir, cfg.train.resume)  # in the try: engines stop on error
        start, progress = 0, Progress()
        if resume is not None:
            add_reference_and_critic(c)
            # (checkpoints from before Progress existed resume with its counters at zero)
            start = state.restore(resume, c.models(), {**c.stateful(), "progress": progress}, optional=["progress"])
            if rank0:  # before the metrics file is opened
                state.trim_metrics(Path(cfg.train.run_dir) / "metrics.jsonl", start)
            summary["resumed_from_step"] = start
            if rank0:
                log.info("resumed from %s at step %d", resume, start)
        else:
            if rank0:
                state.rotate_metrics(Path(cfg.train.run_dir) / "metrics.jsonl")
            if cfg.warm_start.steps:
                t_ws = time.perf_counter()
                nll = warm_start(WarmStartSettings.of(cfg), c.dims, c.actor, c.tok, c.rollouts.train_rows)
                summary["warm_start/final_nll"] = nll[-1]
                summary["warm_start_s"] = time.perf_counter() - t_ws  # part of startup_s
            add_reference_and_critic(c)
        metrics_log = MetricsLogger.open(cfg.train, to_dict(cfg), enabled=rank0, resumed=resume is not None)
        c.publisher.push()  # the current policy into every engine (version 1 on a fresh start)
        if start == 0:
            summary["val/reward_start"] = c.rollouts.validate()
            metrics_log.log(0, {"val/reward": summary["val/reward_start"]})
            if rank0:
                log.info(
                    "start: validation reward %.3f (%d prompts)", summary["val/reward_start"], c.rollouts.val_scored
                )
        t_rl, t_val, step = time.perf_counter(), 0.0, start
        summary["startup_s"] = t_rl - t_start  # process groups, models, engines, warm start, first sync
        summary["engine_wait_s"] = c.rollouts.engine_wait_s  # part of startup_s: rank 0 blocked on engine start-up
        pending = None  # an asynchronous checkpoint being written
        m: dict[str, float] = {}  # the latest step's metrics
        while step < cfg.train.steps and progress.done(cfg.train) is None:
            m = rl_step(c, step)
            step += 1
            due = progress.count(int(m["rollout/responses"]), step, cfg.train)
            m["progress/samples"] = float(progress.samples)  # the second x-axis: responses trained so far
            if due and step < cfg.train.steps:
                t0 = time.perf_counter()
                m["val/reward"] = c.rollouts.validate()
                t_val += time.perf_counter() - t0
            stop = progress.stop(step, m.get("val/reward"), cfg.train)  # the same on every rank
            metrics_log.log(step, m)
            if rank0:
                _log_step(step, cfg.train.steps, m)
            preempted = state.preempt_requested()
            if pending is not None:  # the previous step's background write: commit it
                pending.finalize()
                pending = None
            if preempted or (cfg.train.save_every and step % cfg.train.save_every == 0):
                t0 = time.perf_counter()
                result = _save(c, step, progress, asynchronous=cfg.train.async_save and not preempted)
                m_save = {"timing/checkpoint_blocked_s": time.perf_counter() - t0}
                if cfg.train.async_save and not preempted:
                    pending = result
                metrics_log.log(step, m_save)
            if preempted:
                summary["preempted_at_step"] = step
                if rank0:
                    log.info("preempted after step %d: checkpoint written, exiting for requeue", step)
                metrics_log.summary(summary)
                ok = True
                return summary
            if progress.reached_step == step:
                summary.update(
                    {
                        "time_to_target_s": time.perf_counter() - t_rl - t_val,
                        "steps_to_target": step,
                        "samples_to_target": progress.samples,
                    }
                )
                if rank0:
                    log.info(
                        "reached validation reward %.3f >= %.3f at step %d%s",
                        progress.target_mean(),
                        cfg.train.target_val_reward,
                        step,
                        f" (mean of the last {cfg.train.target_window})" if cfg.train.target_window > 1 else "",
                    )
            if stop is not None:
                if rank0:
                    log.info("stopping after step %d: %s", step, stop)
                break
        if pending is not None:
            pending.finalize()
        summary["rl_wall_s"] = time.perf_counter() - t_rl
        if "val/reward" in m:  # the last step validated (a stop right after it): that is the end's
            summary["val/reward_end"] = m["val/reward"]
        else:
            summary["val/reward_end"] = c.rollouts.validate()
            metrics_log.log(step, {"val/reward": summary["val/reward_end"]})
        if not (cfg.train.save_every and step % cfg.train.save_every == 0):
            _save(c, step, progress)  # the final state is always resumable
        c.export_hf(c.run_dir / "hf_final")
        summary["wall_s"] = time.perf_counter() - t_start
        summary["shutdown_s"] = summary["wall_s"] - summary["startup_s"] - summary["rl_wall_s"]
        summary["steps"] = step
        if rank0:
            log.info(
                "done: validation reward %.3f -> %.3f at step %d; RL %.0fs, total %.0fs",
                summary.get("val/reward_start", float("nan")),
                summary["val/reward_end"],
                step,
                summary["rl_wall_s"],
                summary["wall_s"],
            )
        metrics_log.summary(summary)
        if rank0 and cfg.train.tracking.artifacts:
            _artifacts(metrics_log, c.run_dir, report)
        ok = True
    finally:
        if metrics_log is not None:
            metrics_log.close(ok)
        c.close()
    return summary


def _artifacts(metrics_log: MetricsLogger, run_dir: Path, report: Callable[[Path], Path] | None) -> None:
    """``hf_final/`` and the report folder to the trackers (a report that fails to draw is left out)."""
    metrics_log.artifact("hf_final", run_dir / "hf_final")
    if report is not None:
        try:
            metrics_log.artifact("report", report(run_dir).parent)
        except Exception as e:  # the report is an extra: the run and its checkpoint are done
            log.warning("report not drawn for the trackers: %s: %s", type(e).__name__, e)


def _log_step(step: int, total: int, m: dict[str, float]) -> None:
    log.info(
        "step %d/%d reward %.3f kl %.4f loss %.4f | gen %.2fs lp %.2fs upd %.2fs sync %.2fs%s",
        step,
        total,
        m["rollout/reward_mean"],
        m.get("train/kl", 0.0),
        m.get("train/loss", float("nan")),
        m["timing/step/generate"],
        m["timing/step/logprobs"],
        m["timing/step/update"],
        m["timing/step/sync"],
        f" | val {m['val/reward']:.3f}" if "val/reward" in m else "",
    )
