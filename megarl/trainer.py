"""The trainer's components and the phases of one RL step (the loop itself is ``loop.py``).

Built once per run: process groups, tokenizer, actor (+ frozen reference), the fleet (rank 0)
and the weight sync. Each phase method is one arrow of the data flow in ARCHITECTURE.md and
holds no algorithm math: that lives in ``megarl.algo``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl import algo, objectives
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.checkpoint.hf_io import copy_weights, hf_state_dict, load_hf_tensors, read_hf_folder, save_hf_folder
from megarl.config import RunConfig
from megarl.distributed import ParallelDims, init_distributed, init_layout
from megarl.model.builder import Model, build_gpt, lr_at
from megarl.model.forward import _labels, forward_logprobs, forward_values, train_step, vocab_parallel_logprobs
from megarl.model.grad_stats import GradProbe
from megarl.planning import Planner, grad_stats
from megarl.rollout.collect import (
    PromptStats,
    batch_stats,
    broadcast_batch,
    has_signal,
    pack_groups,
    sample_groups,
    take_prompts,
)
from megarl.rollout.credentials import run_token
from megarl.rollout.data import PromptSampler, load_prompts
from megarl.rollout.engine_server import MANIFEST
from megarl.rollout.fleet import Fleet
from megarl.rollout.rewards import get_reward_fn
from megarl.rollout.tokenizer import Tokenizer, train_tokenizer
from megarl.types import RolloutBatch, StepPlan
from megarl.weight_sync.sync import WeightSync, probe

log = logging.getLogger("megarl")


class Trainer:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        p = cfg.parallel
        self.dims: ParallelDims = init_distributed(p.tensor_parallel, p.pipeline_parallel, cfg.train.seed)
        # the critic's own layout (critic.parallel); the actor's dims themselves when unset
        self.critic_dims = self.dims
        if cfg.algo.name == "ppo":
            ctp, cpp, _ = cfg.critic_layout(self.dims.world_size)
            self.critic_dims = init_layout(self.dims, ctp, cpp)
        self.run_dir = Path(cfg.train.run_dir)
        if self.dims.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_rows, self.val_rows = load_prompts(cfg.data, cfg.data.seed)
        self.tok = self._tokenizer()
        self._resolve_model_config()
        self.adapter = LlamaQwen2Adapter(cfg.model)
        # engines start first and load while the trainer builds its models (waited for at the first sync)
        self.fleet: Fleet | None = None
        self.model_dir = self.run_dir / "hf_engine"
        self.engine_start_s = 0.0  # how long rank 0 then waited for healthy engines
        if self.dims.is_rank0:
            self._write_engine_folder()
            self.fleet = self._start_fleet()
        try:
            self._build(cfg)
        except BaseException:
            if self.fleet is not None:
                self.fleet.shutdown()
            raise

    def _build(self, cfg: RunConfig) -> None:
        p = cfg.parallel
        self.actor = build_gpt(cfg.model, p, self.dims, optim=cfg.optim)
        if cfg.model.init_from:
            _, hf = read_hf_folder(cfg.model.init_from)
            load_hf_tensors(self.actor, self.adapter, hf)
        self.sampler = PromptSampler(len(self.train_rows), cfg.train.seed, cfg.data.shuffle)
        self.prompt_stats = PromptStats()
        self.reward_fn = get_reward_fn(
            cfg.data.reward or ("arithmetic" if cfg.data.source.startswith("builtin:") else "exact_match")
        )
        self.ref: Model | None = None
        self.critic: Model | None = None
        a = cfg.algo
        models = ["actor", "critic"] if a.name == "ppo" else ["actor"]
        self.planner = Planner(cfg, self.dims.dp, models, critic_dp=self.critic_dims.dp)
        self.grad_stats: list[Any] = []
        if self.planner.coord is not None:
            self.actor.probe = self._probe(self.dims)
        self.kl_ctl = algo.make_kl_controller(
            a.kl_controller, kl_coef=a.kl_coef, target_kl=a.kl_target, horizon=int(a.kl_horizon)
        )
        self.sync = WeightSync(
            self.actor, self.adapter, self.fleet, cfg.weight_sync.bucket_mb, transport=cfg.weight_sync.transport
        )
        self.version = 0
        self.probe_tokens = self.tok.encode(self.val_rows[0].prompt + self.val_rows[0].answer)

    # ------------------------------------------------------------------ setup

    def _tokenizer(self) -> Tokenizer:
        tdir = self.run_dir / "tokenizer"
        if self.dims.is_rank0 and not (tdir / "tokenizer.model").exists():
            texts = [r.prompt + r.answer for r in self.train_rows[:5000]]
            train_tokenizer(texts, tdir)
        dist.barrier()
        return Tokenizer(tdir / "tokenizer.model")

    def _resolve_model_config(self) -> None:
        m = self.cfg.model
        if m.init_from:
            hf_cfg = json.loads((Path(m.init_from) / "config.json").read_text())
            self.cfg.model = model_config_from_hf(hf_cfg, m)
        elif m.vocab_size == 0:
            self.cfg.model = dataclasses.replace(m, vocab_size=self.tok.vocab_size)
        if self.cfg.model.vocab_size < self.tok.vocab_size:
            raise ValueError(
                f"model.vocab_size={self.cfg.model.vocab_size} < tokenizer vocabulary {self.tok.vocab_size}"
            )

    def _write_engine_folder(self) -> None:
        """config.json + weight manifest: engines start with dummy weights and get synced."""
        hf_cfg = self.adapter.hf_config(self.tok.eos_id, self.tok.bos_id, self.tok.pad_id)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        hf_cfg.save_pretrained(str(self.model_dir))
        shapes = self.adapter.hf_shapes()
        (self.model_dir / MANIFEST).write_text(json.dumps(shapes))

    def _start_fleet(self) -> Fleet:
        r = self.cfg.rollout
        if r.engine_addresses:  # the credential comes from MEGARL_ENGINE_TOKEN_FILE (slurm/common.sh)
            return Fleet.attach(r.engine_addresses, r.request_timeout_s, r.engine_start_timeout_s)
        return Fleet.start_local(
            self.model_dir,
            r.num_engines,
            r.engine_tp,
            r.kv_cache_gb,
            self.run_dir / "logs",
            self.cfg.train.seed,
            r.request_timeout_s,
            r.engine_start_timeout_s,
            sleep_mode=r.colocate,
            wait=False,
            token=run_token(self.run_dir),
            lease_s=r.engine_lease_s,
        )

    def build_reference_and_critic(self) -> None:
        """Frozen reference = copy of the current actor (same layout: shards copy one to one);
        critic (PPO) = actor trunk + zero-initialised value head, own optimizer and LR, on its
        own layout (``critic.parallel``). Across layouts the trunk goes through full HF-named
        tensors (the one Megatron⇄HF adapter), gathered from the actor's shards."""
        if self.cfg.algo.kl_coef > 0:
            self.ref = build_gpt(self.cfg.model, self.cfg.parallel, self.dims, trainable=False)
            _copy_params(self.actor, self.ref)
        if self.cfg.algo.name == "ppo":
            m = dataclasses.replace(self.cfg.model, tie_embeddings=False)
            cd = self.critic_dims
            self.critic = build_gpt(
                m,
                dataclasses.replace(
                    self.cfg.parallel, tensor_parallel=cd.tp, pipeline_parallel=cd.pp, data_parallel=cd.dp
                ),
                cd,
                value_head=True,
                optim=dataclasses.replace(self.cfg.optim, lr=self.cfg.critic.lr),
                seed=self.cfg.train.seed,
            )
            if self.cfg.critic.init_from_actor:
                copy_weights(self.actor, self.critic, self.adapter)
            if self.planner.coord is not None:
                self.critic.probe = self._probe(cd)

    @staticmethod
    def _probe(dims: ParallelDims) -> GradProbe:
        if dims.dp == 1 and dims.pp > 1:
            raise ValueError(
                "coordinator.enabled needs data_parallel > 1 or pipeline_parallel = 1 "
                "(the micro-batch noise estimator needs PP = 1)"
            )
        return GradProbe(dims, microbatch=dims.dp == 1)

    # ------------------------------------------------------------------ warm start

    def warm_start(self) -> list[float]:
        """Supervised steps on reference answers (token-mean NLL over answer + EOS)."""
        ws = self.cfg.warm_start
        rng = random.Random(self.cfg.train.seed + 17)
        losses = []
        for step in range(ws.steps):
            rows = [self.train_rows[rng.randrange(len(self.train_rows))] for _ in range(ws.batch_size)]
            seqs = []
            for r in rows:
                pids = self.tok.encode(r.prompt)
                seqs.append((pids, self.tok.encode(r.answer, bos=False) + [self.tok.eos_id]))
            tokens, mask = _pack(seqs, self.tok.pad_id)
            denom = float(mask.sum())
            rows_idx, _ = self._dp_rows(tokens.shape[0])

            def loss_fn(
                mb: dict[str, torch.Tensor], logits: torch.Tensor, denom: float = denom
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                lp = vocab_parallel_logprobs(logits, _labels(mb["tokens"]), 1.0)
                nll = -(lp * mb["mask"]).sum()
                return nll / denom, {"nll": nll}

            lr = lr_at(step, dataclasses.replace(self.cfg.optim, lr=ws.lr, warmup_steps=min(10, ws.steps)), ws.steps)
            stats, _ = train_step(
                self.actor,
                {"tokens": tokens[rows_idx], "mask": mask[rows_idx]},
                loss_fn,
                micro_batch_size=self.cfg.parallel.micro_batch_size,
                lr=lr,
            )
            losses.append(stats["nll"] / denom)
            if self.dims.is_rank0 and (step % 50 == 0 or step == ws.steps - 1):
                log.info("warm-start %d/%d nll %.4f", step + 1, ws.steps, losses[-1])
        return losses

    def _dp_rows(
        self, n: int, shares: list[float] | None = None, dims: ParallelDims | None = None
    ) -> tuple[slice, list[slice]]:
        """This DP rank's rows of ``n`` (and every rank's) in ``dims``' layout (the actor's by
        default), split by ``shares`` in whole micro-batches (equal when None)."""
        dims = dims or self.dims
        dp, mbs = dims.dp, self.cfg.parallel.micro_batch_size
        if shares is None or dp == 1:
            counts = [n // dp] * dp
        else:
            chunks = n // mbs
            counts = [max(1, round(s * chunks)) * mbs for s in shares]
            counts[-1] = n - sum(counts[:-1])
            if counts[-1] < mbs or counts[-1] % mbs:
                counts = [n // dp] * dp
        starts = [sum(counts[:i]) for i in range(dp)]
        slices = [slice(s, s + c) for s, c in zip(starts, counts, strict=True)]
        return slices[dims.dp_rank], slices

    @property
    def _unit(self) -> str:
        return "tokens" if self.cfg.algo.loss_agg == "token-mean" else "responses"

    def _units(self, mask: torch.Tensor) -> torch.Tensor:
        """Per-row batch units the loss averages over: tokens or responses (with ≥ 1 token)."""
        return mask.sum(1) if self._unit == "tokens" else (mask.sum(1) > 0).float()

    # ------------------------------------------------------------------ phases

    def generate(self, step: int, num_prompts: int, samples: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Rank 0 samples and scores; with DAPO dynamic sampling, groups without reward
        signal are dropped and refilled (up to ``algo.max_sampling_rounds``)."""
        a = self.cfg.algo
        self._fleet_ready()
        stats: dict[str, float] = {}
        batch = None
        kept: list[Any] = []
        rounds, n_kept = 0, 0
        while n_kept < num_prompts and rounds < (a.max_sampling_rounds if a.dynamic_sampling else 1):
            # every rank advances the sampler identically (same position on resume)
            prompts = take_prompts(
                self.sampler, self.train_rows, self.tok, num_prompts - n_kept, self.cfg, self.prompt_stats
            )
            rounds += 1
            n = torch.zeros(1, dtype=torch.long)
            if self.dims.is_rank0:
                n[0] = self._sample_round(prompts, step, rounds, samples, kept)
            dist.broadcast(n, src=0)
            n_kept = int(n)
        if self.dims.is_rank0:
            short = num_prompts - len(kept)
            if short > 0:  # out of rounds: fill with signal-less groups (zero advantage), counted
                kept.extend(self._reserve[:short])
            stats["rollout/filled_without_signal"] = float(max(short, 0))
            batch = pack_groups(kept[:num_prompts], self.tok.pad_id, self._round_version)
            stats.update(batch_stats(batch, self._round_failed))
            stats["rollout/sampling_rounds"] = float(rounds)
            # which prompts, in which order (a resumed run must replay none and skip none)
            fp = sum((i + 1) * zlib.crc32(g.record.where.encode()) for i, g in enumerate(kept[:num_prompts]))
            stats["rollout/prompt_fingerprint"] = float(fp % 16_777_213)
            stats["rollout/dropped_groups"] = float(self._round_dropped)
            stats["rollout/skipped_overlong_prompts"] = float(self.prompt_stats.skipped_overlong)
            stats["rollout/truncated_overlong_prompts"] = float(self.prompt_stats.truncated_overlong)
            assert self.fleet is not None
            stats["fleet/restarts"] = float(self.fleet.restarts)
            stats["fleet/reissued_prompts"] = float(self.fleet.reissued_prompts)
            if self.cfg.rollout.colocate:  # the trainer needs the GPUs until the next sync
                self.fleet.sleep(level=1)
        return broadcast_batch(batch), stats

    def _sample_round(self, prompts: list[Any], step: int, rnd: int, samples: int, kept: list[Any]) -> int:
        """Rank 0: one generation round appended to ``kept``; returns len(kept)."""
        assert self.fleet is not None
        if rnd == 1:
            self._round_version, self._round_failed, self._round_dropped = 10**9, 0, 0
            self._reserve: list[Any] = []
        groups, v, nfail = sample_groups(
            self.fleet,
            self.tok,
            prompts,
            self.cfg,
            self.reward_fn,
            seed=self.cfg.train.seed + 7919 * step + rnd,
            samples=samples,
        )
        self._round_version = min(self._round_version, v)
        self._round_failed += nfail
        if self.cfg.algo.dynamic_sampling:
            good = [g for g in groups if has_signal(g)]
            self._round_dropped += len(groups) - len(good)
            self._reserve.extend(g for g in groups if not has_signal(g))
            groups = good
        kept.extend(groups)
        return len(kept)

    def logprobs(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Old-policy, reference log-probs and critic values, (B, S) each, as needed."""
        a, temp = self.cfg.algo, self.cfg.rollout.temperature
        p = self.cfg.parallel
        lmbs = p.logprob_micro_batch_size

        def fwd_mbs(model: Model) -> int:  # bigger forward-only micro-batches when they divide the batch
            return lmbs if lmbs and batch.size % (model.dims.dp * lmbs) == 0 else p.micro_batch_size

        mbs = fwd_mbs(self.actor)
        out: dict[str, torch.Tensor] = {}
        if a.ppo_epochs * a.mini_batches > 1 or a.kl_mode == "reward" or self.critic is not None:
            out["old_logprobs"] = forward_logprobs(self.actor, batch.tokens, micro_batch_size=mbs, temperature=temp)[
                "logprobs"
            ]
        if a.kl_coef > 0:
            assert self.ref is not None
            out["ref_logprobs"] = forward_logprobs(self.ref, batch.tokens, micro_batch_size=mbs, temperature=temp)[
                "logprobs"
            ]
        if self.critic is not None:
            out["old_values"] = forward_values(self.critic, batch.tokens, micro_batch_size=fwd_mbs(self.critic))
        return out

    @staticmethod
    def mismatch(batch: RolloutBatch, lps: dict[str, torch.Tensor]) -> dict[str, float]:
        """Train/inference mismatch on the sampled tokens: mean |Δlogp| and max p_train/p_engine."""
        if "old_logprobs" not in lps:
            return {}
        m = batch.mask.bool()
        d = lps["old_logprobs"][m] - batch.engine_logprobs[m]
        if d.numel() == 0:
            return {}
        return {
            "rollout/mismatch_abs_logp_mean": float(d.abs().mean()),
            "rollout/mismatch_max_prob_ratio": float(d.exp().max()),
        }

    def advantages(
        self, batch: RolloutBatch, lps: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Advantages (and critic returns). KL in the reward is a per-token penalty β·KL."""
        a = self.cfg.algo
        mask = batch.mask
        if a.overlong_filter:
            mask = mask * (~batch.truncated).float()[:, None]
        token_rewards = algo.sequence_to_last_token(batch.rewards, mask)
        stats: dict[str, float] = {}
        if a.kl_mode == "reward" and "ref_logprobs" in lps:
            kl = algo.kl_estimate(lps["old_logprobs"], lps["ref_logprobs"], a.kl_estimator) * mask
            token_rewards = token_rewards - self.kl_ctl.value * kl
            kl_mean = float(kl.sum() / mask.sum().clamp(min=1))
            stats.update({"train/kl_reward": kl_mean, "train/kl_coef": self.kl_ctl.value})
            self.kl_ctl.update(kl_mean, batch.size)
        res = algo.compute_advantages(
            a.advantage,
            mask=mask,
            rewards=batch.rewards,
            token_rewards=token_rewards,
            group_ids=batch.group_ids,
            values=lps.get("old_values"),
            gamma=a.gamma,
            lam=a.lam,
            whiten=a.whiten_advantages,
        )
        out = {"adv": res.advantages, "mask": mask}
        if res.returns is not None:
            out["returns"] = res.returns
        return out, stats

    def update(
        self, batch: RolloutBatch, adv: dict[str, torch.Tensor], lps: dict[str, torch.Tensor], plan: StepPlan, step: int
    ) -> dict[str, float]:
        """PPO epochs × mini-batches over one rollout; actor (after critic warm-up) and critic.

        The first mini-batch of each rollout is measured by the grad probes (coordinator)."""
        a = self.cfg.algo
        B = batch.size
        lr, critic_lr = plan.lr["actor"], plan.lr.get("critic", self.cfg.critic.lr)
        self.grad_stats = []
        rows: dict[str, torch.Tensor] = {"tokens": batch.tokens, "engine_logprobs": batch.engine_logprobs, **adv, **lps}
        update_actor = self.critic is None or step >= self.cfg.critic.warmup_steps
        totals: dict[str, float] = {}
        n_updates = 0
        for _epoch in range(a.ppo_epochs):
            for mb_idx in range(a.mini_batches):
                per = B // a.mini_batches
                mini = {k: v[mb_idx * per : (mb_idx + 1) * per] for k, v in rows.items()}
                denom = algo.global_denominator(
                    a.loss_agg, mini["mask"], fixed_normalizer=float(self.cfg.rollout.max_response_len)
                )
                mbs = self.cfg.parallel.micro_batch_size
                measure = n_updates == 0 and self.planner.coord is not None
                for name, model, loss_fn, model_lr, is_value in (
                    (
                        "actor",
                        self.actor if update_actor else None,
                        objectives.policy_loss_fn(self.cfg, self.dims.tp_group, denom),
                        lr,
                        False,
                    ),
                    ("critic", self.critic, objectives.value_loss_fn(self.cfg, denom), critic_lr, True),
                ):
                    if model is None:
                        continue
                    # the plan's uneven DP shares are the actor's ranks; a critic on its own
                    # layout splits its rows equally over its DP ranks
                    shares = plan.dp_shares if model.dims is self.dims else None
                    rows_sl, all_rows = self._dp_rows(per, shares, model.dims)
                    local = {k: v[rows_sl] for k, v in mini.items()}
                    if measure:
                        model.probe.start()
                    stats, gnorm = train_step(
                        model, local, loss_fn, micro_batch_size=mbs, lr=model_lr, value_model=is_value
                    )
                    stats["grad_norm"] = gnorm
                    _accumulate(totals, stats, "" if name == "actor" else "critic/")
                    if measure:
                        model.probe.active = False
                        units = self._units(mini["mask"])
                        rank_units = [float(units[sl].sum()) for sl in all_rows]
                        mb_units = [float(u.sum()) for u in units[rows_sl].split(mbs)]
                        self.grad_stats.append(grad_stats(name, model.probe, gnorm, self._unit, rank_units, mb_units))
                        totals[f"coord_probe_s/{name}"] = model.probe.seconds
                n_updates += 1
        out: dict[str, float] = {"train/lr": lr, "train/actor_updated": float(update_actor)}
        for k in [k for k in totals if k.startswith("coord_probe_s/")]:  # the probe's own cost
            out[k.replace("coord_probe_s/", "coord/probe_s/")] = totals.pop(k)
        if self.critic is not None:
            out["critic/lr"] = critic_lr
        if update_actor:
            tokens = max(totals.pop("tokens", 1.0), 1.0)
            out["train/loss"] = totals.pop("loss") / n_updates
            out["train/grad_norm"] = totals.pop("grad_norm") / n_updates
            for k in [k for k in totals if not k.startswith("critic/")]:
                if k.endswith("_max"):
                    out[f"train/{k}"] = totals.pop(k)
                else:
                    out[f"train/{k.removesuffix('_sum')}"] = totals.pop(k) / tokens
        if self.critic is not None:
            ctok = max(totals.pop("critic/tokens", 1.0), 1.0)
            out["critic/value_loss"] = totals.pop("critic/loss") / n_updates
            out["critic/grad_norm"] = totals.pop("critic/grad_norm") / n_updates
            for k in list(totals):
                out[k.removesuffix("_sum")] = totals.pop(k) / ctok
        return out

    def observe(self, step: int, batch: RolloutBatch, times: dict[str, float]) -> None:
        """Feed the coordinator this step's gradient statistics and phase timings."""
        if self.planner.coord is None:
            return
        from megarl.coordinator import StepTimings

        other = sum(v for k, v in times.items() if k not in ("generate", "update"))
        # every rank must plan identically: use rank 0's clock
        t = torch.tensor([times["generate"], times["update"], other], dtype=torch.float64)
        dist.broadcast(t, src=0)
        # each DP rank's own update time (shares follow measured per-rank throughput)
        mine = torch.tensor([times["update"]], dtype=torch.float64)
        ranks = [torch.zeros_like(mine) for _ in range(self.dims.dp)]
        dist.all_gather(ranks, mine, group=self.dims.dp_group)
        gathered = torch.cat(ranks)
        dist.broadcast(gathered, src=0)  # identical on every rank (other DP groups time differently)
        rank_s = [float(x) for x in gathered]
        timings = StepTimings(
            generate_s=float(t[0]),
            train_s=float(t[1]),
            other_s=float(t[2]),
            rollout_responses=batch.size,
            rollout_tokens=int(batch.response_lens.sum()),
            rank_train_s=rank_s if self.dims.dp > 1 else None,
        )
        self.planner.observe(step, self.grad_stats, timings)

    def _fleet_ready(self) -> None:
        """Rank 0: engines spawned at start-up are healthy (waits once, the first time)."""
        if self.fleet is not None:
            self.engine_start_s += self.fleet.ready()

    def push_weights(self) -> dict[str, float]:
        self._fleet_ready()
        self.version += 1
        self._colocate_wake(["weights"])  # colocated: weights back on the GPU to be overwritten
        try:
            stats = self.sync.push(self.version)
        finally:
            self._colocate_wake(["kv_cache"])  # ... then the KV cache: the fleet serves again
        out = {f"sync/{k}": v for k, v in stats.items()}
        if self.cfg.weight_sync.probe:
            out["sync/probe_max_abs_diff"] = probe(
                self.actor, self.fleet, self.probe_tokens, self.cfg.weight_sync.probe_tol
            )
        return out

    def _colocate_wake(self, tags: list[str]) -> None:
        """Colocated engines wake in two steps around a sync (no-op for engines awake)."""
        if self.cfg.rollout.colocate and self.fleet is not None:
            self.fleet.wake_up(tags)

    def validate(self) -> float:
        """Greedy accuracy on the validation prompts (rank 0 asks the fleet; shared to all)."""
        value = torch.zeros(1, dtype=torch.float64)
        if self.dims.is_rank0:
            assert self.fleet is not None
            self._fleet_ready()
            prompts = [self.tok.encode(r.prompt) for r in self.val_rows]
            outs, _ = self.fleet.generate(
                prompts,
                n=1,
                max_tokens=self.cfg.rollout.max_response_len,
                temperature=0.0,
                top_p=1.0,
                stop_token_ids=[self.tok.eos_id],
            )
            texts = [self.tok.decode(o[0]["token_ids"]) for o in outs]
            rewards = [self.reward_fn(r.prompt, t, r.answer) for r, t in zip(self.val_rows, texts)]
            value[0] = sum(rewards) / len(rewards)
        dist.broadcast(value, src=0)
        return float(value)

    def export_hf(self, path: Path) -> None:
        sd = hf_state_dict(self.actor, self.adapter)
        if self.dims.is_rank0:
            hf_cfg = self.adapter.hf_config(self.tok.eos_id, self.tok.bos_id, self.tok.pad_id)
            save_hf_folder(path, sd, hf_cfg)
            import shutil

            shutil.copy(self.tok.path, path / "tokenizer.model")

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.shutdown()
        if self.dims.is_rank0:
            self.sync.cleanup()


@torch.no_grad()
def _copy_params(src: Model, dst: Model) -> None:
    params = dict(src.core.named_parameters())
    for name, p in dst.core.named_parameters():
        p.copy_(params[name])
    if dst.optimizer is not None and hasattr(dst.optimizer, "reload_model_params"):
        dst.optimizer.reload_model_params()


def _accumulate(totals: dict[str, float], stats: dict[str, float], prefix: str) -> None:
    for k, v in stats.items():
        if k.endswith("_max"):
            totals[prefix + k] = max(totals.get(prefix + k, -float("inf")), v)
        else:
            totals[prefix + k] = totals.get(prefix + k, 0.0) + v


def _pack(seqs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) id lists -> tokens (B, S), mask (B, S) in the forward.py layout."""
    S = max(len(p) + len(r) for p, r in seqs)
    tokens = torch.full((len(seqs), S), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), S)
    for b, (p, r) in enumerate(seqs):
        tokens[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, len(p) - 1 : len(p) + len(r) - 1] = 1.0
    return tokens, mask
