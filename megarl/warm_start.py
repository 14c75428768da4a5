"""Supervised warm start: a few steps of token-mean NLL on the reference answers (+ EOS),
so the policy knows the answer format before RL. Batches are packed like rollouts
(``megarl.rollout.sampling.pack_sequences``) and split over DP ranks like the RL update. It reads
its own section (``warm_start``), the optimizer's schedule shape (``optim``), the micro-batch
size and the seed (:class:`WarmStartSettings`), not the whole run config."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable

import torch

from megarl.config import OptimConfig, RunConfig, WarmStartConfig
from megarl.data.prompts import PromptRecord
from megarl.data.tokenizer import PromptTokenizer
from megarl.distributed import ParallelDims
from megarl.model.builder import Model
from megarl.model.forward import labels_of, vocab_parallel_logprobs
from megarl.model.train import train_step
from megarl.planning import lr_at
from megarl.rollout.sampling import pack_sequences, pack_trained
from megarl.update.rows import dp_rows

log = logging.getLogger("megarl")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartSettings:
    """What the warm start reads of the run config (:meth:`of`)."""

    warm_start: WarmStartConfig
    """Its own section: steps, LR, batch size."""
    optim: OptimConfig
    """The actor's optimizer section: the LR schedule's shape (constant or cosine, its floor)."""
    seed: int
    """``train.seed``; the warm start's batches draw from seed + 17."""
    micro_batch_size: int
    """``parallel.micro_batch_size``, rows."""

    @classmethod
    def of(cls, cfg: RunConfig) -> WarmStartSettings:
        return cls(
            warm_start=cfg.warm_start,
            optim=cfg.optim,
            seed=cfg.train.seed,
            micro_batch_size=cfg.parallel.micro_batch_size,
        )


Example = Callable[[PromptRecord], tuple[list[int], list[int], list[int]]]
"""A row → (prompt ids, target ids, trained: 1 where a target id is learned, 0 where it is given)."""


def warm_start(
    cfg: WarmStartSettings,
    dims: ParallelDims,
    actor: Model,
    tok: PromptTokenizer,
    rows: list[PromptRecord],
    example: Example | None = None,
) -> list[float]:
    """``warm_start.steps`` supervised steps at ``warm_start.lr`` (the optimizer's schedule, at most
    10 warm-up steps); returns the NLL per token of each step. ``example`` makes each row's
    target (default: its reference answer + EOS, all learned); with an environment that can
    demonstrate its task, a whole tool-using episode whose observations are given, not learned
    (``megarl.rollout.demonstrations``)."""
    ws, micro_batch_size = cfg.warm_start, cfg.micro_batch_size
    rng = random.Random(cfg.seed + 17)
    losses = []
    for step in range(ws.steps):
        picked = [rows[rng.randrange(len(rows))] for _ in range(ws.batch_size)]
        if example is None:
            tokens, mask = pack_sequences([(tok.encode_prompt(r), tok.encode_answer(r)) for r in picked], tok.pad_id)
        else:
            tokens, mask = pack_trained([example(r) for r in picked], tok.pad_id)
        denom = float(mask.sum())
        mine, _ = dp_rows(tokens.shape[0], micro_batch_size, dims)

        def loss_fn(
            mb: dict[str, torch.Tensor], logits: torch.Tensor, denom: float = denom
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
            nll = -(lp * mb["mask"]).sum()
            return nll / denom, {"nll": nll}

        lr = lr_at(step, dataclasses.replace(cfg.optim, lr=ws.lr, warmup_steps=min(10, ws.steps)), ws.steps)
        stats, _ = train_step(
            actor,
            {"tokens": tokens[mine], "mask": mask[mine]},
            loss_fn,
            micro_batch_size=micro_batch_size,
            lr=lr,
        )
        losses.append(stats["nll"] / denom)
        if dims.is_rank0 and (step % 50 == 0 or step == ws.steps - 1):
            log.info("warm-start %d/%d nll %.4f", step + 1, ws.steps, losses[-1])
    return losses
