"""The rollout collector: prompts → fleet → scored, packed :class:`RolloutBatch` on every rank.

It owns what generation needs and nothing else: the prompt sampler (resumable), the prompt
counters, the reward function and rank 0's handle on the fleet. ``collect`` is phase 1 of the
RL step (with DAPO dynamic sampling it refills groups without reward signal, up to
``algo.max_sampling_rounds``); ``validate`` is greedy accuracy on the held-out prompts.

Invariant: every rank advances the sampler identically, so a resumed run replays no prompt
and skips none; only rank 0 talks to the fleet, and the packed batch is broadcast as tensors.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import RunConfig
from megarl.distributed import ParallelDims
from megarl.rollout.collect import (
    Group,
    PromptStats,
    batch_stats,
    broadcast_batch,
    has_signal,
    overlong_summary,
    pack_groups,
    reward_sample,
    sample_groups,
    take_prompts,
    validation_prompts,
)
from megarl.rollout.data import PromptRecord, PromptSampler
from megarl.rollout.fleet import Fleet
from megarl.rollout.reward_runner import RewardReport, RewardRunner
from megarl.rollout.tokenizer import PromptTokenizer
from megarl.types import RolloutBatch

log = logging.getLogger("megarl")


class RolloutCollector:
    def __init__(
        self,
        cfg: RunConfig,
        dims: ParallelDims,
        tok: PromptTokenizer,
        fleet: Fleet | None,
        train_rows: list[PromptRecord],
        val_rows: list[PromptRecord],
        rewards: RewardRunner | None,
    ) -> None:
        self.cfg, self.dims, self.tok, self.fleet = cfg, dims, tok, fleet
        self.train_rows, self.val_rows = train_rows, val_rows
        self.rewards = rewards
        """Rank 0 only (the reward workers live there)."""
        self.sampler = PromptSampler(len(train_rows), cfg.train.seed, cfg.data.shuffle)
        self.prompt_stats = PromptStats()
        self.engine_wait_s = 0.0
        """Seconds rank 0 waited for engines spawned at start-up to become healthy."""

    def fleet_ready(self) -> None:
        """Rank 0: engines spawned at start-up are healthy (waits once, the first time)."""
        if self.fleet is not None:
            self.engine_wait_s += self.fleet.ready()

    # ------------------------------------------------------------------ phase 1

    def collect(self, step: int, num_prompts: int, samples: int) -> tuple[RolloutBatch, dict[str, float]]:
        """``num_prompts`` × ``samples`` scored responses, identical on every rank."""
        a = self.cfg.algo
        self.fleet_ready()
        stats: dict[str, float] = {}
        batch = None
        rnd = _Round()
        n_kept = 0
        while n_kept < num_prompts and rnd.count < (a.max_sampling_rounds if a.dynamic_sampling else 1):
            prompts = take_prompts(
                self.sampler, self.train_rows, self.tok, num_prompts - n_kept, self.cfg, self.prompt_stats
            )
            rnd.count += 1
            n = torch.zeros(1, dtype=torch.long)
            if self.dims.is_rank0:
                n[0] = self._sample_round(prompts, step, samples, rnd)
            dist.broadcast(n, src=0)
            n_kept = int(n)
        overlong = self.prompt_stats.drain()  # every rank met the same prompts; rank 0 tells
        if self.dims.is_rank0:
            assert self.fleet is not None
            if line := overlong_summary(overlong, self.cfg):
                log.warning("step %d: %s", step + 1, line)
            short = num_prompts - len(rnd.kept)
            if short > 0:  # out of rounds: fill with signal-less groups (zero advantage), counted
                rnd.kept.extend(rnd.reserve[:short])
            kept = rnd.kept[:num_prompts]
            if self.cfg.rollout.dump_rollouts:
                self._dump(step, kept)
            stats["rollout/filled_without_signal"] = float(max(short, 0))
            batch = pack_groups(kept, self.tok.pad_id, rnd.version)
            stats.update(batch_stats(batch))
            stats.update(rnd.rewards.metrics())
            if line := rnd.rewards.summary(self.cfg.reward.failed_reward):
                log.warning("step %d rewards: %s", step + 1, line)
            stats["rollout/sampling_rounds"] = float(rnd.count)
            # which prompts, in which order (a resumed run must replay none and skip none)
            fp = sum((i + 1) * zlib.crc32(g.record.where.encode()) for i, g in enumerate(kept))
            stats["rollout/prompt_fingerprint"] = float(fp % 16_777_213)
            stats["rollout/dropped_groups"] = float(rnd.dropped)
            stats["rollout/skipped_overlong_prompts"] = float(self.prompt_stats.skipped_overlong)
            stats["rollout/truncated_overlong_prompts"] = float(self.prompt_stats.truncated_overlong)
            stats["fleet/restarts"] = float(self.fleet.restarts)
            stats["fleet/reissued_prompts"] = float(self.fleet.reissued_prompts)
            stats.update(self.fleet.pop_timings())  # this step's generations: fleet, engine, model seconds
            if self.cfg.rollout.colocate:  # the trainer needs the GPUs until the next sync
                self.fleet.sleep(level=1)
        return broadcast_batch(batch), stats

    def _sample_round(self, prompts: list[tuple[PromptRecord, list[int]]], step: int, samples: int, rnd: _Round) -> int:
        """Rank 0: one generation round appended to ``rnd.kept``; returns how many are kept."""
        assert self.fleet is not None and self.rewards is not None
        groups, v, report = sample_groups(
            self.fleet,
            self.tok,
            prompts,
            self.cfg,
            self.rewards,
            seed=self.cfg.train.seed + 7919 * step + rnd.count,
            samples=samples,
        )
        rnd.version = min(rnd.version, v)
        rnd.rewards.merge(report)
        if self.cfg.algo.dynamic_sampling:
            good = [g for g in groups if has_signal(g)]
            rnd.dropped += len(groups) - len(good)
            rnd.reserve.extend(g for g in groups if not has_signal(g))
            groups = good
        rnd.kept.extend(groups)
        return len(rnd.kept)

    def _dump(self, step: int, groups: list[Group]) -> None:
        """Rank 0: the exact ids sent to and returned by the engines (``rollout.dump_rollouts``)."""
        with (Path(self.cfg.train.run_dir) / "rollouts.jsonl").open("a") as fh:
            for g in groups:
                row = {
                    "step": step + 1,  # numbered as in metrics.jsonl
                    "where": g.record.where,
                    "prompt_ids": g.prompt_ids,
                    "response_ids": [ids for ids, _, _ in g.samples],
                    "truncated": [tr for _, _, tr in g.samples],
                    "texts": g.texts,
                    "rewards": g.rewards,
                }
                fh.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ validation

    def validate(self) -> float:
        """Greedy accuracy on the validation prompts (rank 0 asks the fleet; shared to all)."""
        value = torch.zeros(1, dtype=torch.float64)
        if self.dims.is_rank0:
            assert self.fleet is not None and self.rewards is not None
            self.fleet_ready()
            # the overlong-prompt rule applies here too (a prompt past the context would fail the
            # engine); a reward that raises scores 0, as in training, counted in one line
            rows = validation_prompts(self.val_rows, self.tok, self.cfg)
            outs, _ = self.fleet.generate(
                [ids for _, ids in rows],
                n=1,
                max_tokens=self.cfg.rollout.max_response_len,
                temperature=0.0,
                top_p=1.0,
                stop_token_ids=self.tok.eos_ids,
            )
            self.fleet.pop_timings()  # validation is not part of a step's generation time
            texts = [self.tok.decode(o[0]["token_ids"]) for o in outs]
            # guarded like training rewards: a failing reward scores reward.failed_reward, logged
            rewards, report = self.rewards.score([reward_sample(r, t, 0) for (r, _), t in zip(rows, texts)])
            if line := report.summary(self.cfg.reward.failed_reward):
                log.warning("validation rewards: %s", line)
            value[0] = sum(rewards) / max(len(rewards), 1)
        dist.broadcast(value, src=0)
        return float(value)

    # ------------------------------------------------------------------ checkpoint part

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(),
            "skipped_overlong": self.prompt_stats.skipped_overlong,
            "truncated_overlong": self.prompt_stats.truncated_overlong,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.prompt_stats.skipped_overlong = int(state["skipped_overlong"])
        self.prompt_stats.truncated_overlong = int(state["truncated_overlong"])


class _Round:
    """What the sampling rounds of one step gathered so far (rank 0)."""

    def __init__(self) -> None:
        self.count = 0
        self.version = 10**9  # the oldest policy version that produced a kept sample
        self.rewards = RewardReport()  # failures, timeouts, crashes over the rounds
        self.dropped = 0  # groups without reward signal (dynamic sampling)
        self.kept: list[Group] = []
        self.reserve: list[Group] = []  # dropped groups, used if the rounds run out
