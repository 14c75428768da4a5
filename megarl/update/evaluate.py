"""Phase 2: forward-only passes over a rollout — old-policy and reference log-probs, critic
values — split over DP ranks (``megarl.model.forward``), plus the train/inference mismatch; and
the same forward teacher-forcing reference answers (``train.val_metric: answer_prob``)."""

from __future__ import annotations

import torch

from megarl.config import AlgoConfig, ParallelConfig, RolloutConfig
from megarl.model.builder import Model
from megarl.model.forward import forward_logprobs, forward_values
from megarl.model.microbatch import row_lengths
from megarl.model.routes import stage_routes
from megarl.types import PolicyEval, RolloutBatch


def evaluate(
    a: AlgoConfig,
    r: RolloutConfig,
    p: ParallelConfig,
    batch: RolloutBatch,
    actor: Model,
    ref: Model | None,
    critic: Model | None,
) -> PolicyEval:
    """What the step's losses need: π_old when the samples are reused (several updates), the
    KL is a reward penalty, there is a critic, or the samples come from an older policy
    (``rollout.max_staleness`` > 0: π_old is then decoupled PPO's proximal policy, the engine's
    log-probs the behaviour policy), or its MoE routes are replayed in the update
    (``algo.router_replay: trainer``: recorded in the same forward; ``rollout``: the engines',
    replayed in it too); π_ref when KL is on; V_old with a critic. Log-probs are taken at
    ``rollout.temperature``; micro-batches follow ``parallel``."""
    temp = r.temperature
    lmbs = p.logprob_micro_batch_size

    def fwd_mbs(model: Model) -> int:  # bigger forward-only micro-batches when they divide the batch
        return lmbs if lmbs and batch.size % (model.dims.dp * lmbs) == 0 else p.micro_batch_size

    out = PolicyEval()
    mbs = fwd_mbs(actor)
    # token budget: rows grouped by length and cut to it, packed or not (values beyond a row's
    # last response position come back as 0; every consumer reads them under the mask)
    lengths, budget, pack = row_lengths(batch.mask), p.max_tokens_per_micro_batch, p.pack_sequences

    def logprobs(model: Model, routes: bool = False, replay: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return forward_logprobs(
            model,
            batch.tokens,
            micro_batch_size=mbs,
            temperature=temp,
            lengths=lengths,
            max_tokens=budget,
            pack=pack,
            routes=routes,
            replay=replay,
        )

    stale = r.max_staleness > 0  # decoupled PPO: the proximal policy is the trainer's
    record, replay = a.router_replay == "trainer", a.router_replay == "rollout"
    if a.ppo_epochs * a.mini_batches > 1 or a.kl_mode == "reward" or critic is not None or stale or record or replay:
        beyond = torch.arange(batch.tokens.shape[1]) >= lengths[:, None]  # padding routes live in the update
        engine = engine_routes(batch, actor).masked_fill(beyond[:, :, None, None], -1) if replay else None
        old = logprobs(actor, routes=record, replay=engine)
        out.old_logprobs = old["logprobs"]
        if record:
            out.routes = old["routes"].masked_fill(beyond[:, :, None, None], -1)
        if engine is not None:  # the old forward's live choices were counted against the engines'
            out.routes, out.route_mismatch = engine, actor.routes.mismatch(actor.dims, "moe/engine_route_mismatch")
    if a.kl_coef > 0:
        assert ref is not None
        out.ref_logprobs = logprobs(ref)["logprobs"]
    if critic is not None:
        out.old_values = forward_values(
            critic, batch.tokens, micro_batch_size=fwd_mbs(critic), lengths=lengths, max_tokens=budget, pack=pack
        )
    return out


def engine_routes(batch: RolloutBatch, actor: Model) -> torch.Tensor:
    """The engines' routes of ``batch`` for the actor's pipeline stage (``algo.router_replay: rollout``)."""
    if batch.routes is None:
        raise ValueError(
            "algo.router_replay='rollout' needs the engines' routes; this batch has none "
            "(engines started elsewhere need --return-routes)"
        )
    if actor.routes is None:
        raise ValueError("algo.router_replay='rollout': the actor was built without routing replay")
    cfg = actor.config
    return stage_routes(batch.routes, actor.routes.layers, int(cfg.num_moe_experts), int(cfg.moe_router_topk))


def mismatch(batch: RolloutBatch, ev: PolicyEval) -> dict[str, float]:
    """Train/inference mismatch on the sampled tokens: mean |Δlogp| and max p_train/p_engine;
    with the engines' routes, the old forward's experts vs theirs (``moe/engine_route_mismatch*``)."""
    if ev.old_logprobs is None or batch.engine_logprobs is None:
        return dict(ev.route_mismatch)
    m = batch.mask.bool()
    d = ev.old_logprobs[m] - batch.engine_logprobs[m]
    if d.numel() == 0:
        return dict(ev.route_mismatch)
    return {
        **ev.route_mismatch,
        "rollout/mismatch_abs_logp_mean": float(d.abs().mean()),
        "rollout/mismatch_max_prob_ratio": float(d.exp().max()),
    }


def answer_probability(actor: Model, tokens: torch.Tensor, mask: torch.Tensor, p: ParallelConfig) -> float:
    """Mean over rows of π(answer | prompt) = exp(Σ_t mask·log π(tokens[t+1] | tokens[:t+1])) at
    temperature 1, ``tokens`` / ``mask`` (B, S) in the forward.py layout (mask 1 on the answer's
    ids). The trainer's own forward-only pass (TP / PP / DP as for π_old): rows are padded with
    empty ones to a multiple of DP × micro-batch so they split over DP; every rank returns it."""
    mbs = p.logprob_micro_batch_size or p.micro_batch_size
    B = tokens.shape[0]
    unit = actor.dims.dp * mbs
    pad = -B % unit
    tokens = torch.cat([tokens, tokens.new_zeros((pad, tokens.shape[1]))])
    mask = torch.cat([mask, mask.new_zeros((pad, mask.shape[1]))])
    lp = forward_logprobs(
        actor,
        tokens,
        micro_batch_size=mbs,
        temperature=1.0,
        lengths=row_lengths(mask),
        max_tokens=p.max_tokens_per_micro_batch,
        pack=p.pack_sequences,
    )["logprobs"]
    return float((lp * mask).sum(dim=1)[:B].double().exp().mean())
