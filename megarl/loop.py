"""The RL loop: numbered phases of one step, each in a named timer.

    0 plan → 1 generate → 2 logprobs → 3 advantages → 4 update → 5 sync → 6 observe

The loop holds no algorithm math (``megarl.algo``) and no transport details
(``megarl.weight_sync``); it only calls the trainer's phases and logs what they measured.
"""

from __future__ import annotations

import logging
import time

from megarl.config import RunConfig
from megarl.metrics import MetricsLogger, Timer
from megarl.trainer import Trainer

log = logging.getLogger("megarl")


def rl_step(tr: Trainer, step: int) -> dict[str, float]:
    timer = Timer()
    t0 = time.perf_counter()
    plan = tr.planner.plan(step)  # batch and LR per model: fixed, or from the coordinator
    with timer("generate"):  # 1. sample responses on the fleet and score them
        batch, metrics = tr.generate(step, plan.num_prompts, plan.samples_per_prompt)
    with timer("logprobs"):  # 2. old-policy / reference log-probs, critic values (Megatron forward)
        lps = tr.logprobs(batch)
        metrics.update(tr.mismatch(batch, lps))
    with timer("advantages"):  # 3. pure functions over rewards (+ KL penalty, values)
        adv, adv_metrics = tr.advantages(batch, lps)
        metrics.update(adv_metrics)
    with timer("update"):  # 4. Megatron forward/backward + optimizer step(s), actor and critic
        metrics.update(tr.update(batch, adv, lps, plan, step))
    with timer("sync"):  # 5. new weights into every engine
        metrics.update(tr.push_weights())
    with timer("plan"):  # 6. noise estimates + timings -> the coordinator's next plan
        tr.observe(step, batch, timer.times)
        metrics.update(tr.planner.metrics())
    metrics.update(timer.metrics())
    metrics["timing/step/total"] = time.perf_counter() - t0
    return metrics


def train(cfg: RunConfig) -> dict[str, float]:
    """Run warm start + RL; returns a summary (rank 0 logs it)."""
    t_start = time.perf_counter()
    tr = Trainer(cfg)
    rank0 = tr.dims.is_rank0
    metrics_log = MetricsLogger(cfg.train.run_dir, enabled=rank0, tensorboard=cfg.train.tensorboard)
    summary: dict[str, float] = {}
    try:
        if cfg.warm_start.steps:
            losses = tr.warm_start()
            summary["warm_start/final_nll"] = losses[-1]
        tr.build_reference_and_critic()
        tr.push_weights()  # version 1 = the starting policy
        val0 = tr.validate()
        summary["val/reward_start"] = val0
        metrics_log.log(0, {"val/reward": val0})
        if rank0:
            log.info("start: validation reward %.3f (%d prompts)", val0, len(tr.val_rows))
        t_rl = time.perf_counter()
        for step in range(cfg.train.steps):
            m = rl_step(tr, step)
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < cfg.train.steps:
                m["val/reward"] = tr.validate()
            metrics_log.log(step + 1, m)
            if rank0:
                log.info(
                    "step %d/%d reward %.3f kl %.4f loss %.4f | gen %.2fs lp %.2fs upd %.2fs sync %.2fs%s",
                    step + 1,
                    cfg.train.steps,
                    m["rollout/reward_mean"],
                    m.get("train/kl", 0.0),
                    m.get("train/loss", float("nan")),
                    m["timing/step/generate"],
                    m["timing/step/logprobs"],
                    m["timing/step/update"],
                    m["timing/step/sync"],
                    f" | val {m['val/reward']:.3f}" if "val/reward" in m else "",
                )
        summary["rl_wall_s"] = time.perf_counter() - t_rl
        val1 = tr.validate()
        metrics_log.log(cfg.train.steps, {"val/reward": val1})
        summary["val/reward_end"] = val1
        tr.export_hf(tr.run_dir / "hf_final")
        summary["wall_s"] = time.perf_counter() - t_start
        summary["steps"] = cfg.train.steps
        if rank0:
            log.info(
                "done: validation reward %.3f -> %.3f in %d steps; RL %.0fs, total %.0fs",
                val0,
                val1,
                cfg.train.steps,
                summary["rl_wall_s"],
                summary["wall_s"],
            )
    finally:
        metrics_log.close()
        tr.close()
    return summary
