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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl import algo
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.checkpoint.hf_io import hf_state_dict, load_hf_tensors, read_hf_folder, save_hf_folder
from megarl.config import RunConfig
from megarl.distributed import ParallelDims, init_distributed
from megarl.model.builder import Model, build_gpt, lr_at
from megarl.model.forward import _labels, forward_logprobs, train_step, vocab_parallel_logprobs
from megarl.rollout.collect import PromptStats, broadcast_batch, generate_batch, take_prompts
from megarl.rollout.data import PromptSampler, load_prompts
from megarl.rollout.engine_server import MANIFEST
from megarl.rollout.fleet import Fleet
from megarl.rollout.rewards import get_reward_fn
from megarl.rollout.tokenizer import Tokenizer, train_tokenizer
from megarl.types import RolloutBatch
from megarl.weight_sync.sync import WeightSync, probe

log = logging.getLogger("megarl")


class Trainer:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        p = cfg.parallel
        self.dims: ParallelDims = init_distributed(p.tensor_parallel, p.pipeline_parallel, cfg.train.seed)
        self.run_dir = Path(cfg.train.run_dir)
        if self.dims.is_rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_rows, self.val_rows = load_prompts(cfg.data, cfg.train.seed)
        self.tok = self._tokenizer()
        self._resolve_model_config()
        self.adapter = LlamaQwen2Adapter(cfg.model)
        self.actor = build_gpt(cfg.model, p, self.dims, optim=cfg.optim)
        if cfg.model.init_from:
            _, hf = read_hf_folder(cfg.model.init_from)
            load_hf_tensors(self.actor, self.adapter, hf)
        self.sampler = PromptSampler(len(self.train_rows), cfg.train.seed, cfg.data.shuffle)
        self.prompt_stats = PromptStats()
        self.reward_fn = get_reward_fn("arithmetic" if cfg.data.source.startswith("builtin:") else "exact_match")
        self.fleet: Fleet | None = None
        self.model_dir = self.run_dir / "hf_engine"
        if self.dims.is_rank0:
            self._write_engine_folder()
            self.fleet = self._start_fleet()
        self.ref: Model | None = None
        self.sync = WeightSync(self.actor, self.adapter, self.fleet, cfg.weight_sync.bucket_mb)
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
        shapes = _hf_shapes(self.cfg)
        (self.model_dir / MANIFEST).write_text(json.dumps(shapes))

    def _start_fleet(self) -> Fleet:
        r = self.cfg.rollout
        if r.engine_addresses:
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
        )

    def build_reference(self) -> None:
        """Frozen copy of the current actor (same layout: shards copy one to one)."""
        self.ref = build_gpt(self.cfg.model, self.cfg.parallel, self.dims, trainable=False)
        with torch.no_grad():
            src = dict(self.actor.core.named_parameters())
            for name, p in self.ref.core.named_parameters():
                p.copy_(src[name])

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
            rows_idx = self._dp_rows(tokens.shape[0])

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

    def _dp_rows(self, n: int) -> slice:
        per = n // self.dims.dp
        return slice(self.dims.dp_rank * per, (self.dims.dp_rank + 1) * per)

    # ------------------------------------------------------------------ phases

    def generate(self, step: int, num_prompts: int, samples: int) -> tuple[RolloutBatch, dict[str, float]]:
        stats: dict[str, float] = {}
        batch = None
        if self.dims.is_rank0:
            assert self.fleet is not None
            prompts = take_prompts(self.sampler, self.train_rows, self.tok, num_prompts, self.cfg, self.prompt_stats)
            batch, stats = generate_batch(
                self.fleet,
                self.tok,
                prompts,
                self.cfg,
                self.reward_fn,
                seed=self.cfg.train.seed + step,
                samples=samples,
            )
            stats["rollout/skipped_overlong_prompts"] = float(self.prompt_stats.skipped_overlong)
            stats["rollout/truncated_overlong_prompts"] = float(self.prompt_stats.truncated_overlong)
            stats["fleet/restarts"] = float(self.fleet.restarts)
        else:  # keep the sampler position identical on every rank (resume)
            take_prompts(self.sampler, self.train_rows, self.tok, num_prompts, self.cfg, self.prompt_stats)
        return broadcast_batch(batch), stats

    def logprobs(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Old-policy (if several updates per rollout) and reference log-probs, (B, S) each."""
        a, mbs = self.cfg.algo, self.cfg.parallel.micro_batch_size
        out: dict[str, torch.Tensor] = {}
        if a.ppo_epochs * a.mini_batches > 1:
            out["old_logprobs"] = forward_logprobs(
                self.actor, batch.tokens, micro_batch_size=mbs, temperature=self.cfg.rollout.temperature
            )["logprobs"]
        if a.kl_coef > 0:
            assert self.ref is not None
            out["ref_logprobs"] = forward_logprobs(
                self.ref, batch.tokens, micro_batch_size=mbs, temperature=self.cfg.rollout.temperature
            )["logprobs"]
        return out

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        res = algo.compute_advantages(
            self.cfg.algo.advantage, mask=batch.mask, rewards=batch.rewards, group_ids=batch.group_ids
        )
        return res.advantages

    def update(
        self, batch: RolloutBatch, adv: torch.Tensor, lps: dict[str, torch.Tensor], lr: float
    ) -> dict[str, float]:
        a = self.cfg.algo
        B = batch.size
        rows: dict[str, torch.Tensor] = {
            "tokens": batch.tokens,
            "mask": batch.mask,
            "adv": adv,
            "engine_logprobs": batch.engine_logprobs,
            **lps,
        }
        totals: dict[str, float] = {}
        n_updates = 0
        for _epoch in range(a.ppo_epochs):
            for mb_idx in range(a.mini_batches):
                per = B // a.mini_batches
                sl = slice(mb_idx * per, (mb_idx + 1) * per)
                mini = {k: v[sl] for k, v in rows.items()}
                denom = algo.global_denominator(
                    a.loss_agg, mini["mask"], fixed_normalizer=float(self.cfg.rollout.max_response_len)
                )
                local = {k: v[self._dp_rows(per)] for k, v in mini.items()}
                stats, gnorm = train_step(
                    self.actor,
                    local,
                    self._policy_loss_fn(denom),
                    micro_batch_size=self.cfg.parallel.micro_batch_size,
                    lr=lr,
                )
                n_updates += 1
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + gnorm
        tokens = max(totals.pop("tokens", 1.0), 1.0)
        out = {
            "train/loss": totals.pop("loss") / n_updates,
            "train/grad_norm": totals.pop("grad_norm") / n_updates,
            "train/lr": lr,
        }
        for k, v in totals.items():
            out[f"train/{k.removesuffix('_sum')}"] = v / tokens
        return out

    def _policy_loss_fn(self, denom: float) -> Any:
        a, temp = self.cfg.algo, self.cfg.rollout.temperature
        dims = self.dims

        def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            from megarl.model.forward import vocab_parallel_entropy

            mask = mb["mask"]
            lp = vocab_parallel_logprobs(logits, _labels(mb["tokens"]), temp)
            old = mb["old_logprobs"] if "old_logprobs" in mb else lp.detach()
            tis = None
            stats: dict[str, torch.Tensor] = {}
            if a.tis_cap > 0:
                tis, tstats = algo.tis_weights(old, mb["engine_logprobs"], mask, cap=a.tis_cap)
            adv_tok = algo.sequence_to_token(mb["adv"], mask) if mb["adv"].dim() == 1 else mb["adv"]
            per_tok, pstats = algo.policy_loss(
                lp,
                old,
                adv_tok,
                mask,
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                dual_clip=a.dual_clip or None,
                tis_weights=tis,
            )
            n = mask.sum()
            if "ref_logprobs" in mb:
                kl = algo.kl_estimate(lp, mb["ref_logprobs"], a.kl_estimator)
                per_tok = per_tok + a.kl_coef * kl
                stats["kl_sum"] = (kl.detach() * mask).sum()
            if a.entropy_coef > 0:
                ent = vocab_parallel_entropy(logits, temp, dims.tp_group)
                per_tok = per_tok - a.entropy_coef * ent
                stats["entropy_sum"] = (ent.detach() * mask).sum()
            loss = algo.aggregate(per_tok, mask, mode=a.loss_agg, global_denominator=denom)
            mismatch = ((mb["engine_logprobs"] - lp.detach()).abs() * mask).sum()
            stats.update(
                {
                    "loss": loss.detach(),
                    "tokens": n,
                    "clipfrac_sum": pstats["clipfrac"] * n,
                    "engine_logprob_absdiff_sum": mismatch,
                }
            )
            return loss, stats

        return loss_fn

    def push_weights(self) -> dict[str, float]:
        self.version += 1
        stats = self.sync.push(self.version)
        out = {f"sync/{k}": v for k, v in stats.items()}
        if self.cfg.weight_sync.probe:
            out["sync/probe_max_abs_diff"] = probe(
                self.actor, self.fleet, self.probe_tokens, self.cfg.rollout.temperature, self.cfg.weight_sync.probe_tol
            )
        return out

    def validate(self) -> float:
        """Greedy accuracy on the validation prompts (rank 0 asks the fleet; shared to all)."""
        value = torch.zeros(1, dtype=torch.float64)
        if self.dims.is_rank0:
            assert self.fleet is not None
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


def _pack(seqs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) id lists -> tokens (B, S), mask (B, S) in the forward.py layout."""
    S = max(len(p) + len(r) for p, r in seqs)
    tokens = torch.full((len(seqs), S), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), S)
    for b, (p, r) in enumerate(seqs):
        tokens[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, len(p) - 1 : len(p) + len(r) - 1] = 1.0
    return tokens, mask


def _hf_shapes(cfg: RunConfig) -> dict[str, list[int]]:
    """Shapes of every HF tensor of this architecture (the engine's update manifest)."""
    m = cfg.model
    hd, H = m.head_dim, m.hidden_size
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [m.vocab_size, H], "model.norm.weight": [H]}
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = [m.vocab_size, H]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [H],
                p + "post_attention_layernorm.weight": [H],
                p + "self_attn.q_proj.weight": [m.num_attention_heads * hd, H],
                p + "self_attn.k_proj.weight": [m.num_query_groups * hd, H],
                p + "self_attn.v_proj.weight": [m.num_query_groups * hd, H],
                p + "self_attn.o_proj.weight": [H, m.num_attention_heads * hd],
                p + "mlp.gate_proj.weight": [m.ffn_hidden_size, H],
                p + "mlp.up_proj.weight": [m.ffn_hidden_size, H],
                p + "mlp.down_proj.weight": [H, m.ffn_hidden_size],
            }
        )
        if m.arch == "qwen2":
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": [m.num_attention_heads * hd],
                    p + "self_attn.k_proj.bias": [m.num_query_groups * hd],
                    p + "self_attn.v_proj.bias": [m.num_query_groups * hd],
                }
            )
    return shapes
