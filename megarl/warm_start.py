"""Supervised warm start: a few steps of token-mean NLL on the reference answers (+ EOS),
so the policy knows the answer format before RL. Batches are packed like rollouts
(``megarl.rollout.sampling.pack_sequences``, one example a row) and split over DP ranks like the
RL update. It reads its own section (``warm_start``), the optimizer's schedule shape (``optim``),
the micro-batch size and the seed (:class:`WarmStartSettings`), not the whole run config.

Each step also counts the examples the model reproduces exactly (every learned id its top
choice, teacher-forced), on the batch before the step's update: what greedy decoding would write
on those rows, since observations are given. ``warm_start.stop_at_exact`` stops on that share."""

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
from megarl.model.forward import labels_of, vocab_parallel_argmax, vocab_parallel_logprobs
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


@dataclasses.dataclass
class WarmStartResult:
    """What each step of the warm start measured, before its update."""

    nll: list[float]
    """NLL per learned token of each step."""
    exact: list[float]
    """Share of each step's examples reproduced exactly (every learned id the top choice)."""


def exact_rows(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """How many rows of ``labels`` (B, S) have the vocab-parallel argmax of ``logits`` (B, S, V/tp)
    at every position where ``mask`` (B, S) is set — rows with nothing learned not counted. () int."""
    top = vocab_parallel_argmax(logits.detach(), dims.tp_rank, dims.tp_group)  # (B, S)
    learned = mask > 0
    wrong = ((top != labels) & learned).any(dim=-1)
    return (learned.any(dim=-1) & ~wrong).sum()


def warm_start(
    cfg: WarmStartSettings,
    dims: ParallelDims,
    actor: Model,
    tok: PromptTokenizer,
    rows: list[PromptRecord],
    example: Example | None = None,
) -> WarmStartResult:
    """``warm_start.steps`` supervised steps at ``warm_start.lr`` (the optimizer's schedule, at most
    10 warm-up steps), fewer when a step's exact share reaches ``warm_start.stop_at_exact`` (that
    step still updates). ``example`` makes each row's target (default: its reference answer +
    EOS, all learned); with an environment that can demonstrate its task, a whole tool-using
    episode whose observations are given, not learned (``megarl.rollout.demonstrations``)."""
    ws, micro_batch_size = cfg.warm_start, cfg.micro_batch_size
    rng = random.Random(cfg.seed + 17)
    result = WarmStartResult(nll=[], exact=[])
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
            labels = labels_of(mb["tokens"])
            lp = vocab_parallel_logprobs(logits, labels, 1.0)
            nll = -(lp * mb["mask"]).sum()
            return nll / denom, {"nll": nll, "exact": exact_rows(logits, labels, mb["mask"], actor.dims)}

        lr = lr_at(step, dataclasses.replace(cfg.optim, lr=ws.lr, warmup_steps=min(10, ws.steps)), ws.steps)
        stats, _ = train_step(
            actor,
            {"tokens": tokens[mine], "mask": mask[mine]},
            loss_fn,
            micro_batch_size=micro_batch_size,
            lr=lr,
        )
        result.nll.append(stats["nll"] / denom)
        result.exact.append(stats["exact"] / len(picked))
        stop = 0 < ws.stop_at_exact <= result.exact[-1]
        if dims.is_rank0 and (step % 50 == 0 or step == ws.steps - 1 or stop):
            log.info("warm-start %d/%d nll %.4f exact %.3f", step + 1, ws.steps, result.nll[-1], result.exact[-1])
        if stop:
            if dims.is_rank0:
                log.info("warm start stopped after step %d: exact %.3f >= warm_start.stop_at_exact=%g",
                         step + 1, result.exact[-1], ws.stop_at_exact)  # fmt: skip
            break
    return result
