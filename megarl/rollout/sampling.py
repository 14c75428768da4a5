"""One sampling round: prompts taken, responses sampled on the fleet, scored, packed into a
:class:`RolloutBatch` (the phase-1 collector, :mod:`megarl.rollout.collector`, runs rounds).

Rank 0 talks to the fleet and scores rewards; :func:`megarl.rollout.batch.broadcast_batch`
then ships the packed tensors (no Python objects) to every trainer rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megarl import algo
from megarl.config import AlgoConfig, DataConfig, EnvConfig, RewardConfig, RolloutConfig, RunConfig
from megarl.data.prompts import DataError, PromptRecord, PromptSampler, RolloutError, fit_prompt
from megarl.data.tokenizer import PromptTokenizer
from megarl.fleet.fleet import Fleet
from megarl.rewards.runner import RewardReport, RewardRunner, RewardSample
from megarl.rollout.episode import Episode
from megarl.rollout.routes import place_routes
from megarl.types import RolloutBatch

log = logging.getLogger("megarl.rollout")


class EncodesPrompts(Protocol):
    """What prompts are measured and encoded with: the tokenizer, or an episode's turn renderer."""

    def encode_prompt(self, rec: PromptRecord) -> list[int]: ...


@dataclass(frozen=True)
class CollectSettings:
    """What collection reads of the run's config: its sections, not the whole run."""

    rollout: RolloutConfig
    algo: AlgoConfig
    """Dynamic sampling, the overlong reward buffer, whether the loss reads engine log-probs."""
    reward: RewardConfig
    data: DataConfig
    """The overlong-prompt rule and the sampler's shuffle."""
    env: EnvConfig
    """Multi-turn episodes (``env.fn`` set) or single-turn samples."""
    seed: int
    """``train.seed``: the prompt sampler's and each round's sampling seed."""
    run_dir: str
    """``train.run_dir`` (``rollout.dump_rollouts`` writes there)."""

    @classmethod
    def of(cls, cfg: RunConfig) -> CollectSettings:
        return cls(cfg.rollout, cfg.algo, cfg.reward, cfg.data, cfg.env, cfg.train.seed, cfg.train.run_dir)


@dataclass
class PromptStats:
    skipped_overlong: int = 0
    truncated_overlong: int = 0
    recent: list[str] = field(default_factory=list)
    """Overlong prompts met since :meth:`drain` ('file:line (N tokens)'), for one log line a step."""

    def drain(self) -> list[str]:
        out, self.recent = self.recent, []
        return out


def take_prompts(
    sampler: PromptSampler,
    records: list[PromptRecord],
    tok: EncodesPrompts,
    k: int,
    cfg: CollectSettings,
    stats: PromptStats,
    positions: list[int] | None = None,
) -> list[tuple[PromptRecord, list[int]]]:
    """Next ``k`` prompts that fit ``rollout.max_prompt_len`` (overlong: skip or truncate, counted;
    the caller logs them once per step, see :func:`overlong_summary`). ``positions`` gets each
    taken prompt's stream position (:attr:`PromptSampler.drawn` when it was drawn)."""
    limit = cfg.rollout.max_prompt_len
    out: list[tuple[PromptRecord, list[int]]] = []
    scanned = 0
    while len(out) < k:
        first = sampler.drawn
        for pos, i in enumerate(sampler.next(k - len(out)), start=first):
            scanned += 1
            ids = tok.encode_prompt(records[i])
            fitted = fit_prompt(ids, limit, cfg.data.overlong_prompt)
            if len(ids) > limit:
                stats.recent.append(f"{records[i].where} ({len(ids)} tokens)")
                if fitted is None:
                    stats.skipped_overlong += 1
                    continue
                stats.truncated_overlong += 1
            assert fitted is not None
            out.append((records[i], fitted))
            if positions is not None:
                positions.append(pos)
        if scanned > 10 * len(records) + k:
            raise DataError(f"fewer than {k} prompts fit rollout.max_prompt_len={limit}")
    return out


def overlong_summary(recent: list[str], cfg: CollectSettings) -> str:
    """One log line for the overlong prompts of a step ('' if none): the count and two examples."""
    if not recent:
        return ""
    action = "skipped" if cfg.data.overlong_prompt == "skip" else "truncated"
    more = f" and {len(recent) - 2} more" if len(recent) > 2 else ""
    return (
        f"{action} {len(recent)} prompts longer than rollout.max_prompt_len={cfg.rollout.max_prompt_len}: "
        f"{', '.join(recent[:2])}{more}"
    )


