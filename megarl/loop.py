"""The RL loop: numbered phases of one step, each in a named timer, and the run around them.

    1 generate → 2 logprobs → 3 advantages → 4 update → 5 sync → 6 observe

The step's batch comes from the run's :class:`~megarl.rollout.source.RolloutSource`: generated
in the step (on-policy), or k steps ahead while the trainer updates (``rollout.max_staleness``
= k > 0, ``megarl.rollout.pipeline``; the fleet finishes before the sync). ``timing/step/generate``
is the trainer's wait for rollouts either way, and ``pipeline/*`` logs each sample's lag and
who waited. Phase 6 observes the step (noise estimates, timings) for the coordinator's next plan.

``train`` is the run: build (``megarl.components``: resume choice and warm start included),
the first sync and validation, the steps with their validation cadence and stop rules
(:class:`~megarl.metrics.progress.Progress`), checkpoints (:class:`~megarl.checkpoint.manager.
CheckpointManager`: save, async commit, preemption, resume), the end's validation and export,
and a :class:`~megarl.metrics.progress.RunSummary`.

The loop holds no algorithm math (``megarl.algo``) and no transport details
(``megarl.weight_sync``); it only calls the phases over the run's components and logs what
they measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.checkpoint import state
from megarl.checkpoint.manager import CheckpointManager
from megarl.components import Components, build
from megarl.config import RunConfig, to_dict
from megarl.metrics import MetricsLogger, Timer
from megarl.metrics.progress import Progress, RunSummary
from megarl.rollout.sampling import answer_sequences
from megarl.update import answer_probability, evaluate, mismatch

log = logging.getLogger("megarl")


@dataclass
class StepResult:
    """One RL step: how many responses it trained on, and everything it measured."""

    responses: int
    metrics: dict[str, float]


def rl_step(c: Components, step: int) -> StepResult:
    timer = Timer()
    t0 = time.perf_counter()
    with timer("generate"):  # pipelined: later steps' batches issued, to generate during this update
        c.rollouts.start(step, c.planner.plan_ahead)
    plan = c.planner.plan(step)  # batch and LR per model: fixed, or from the coordinator (made ahead if pipelined)
    with timer("generate"):  # 1. sample responses on the fleet and score them (or take the batch made ahead)
        batch, metrics = c.rollouts.take(step, plan)
    lag = c.publisher.version - batch.sample_versions()  # policy versions each sample lags the trainer
    metrics["rollout/responses"] = float(batch.size)  # on every rank (the other rollout stats: rank 0's)
    w0 = microbatch_s(c)
    with timer("logprobs"):  # 2. old-policy / reference log-probs, critic values (Megatron forward)
        c.rollouts.fleet_idle(c.publisher.version)
        ev = evaluate(c.cfg.algo, c.cfg.rollout, c.cfg.parallel, batch, c.actor, c.ref, c.critic)
        metrics.update(mismatch(batch, ev))
    w1 = microbatch_s(c)
    with timer("advantages"):  # 3. pure functions over rewards (+ KL penalty, values)
        adv, adv_metrics = c.advantages(batch, ev)
        metrics.update(adv_metrics)
    with timer("update"):  # 4. Megatron forward/backward + optimizer step(s), actor and critic
        metrics.update(c.updater(batch, adv, ev, plan, step))
    work = {"logprobs": w1 - w0, "update": microbatch_s(c) - w1}  # the rest of each phase is fixed cost
    with timer("generate"):  # pipelined: the fleet finishes what it generates, no update lands mid-generation
        c.rollouts.finish()
    with timer("sync"):  # 5. new weights into every engine
        metrics.update(c.publisher.push())
    with timer("observe"):  # 6. noise estimates + timings -> the coordinator's next plan
        c.planner.observe(step, batch.size, int(batch.mask.sum()), timer.times, c.dims, work)  # trained tokens
        metrics.update(c.planner.metrics())
    metrics.update(timer.metrics())
    metrics["timing/step/total"] = total = time.perf_counter() - t0
    if "env/time_s" in metrics:  # episodes: the share of the step spent waiting on environments alone
        metrics["env/time_frac"] = metrics["env/time_s"] / total
    busy = c.rollouts.fleet_busy_s(t0, t0 + total, timer.times["generate"])
    metrics.update(pipeline_metrics(lag, timer.times["generate"], busy, total))
    return StepResult(batch.size, metrics)


def microbatch_s(c: Components) -> float:
    """Seconds of micro-batch work this rank's models have done so far (`Model.microbatch_s`)."""
    return sum(m.microbatch_s for m in c.models().values())


def pipeline_metrics(lag: torch.Tensor, trainer_wait_s: float, fleet_busy_s: float, total_s: float) -> dict[str, float]:
    """Staleness of the step's samples (policy versions behind the trainer) and the fraction of
    the step the trainer waited for rollouts and the fleet sat idle (rank 0's clock)."""
    return {
        "pipeline/staleness_mean": float(lag.float().mean()),
        "pipeline/staleness_max": float(lag.max()),
        "pipeline/trainer_wait_frac": trainer_wait_s / total_s,
        "pipeline/fleet_wait_frac": max(0.0, 1.0 - fleet_busy_s / total_s),
    }


def validate(c: Components) -> float:
    """The run's validation metric (``train.val_metric``), the same on every rank: greedy
    responses' mean reward (the fleet), or the mean teacher-forced probability of the reference
    answers (the actor's forward on every rank; no engine)."""
    if c.cfg.train.val_metric == "answer_prob":
        tokens, mask = answer_sequences(c.collector.val_rows, c.tok, c.collector.cfg)
        c.collector.val_scored = tokens.shape[0]
        return answer_probability(c.actor, tokens, mask, c.cfg.parallel)
    return c.collector.validate()


def train(cfg: RunConfig, report: Callable[[Path], Path] | None = None) -> RunSummary:
    """Warm start (or resume) + RL; returns the run's summary (rank 0 logs it, and the trackers
    as their run summary). ``report(run_dir)`` draws the report uploaded with
    ``train.tracking.artifacts``."""
    t_start = time.perf_counter()
    state.install_preemption_handlers()
    c = build(cfg)
    t, rank0 = cfg.train, c.dims.is_rank0
    ws = c.start
    summary = RunSummary(warm_start_final_nll=ws.warm_start_nll, warm_start_final_exact=ws.warm_start_exact,
                         warm_start_steps=ws.warm_start_steps, warm_start_s=ws.warm_start_s)  # fmt: skip
    progress = Progress()
    files = {f.name: f for f in c.tok.files()}  # the tokenizer travels with each checkpoint
    ckpt = CheckpointManager(c.run_dir, t, c.models(), {**c.stateful(), "progress": progress}, files)
    metrics_log = None
    ok = False  # the trackers mark a run that raised as failed
    try:
        step = _begin(c, ckpt, summary)
        metrics_log = MetricsLogger.open(t, to_dict(cfg), enabled=rank0, resumed=c.start.resume_from is not None)
        c.publisher.push()  # the current policy into every engine (version 1 on a fresh start)
        if step == 0:
            summary.val_reward_start = validate(c)
            metrics_log.log(0, {"val/reward": summary.val_reward_start})
            if rank0:
                log.info("start: validation reward %.3f (%d prompts)", summary.val_reward_start, c.collector.val_scored)
        progress.clock.start()
        t_rl = time.perf_counter()
        summary.startup_s = t_rl - t_start  # process groups, models, engines, warm start, first sync
        summary.engine_wait_s = c.collector.engine_wait_s
        last: dict[str, float] = {}  # the latest step's metrics
        while step < t.steps and progress.done(t) is None:
            last = rl_step(c, step).metrics
            step += 1
            stop = _after_step(c, progress, step, last, metrics_log)
            preempted, m_save = ckpt.after_step(step)
            if m_save:
                metrics_log.log(step, m_save)
            if preempted:
                summary.preempted_at_step = step
                if rank0:
                    log.info("preempted after step %d: checkpoint written, exiting for requeue", step)
                metrics_log.summary(summary.as_dict())
                ok = True
                return summary
            if progress.reached_now(step):
                summary.reached(progress)
            if stop is not None:
                if rank0:
                    log.info("stopping after step %d: %s", step, stop)
                break
        ckpt.finish(step)
        summary.rl_wall_s = time.perf_counter() - t_rl
        _end(c, summary, step, last, metrics_log, t_start)
        if rank0 and t.tracking.artifacts:
            _artifacts(metrics_log, c.run_dir, report)
        ok = True
    finally:
        if metrics_log is not None:
            metrics_log.close(ok)
        c.close()
    return summary