def validation_prompts(
    records: list[PromptRecord], tok: EncodesPrompts, cfg: CollectSettings
) -> list[tuple[PromptRecord, list[int]]]:
    """Validation prompts under the same ``data.overlong_prompt`` rule as training (one log line
    for those skipped): a prompt past the model's context would fail the engine."""
    limit, mode = cfg.rollout.max_prompt_len, cfg.data.overlong_prompt
    fitted = [(r, fit_prompt(tok.encode_prompt(r), limit, mode)) for r in records]
    rows = [(r, ids) for r, ids in fitted if ids is not None]
    if len(rows) < len(fitted):
        log.warning(
            "validation: skipped %d of %d prompts longer than rollout.max_prompt_len=%d",
            len(fitted) - len(rows),
            len(fitted),
            limit,
        )
    return rows


def answer_sequences(
    records: list[PromptRecord], tok: PromptTokenizer, cfg: CollectSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each validation prompt (the :func:`validation_prompts` rule) followed by its reference
    answer and EOS (``tok.encode_answer``), as (tokens, mask) with the mask on the answer ids
    (``train.val_metric: answer_prob``). A row with an empty answer is refused by name."""
    for r in records:
        if not r.answer.strip():
            raise DataError(
                f"{r.where}: field '{cfg.data.answer_key}' (data.answer_key) is empty: "
                "train.val_metric=answer_prob scores the probability of each validation row's answer"
            )
    return pack_sequences([(ids, tok.encode_answer(r)) for r, ids in validation_prompts(records, tok, cfg)], tok.pad_id)


def integrity_sequence(records: list[PromptRecord], tok: PromptTokenizer, cfg: CollectSettings) -> list[int]:
    """The weight-sync integrity check's fixed sequence: the first validation prompt + answer that fits
    rollout.max_prompt_len + max_response_len (else the first, cut to that length)."""
    limit = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    seqs = [tok.encode_prompt(r) + tok.encode_answer(r) for r in records[:64]]
    return next((ids for ids in seqs if len(ids) <= limit), seqs[0][:limit])


@dataclass
class Group:
    """One prompt's samples: ``samples[j]`` = (response ids, engine logprobs, truncated)."""

    record: PromptRecord
    prompt_ids: list[int]
    samples: list[tuple[list[int], list[float], bool]]
    texts: list[str]
    rewards: list[float]
    version: int = -1
    """Policy version the engines served when they sampled this group (-1: not recorded)."""
    episodes: list[Episode] | None = None
    """Multi-turn: each sample's episode (``samples[j]`` is ``episodes[j].sample()``), whose
    observation ids are not trained; None: every response id was generated."""
    routes: list[torch.Tensor] | None = None
    """Each sample's engine routes (prompt + response - 1, layers, top-k) when the engines
    return them (``algo.router_replay: rollout``; ``megarl.rollout.routes``), else None."""


def engine_logprobs_wanted(cfg: CollectSettings, step: int) -> bool:
    """Does step ``step`` (0-based) ask the engines for the sampled tokens' log-probs? Always when
    the loss reads them (TIS, off-policy batches); else on every ``rollout.engine_logprobs_every``-th
    step from the first, for the train/inference mismatch metrics."""
    r = cfg.rollout
    if cfg.algo.tis_cap > 0 or r.max_staleness > 0:
        return True
    return r.engine_logprobs_every > 0 and step % r.engine_logprobs_every == 0


def sample_groups(
    fleet: Fleet,
    tok: PromptTokenizer,
    prompts: list[tuple[PromptRecord, list[int]]],
    cfg: CollectSettings,
    rewards: RewardRunner,
    seeds: list[int],
    samples: int,
    logprobs: bool = True,
) -> tuple[list[Group], int, RewardReport]:
    """Rank 0: ``samples`` responses per prompt, scored, prompt ``i`` seeded ``seeds[i]`` (with
    ``rollout.seeded``; :mod:`megarl.rollout.seeds`). Returns (groups, min version, reward
    report); without ``logprobs`` the samples' engine log-probs are empty."""
    r = cfg.rollout
    outs, version = fleet.generate(
        [ids for _, ids in prompts],
        n=samples,
        max_tokens=r.max_response_len,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=tok.eos_ids,
        min_tokens=r.min_response_len,
        seeds=list(seeds) if r.seeded else None,
        logprobs=logprobs,
    )
    per_prompt = []
    for (rec, _), out in zip(prompts, outs):
        if len(out) != samples:
            raise RolloutError(f"engine returned {len(out)} samples for prompt {rec.where}, want {samples}")
        per_prompt.append([(list(s["token_ids"]), list(s["logprobs"]), s["finish_reason"] == "length") for s in out])
    texts = tok.decode_many([ids for smp in per_prompt for ids, _, _ in smp])
    groups = [
        Group(rec, pids, smp, texts[i * samples : (i + 1) * samples], [], version, routes=_routes(out))
        for i, ((rec, pids), smp, out) in enumerate(zip(prompts, per_prompt, outs))
    ]
    # one call for the whole round: the reward workers share it out
    scores, report = rewards.score([reward_sample(g.record, t, j) for g in groups for j, t in enumerate(g.texts)])
    for gi, g in enumerate(groups):
        g.rewards = scores[gi * samples : (gi + 1) * samples]
        if cfg.algo.overlong_buffer_len:
            lengths = torch.tensor([len(ids) for ids, _, _ in g.samples], dtype=torch.float32)
            pen = algo.overlong_soft_penalty(
                lengths, max_len=r.max_response_len, cache_len=cfg.algo.overlong_buffer_len
            )
            g.rewards = [x + float(p) for x, p in zip(g.rewards, pen)]
    return groups, version, report


def _routes(out: list[dict[str, Any]]) -> list[torch.Tensor] | None:
    """A prompt's samples' engine routes, when the engines sent them."""
    return [s["routes"] for s in out] if out and "routes" in out[0] else None


def reward_sample(rec: PromptRecord, response: str, j: int) -> RewardSample:
    """Response ``j`` to ``rec`` as a reward sees it (``where`` = 'file:line #j' for the log)."""
    return RewardSample(
        response=response,
        prompt=rec.prompt,
        answer=rec.answer,
        messages=rec.messages,
        extra=rec.extra,
        where=f"{rec.where} #{j}",
    )


def has_signal(g: Group) -> bool:
    """DAPO dynamic sampling keeps a group only if its rewards are not all equal."""
    rw = torch.tensor(g.rewards)
    return bool(algo.groups_with_signal(rw, torch.zeros(len(g.rewards), dtype=torch.long)).any())


def _ragged(
    rows: list[list[float]] | list[list[int]], starts: torch.Tensor, S: int, fill: float, dtype: torch.dtype
) -> torch.Tensor:
    """(B, S) tensor of ``fill`` with row ``b``'s values written from column ``starts[b]`` on
    (one scatter for the whole batch: no per-row tensor)."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    out = torch.full((len(rows), S), fill, dtype=dtype)
    if int(lens.sum()):
        b = torch.repeat_interleave(torch.arange(len(rows)), lens)
        offset = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        out[b, starts[b] + offset] = torch.tensor([x for r in rows for x in r], dtype=dtype)
    return out


def _response_mask(plen: torch.Tensor, rlen: torch.Tensor, S: int) -> torch.Tensor:
    """(B, S) = 1 from column ``prompt_len - 1`` for ``response_len`` columns."""
    col = torch.arange(S)
    return ((col >= plen[:, None] - 1) & (col < (plen + rlen)[:, None] - 1)).float()


def pack_sequences(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, response ids) pairs -> tokens (B, S) right-padded, mask (B, S) = 1 where
    ``tokens[t+1]`` is a response token (the forward.py layout)."""
    plen = torch.tensor([len(p) for p, _ in seqs], dtype=torch.long)
    rlen = torch.tensor([len(r) for _, r in seqs], dtype=torch.long)
    S = int((plen + rlen).max())
    tokens = _ragged([p + r for p, r in seqs], torch.zeros_like(plen), S, pad_id, torch.long)
    return tokens, _response_mask(plen, rlen, S)


def pack_trained(seqs: list[tuple[list[int], list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, response ids, trained) triples -> tokens (B, S), mask (B, S): as
    :func:`pack_sequences`, with the mask 0 where ``trained`` is 0 (an episode's observations)."""
    tokens, mask = pack_sequences([(p, r) for p, r, _ in seqs], pad_id)
    plen = torch.tensor([len(p) for p, _, _ in seqs], dtype=torch.long)
    return tokens, mask * _ragged([t for _, _, t in seqs], plen - 1, tokens.shape[1], 0.0, torch.float32)


def pack_groups(groups: list[Group], pad_id: int, version: int, logprobs: bool = True) -> RolloutBatch:
    """Groups -> (B, S) tensors in the forward.py layout (``engine_logprobs`` None without ``logprobs``)."""
    seqs = [(p, ids, lp, tr) for g in groups for p, (ids, lp, tr) in zip(_prompts(g), g.samples, strict=True)]
    tokens, mask = pack_sequences([(p, rr) for p, rr, _, _ in seqs], pad_id)
    plen = torch.tensor([len(p) for p, _, _, _ in seqs], dtype=torch.long)
    turn_rewards = None
    if any(g.episodes is not None for g in groups):  # episodes: observation ids are not trained
        trained = [m for g in groups for m in _trained(g)]
        mask = mask * _ragged(trained, plen - 1, tokens.shape[1], 0.0, torch.float32)
        placed = [r for g in groups for r in _placed_rewards(g)]
        turn_rewards = _ragged(placed, plen - 1, tokens.shape[1], 0.0, torch.float32)
    # engine log-probs sit under the mask: response token j's at column prompt_len - 1 + j
    elp = (
        _ragged([lp[: len(rr)] for _, rr, lp, _ in seqs], plen - 1, tokens.shape[1], 0.0, torch.float32)
        if logprobs
        else None
    )
    return RolloutBatch(
        tokens=tokens,
        mask=mask,
        engine_logprobs=elp,
        rewards=torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32),
        group_ids=torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], dtype=torch.long),
        response_lens=torch.tensor([len(rr) for _, rr, _, _ in seqs], dtype=torch.long),
        truncated=torch.tensor([tr for _, _, _, tr in seqs], dtype=torch.bool),
        version=version,
        texts=[t for g in groups for t in g.texts],
        versions=torch.tensor([g.version if g.version >= 0 else version for g in groups for _ in g.samples]),
        turn_rewards=turn_rewards,
        routes=_batch_routes(groups, tokens.shape[1]),
    )


def _batch_routes(groups: list[Group], S: int) -> torch.Tensor | None:
    """(B, S, L, k) engine routes when the groups carry them (all or none do)."""
    if all(g.routes is None for g in groups):
        return None
    if any(g.routes is None or g.episodes is not None for g in groups):
        raise RolloutError("engine routes in some groups only, or with multi-turn episodes (not supported)")
    lengths = [len(g.prompt_ids) + len(ids) for g in groups for ids, _, _ in g.samples]
    return place_routes([r for g in groups for r in g.routes or []], lengths, S)


def _prompts(g: Group) -> list[list[int]]:
    """Each sample's prompt ids: the group's, or each episode's own (an agent renders its own)."""
    if g.episodes is None:
        return [g.prompt_ids] * len(g.samples)
    return [e.prompt_ids for e in g.episodes]


def _placed_rewards(g: Group) -> list[list[float]]:
    """Per sample of ``g``, its reward spread over its response ids: an episode's step rewards
    at each turn's last generated id, the rest (the final answer's score; all of a failed
    episode's or a plain sample's reward) at its last generated id. Each row sums to its reward."""
    out = []
    for j, (ids, _, _) in enumerate(g.samples):
        row = [0.0] * len(ids)
        e = g.episodes[j] if g.episodes is not None else None
        ends = e.turn_ends() if e is not None else [len(ids) - 1 if ids else None]
        last = [x for x in ends if x is not None]
        if last:  # (a row without a generated id has no mask: no loss reads it)
            rest = g.rewards[j]
            if e is not None and not e.failed:
                for end, r in zip(ends, e.rewards, strict=False):
                    if end is not None and r:
                        row[end] += r
                        rest -= r
            row[last[-1]] += rest
        out.append(row)
    return out


def _trained(g: Group) -> list[list[int]]:
    """Per sample of ``g``: 1 on each generated response id, 0 on each observation id."""
    if g.episodes is None:
        return [[1] * len(ids) for ids, _, _ in g.samples]
    return [e.trained() for e in g.episodes]


def batch_stats(batch: RolloutBatch) -> dict[str, float]:
    rw, lens, trunc = batch.rewards, batch.response_lens, batch.truncated
    return {
        "rollout/reward_mean": float(rw.mean()),
        "rollout/reward_std": float(rw.std()) if batch.size > 1 else 0.0,
        "rollout/response_len_mean": float(lens.float().mean()),
        "rollout/response_len_max": float(lens.max()),
        "rollout/truncated_frac": float(trunc.float().mean()),
        "rollout/tokens": float(batch.mask.sum()),  # generated (trained) tokens: an episode's observations are not
        # prompt + response tokens (the trainer's work); mask is 1 from position prompt_len-1 on
        "rollout/sequence_tokens": float((batch.mask.argmax(dim=1) + 1 + lens).sum()),
        "rollout/policy_version": float(batch.version),
    }