def _begin(c: Components, ckpt: CheckpointManager, summary: RunSummary) -> int:
    """The step the run starts at: the resumed checkpoint's (its state restored, metrics.jsonl
    trimmed to it), or 0 (an earlier run's metrics file set aside)."""
    metrics_file = c.run_dir / "metrics.jsonl"
    if c.start.resume_from is None:
        if c.dims.is_rank0:
            state.rotate_metrics(metrics_file)
        return 0
    start = ckpt.restore(c.start.resume_from)
    if c.dims.is_rank0:  # before the metrics file is opened
        state.trim_metrics(metrics_file, start)
        log.info("resumed from %s at step %d", c.start.resume_from, start)
    summary.resumed_from_step = start
    return start


def _after_step(
    c: Components, progress: Progress, step: int, m: dict[str, float], metrics_log: MetricsLogger
) -> str | None:
    """Count the step, validate when due, log it; why the run stops now (the same on every
    rank), or None."""
    t = c.cfg.train
    due = progress.count(int(m["rollout/responses"]), step, t)
    m["progress/samples"] = float(progress.samples)  # the second x-axis: responses trained so far
    if due and step < t.steps:
        t0 = time.perf_counter()
        m["val/reward"] = validate(c)
        progress.clock.validated(time.perf_counter() - t0)
    stop = progress.stop(step, m.get("val/reward"), t)
    metrics_log.log(step, m)
    if c.dims.is_rank0:
        _log_step(step, t.steps, m)
        if progress.reached_now(step):
            log.info(
                "reached validation reward %.3f >= %.3f at step %d%s",
                progress.target_mean(),
                t.target_val_reward,
                step,
                f" (mean of the last {t.target_window})" if t.target_window > 1 else "",
            )
    return stop


def _end(
    c: Components, summary: RunSummary, step: int, last: dict[str, float], metrics_log: MetricsLogger, t_start: float
) -> None:
    """The final validation (unless the last step validated), the HF export, the summary."""
    if "val/reward" in last:  # the last step validated (a stop right after it): that is the end's
        summary.val_reward_end = last["val/reward"]
    else:
        summary.val_reward_end = validate(c)
        metrics_log.log(step, {"val/reward": summary.val_reward_end})
    c.export_hf(c.run_dir / "hf_final")
    summary.wall_s = time.perf_counter() - t_start
    summary.shutdown_s = summary.wall_s - (summary.startup_s or 0.0) - (summary.rl_wall_s or 0.0)
    summary.steps = step
    if c.dims.is_rank0:
        log.info(
            "done: validation reward %.3f -> %.3f at step %d; RL %.0fs, total %.0fs",
            summary.val_reward_start if summary.val_reward_start is not None else float("nan"),
            summary.val_reward_end,
            step,
            summary.rl_wall_s,
            summary.wall_s,
        )
    metrics_log.summary(summary.as_dict())


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
        _env_line(m) + _moe_line(m) + (f" | val {m['val/reward']:.3f}" if "val/reward" in m else ""),
    )


def _moe_line(m: dict[str, float]) -> str:
    """MoE routing replay's part of the step line: the share of tokens whose live experts
    differed from the replayed ones (mean over layers), and KL(π_old‖π_θ) ('' without replay)."""
    if "moe/route_mismatch" not in m:
        return ""
    return f" | routes differ {100 * m['moe/route_mismatch']:.1f}% kl_old {m.get('train/old_kl_k3', 0.0):.2e}"


def _env_line(m: dict[str, float]) -> str:
    """Episodes' part of the step line ('' for single-turn runs)."""
    if "env/turns_mean" not in m:
        return ""
    return (
        f" | turns {m['env/turns_mean']:.1f} tools {m['env/tool_calls_mean']:.1f} "
        f"(errors {100 * m['env/tool_error_rate']:.0f}%) env {m['env/time_s']:.2f}s "
        f"({100 * m['env/time_frac']:.0f}%) truncated {100 * m['env/truncated_frac']:.0f}%"
    )
