"""Forward passes of megatron models through megatron's pipeline schedules: the schedule runner
(:func:`run_schedule`, shared with the optimizer step of ``megarl.model.train``), the
vocab-parallel log-prob / entropy math, and the forward-only passes (log-probs, values, greedy
decoding).

Token layout (all ranks agree): ``tokens (B, S)`` = prompt + response, right-padded.
Position ``t`` of every per-token tensor refers to the prediction of ``tokens[:, t+1]``:
``logprobs[:, t] = log π(tokens[t+1] | tokens[:t+1])`` and ``mask[:, t] = 1`` iff
``tokens[t+1]`` is a response token. The last column is always masked.

Micro-batches are fixed rows at full width, or token-budget groups of rows cut to their
longest row (``megarl.model.microbatch``; causal attention makes the cut exact), optionally
run padding-free as one packed row (``megarl.model.packing``, unpacked right after the model);
under PP the latter send their shapes between stages (megatron's ``variable_seq_lengths``).

Log-probs and entropy are computed vocab-parallel (the logits never leave their TP shard);
logits are divided by the sampling temperature on both sides (trainer and engine).

Process groups come from ``model.dims`` (its layout may differ from megatron's global one: the
critic's, see ``megarl.distributed.init_layout``): the schedule, the p2p communicator and the
grad finalisation get its ``ProcessGroupCollection``. The one exception is megatron's
``vocab_parallel_cross_entropy`` (log-probs), which only reads the global TP group: log-probs
are computed for language models on the global layout only (actor, reference), which
:func:`model_logits` checks.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megarl.model.builder import Model
from megarl.model.microbatch import balance_rows, row_lengths, take, token_budget_split
from megarl.model.packing import Packing, packings_of
from megarl.model.routes import collect, recording
from megarl.model.rows import micro_batches, routes_of, tokens_of
from megarl.model.seqpar import forward_padded, padded_length


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Push the logits of megatron's padded vocabulary rows to -1e30 (out of place).

    The exported HF model (and so every engine) has no padded rows; masking them here makes
    the trainer's distribution exactly the engine's.
    """
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    first_pad = vocab_size - start
    if first_pad >= v_local:
        return logits
    logits = logits.clone()
    logits[..., max(first_pad, 0) :] = -1e30
    return logits


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[labels] over the TP-sharded vocabulary. (b, s, v/tp) -> (b, s)."""
    from megatron.core import tensor_parallel

    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


def model_logits(model: Model, out: torch.Tensor) -> torch.Tensor:
    """The last stage's (b, s, v/tp) logits with padded vocabulary rows masked."""
    if not model.dims.global_layout:
        raise ValueError("vocab-parallel log-probs need the global TP group: build language models on it")
    return mask_padded_vocab(out, model.vocab_size, model.dims.tp_rank)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float, tp_group: Any) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the TP-sharded vocabulary. (b, s, v/tp) -> (b, s).

    H = logZ − Σ p·z with z the scaled logits; the sums over the vocabulary are all-reduces
    that are identities in backward (megatron's reduce_from_tensor_model_parallel_region),
    so gradients reach each shard's own logits.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float() / temperature
    zmax_all = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(zmax_all, op=dist.ReduceOp.MAX, group=tp_group)
    ez = torch.exp(z - zmax_all)
    sum_ez = reduce_from_tensor_model_parallel_region(ez.sum(-1), group=tp_group)
    sum_ezz = reduce_from_tensor_model_parallel_region((ez * z).sum(-1), group=tp_group)
    logz = torch.log(sum_ez) + zmax_all.squeeze(-1)
    return logz - sum_ezz / sum_ez


def run_schedule(
    model: Model,
    mbs: Sequence[Any],
    loss_fn: Callable[[Any, torch.Tensor], tuple[Any, ...]],
    forward_only: bool,
    packings: list[Packing | None] | None = None,
    per_token: bool = False,
) -> list[Any]:
    """Run ``mbs`` (batches of rows, ``megarl.model.rows``) through megatron's schedule;
    ``packings[i]``: run micro-batch i packed. Its output reaches ``loss_fn`` unpacked to
    (b, width, ...), or, when ``loss_fn`` works token by token (``per_token``: forward-only
    log-probs, values; dict micro-batches), packed as it is, with the micro-batch's per-token
    tensors packed alike (the caller unpacks the results). Returns what ``loss_fn``'s third
    element was for each micro-batch (on the last stage; megatron returns [] elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    dims = model.dims
    seen = [0]
    sp = dims.tp if model.config.sequence_parallel else 1  # widths run padded to a multiple of this

    def forward_step(data_iterator: Iterator[tuple[Any, Packing | None]], module: torch.nn.Module):  # type: ignore[no-untyped-def]
        mb, packing = next(data_iterator)
        if seen[0] > 0 and model.probe is not None and not forward_only:
            model.probe.microbatch_boundary(module)  # the previous micro-batch's backward is done
        seen[0] += 1
        tokens = tokens_of(mb)
        if model.expert_load is not None and module.training:  # only real tokens count (its docstring)
            width = tokens.shape[1] if packing is None else packing.tokens  # before SP padding
            model.expert_load.expect(_row_lengths(mb), packing is not None, width)
        if model.routes is not None:  # MoE routing replay: this micro-batch's routes, or live / recording
            model.routes.before(routes_of(mb), packing)
        out = forward_padded(module, tokens, packing, sp)
        if model.routes is not None:
            model.routes.after(tokens, packing)
        if packing is None or not dims.is_last_stage:
            return out, partial(loss_fn, mb)
        if per_token:  # no loss-head work on padding
            return out, partial(loss_fn, {k: packing.pack(v) for k, v in mb.items()})
        return packing.unpack(out), partial(loss_fn, mb)

    seq_len = padded_length(tokens_of(mbs[0]).shape[1], sp)  # (the p2p shapes when every micro-batch has it)
    packs = packings or [None] * len(mbs)
    # this model's groups, never megatron's globals (which describe the actor's layout)
    groups: dict[str, Any] = {"pg_collection": dims.pgs}
    if dims.pp > 1:
        config = model.config
        if len({tuple(tokens_of(mb).shape) for mb in mbs}) > 1 or any(p is not None for p in packs):
            # token-budget micro-batches differ in shape: megatron's p2p then sends each
            # tensor's shape before the tensor (``variable_seq_lengths``); only this call's
            # communicator sees the flag, the model's config stays as built
            config = copy.copy(config)
            config.variable_seq_lengths = True
        groups["p2p_communicator"] = P2PCommunicator(pp_group=dims.pp_group, config=config)
    fb = get_forward_backward_func(pp_size=dims.pp, vp_size=None)
    t0 = time.perf_counter()
    out = fb(
        forward_step_func=forward_step,
        data_iterator=iter(zip(mbs, packs, strict=True)),
        model=[model.module],
        num_microbatches=len(mbs),
        seq_length=seq_len,
        micro_batch_size=tokens_of(mbs[0]).shape[0],
        forward_only=forward_only,
        **groups,
    )
    # m micro-batches through p stages take m + p - 1 slots; p - 1 of them are fill and drain
    model.microbatch_s += (time.perf_counter() - t0) * len(mbs) / (len(mbs) + dims.pp - 1)
    return out  # type: ignore[no-any-return]


def _row_lengths(mb: Any) -> torch.Tensor | None:
    """Each row's real length (``row_lengths`` of its loss mask), or None for a micro-batch
    without one (every position is then real)."""
    mask = mb.get("mask") if isinstance(mb, dict) else getattr(mb, "mask", None)
    return None if mask is None else row_lengths(mask)


def labels_of(tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


def forward_logprobs(
    model: Model,
    tokens: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool = False,
    lengths: torch.Tensor | None = None,
    max_tokens: int = 0,
    pack: bool = False,
    routes: bool = False,
    replay: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token log-probs (B, S) (and entropy) of ``tokens`` under ``model``; no grad.
    ``routes``: also the MoE routes this rank's stage took, ``routes`` (B, S, L, k)
    (``megarl.model.routes``; a model with ``Model.routes``). ``replay`` (B, S, L, k): routes
    this rank's stage replays instead (the engines'), cut with the tokens into micro-batches.

    Computed on the last PP stage and broadcast over the pipeline group, so every rank
    returns the same tensors. With ``max_tokens`` and the rows' ``lengths``
    (``megarl.model.microbatch.row_lengths``) the pass runs in token-budget micro-batches and
    positions at or beyond a row's length are 0; ``pack`` runs each of them packed.
    """
    dims = model.dims

    def fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = model_logits(model, logits)
        labels = mb["labels"] if "labels" in mb else labels_of(mb["tokens"])  # a cut row keeps its next token
        out = {"logprobs": vocab_parallel_logprobs(logits, labels, temperature)}
        if with_entropy:
            out["entropy"] = vocab_parallel_entropy(logits, temperature, dims.tp_group)
        return out

    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    if max_tokens and lengths is not None:
        return _forward_collect_budget(model, tokens, lengths, max_tokens, fn, keys, pack, routes, replay)
    return _forward_collect(model, tokens, micro_batch_size, fn, keys, routes=routes, replay=replay)


def forward_values(
    model: Model,
    tokens: torch.Tensor,
    *,
    micro_batch_size: int,
    lengths: torch.Tensor | None = None,
    max_tokens: int = 0,
    pack: bool = False,
) -> torch.Tensor:
    """Critic values (B, S): ``values[:, t] = V(tokens[:, :t+1])``, the state before token t+1.

    Each DP rank of the model's layout computes its B / DP rows; every rank returns all B.
    ``lengths`` / ``max_tokens`` / ``pack``: token-budget micro-batches, as in :func:`forward_logprobs`."""

    def fn(mb: dict[str, torch.Tensor], out: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": out[..., 0].float()}

    if max_tokens and lengths is not None:
        return _forward_collect_budget(model, tokens, lengths, max_tokens, fn, ["values"], pack)["values"]
    return _forward_collect(model, tokens, micro_batch_size, fn, ["values"], split_dp=True)["values"]


def _forward_collect(
    model: Model,
    tokens: torch.Tensor,
    micro_batch_size: int,
    fn: Callable[[dict[str, torch.Tensor], torch.Tensor], dict[str, torch.Tensor]],
    keys: list[str],
    split_dp: bool = False,
    routes: bool = False,
    replay: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Forward-only pass; ``fn`` maps the last stage's output to (B, S) tensors, which are
    broadcast over the pipeline group so every rank returns them.

    With DP > 1 each data-parallel rank runs only its B / DP rows (in order) and the rows are
    all-gathered over the DP group: always with ``split_dp``, otherwise when B divides into
    DP × micro-batches (the one-sequence integrity check runs on every rank)."""
    dims = model.dims
    rows = tokens
    if dims.dp > 1 and (split_dp or tokens.shape[0] % (dims.dp * micro_batch_size) == 0):
        if tokens.shape[0] % dims.dp:
            raise ValueError(f"batch of {tokens.shape[0]} rows is not divisible by DP={dims.dp}")
        rows = tokens.chunk(dims.dp, dim=0)[dims.dp_rank]

    def loss_fn(mb: dict[str, torch.Tensor], out: torch.Tensor) -> tuple[Any, ...]:
        return torch.zeros((), device=out.device), torch.tensor(1), fn(mb, out)

    local = {"tokens": rows}
    if replay is not None:  # the same rows as the tokens
        local["routes"] = replay if rows is tokens else replay.chunk(dims.dp, dim=0)[dims.dp_rank]
    mbs = micro_batches(local, micro_batch_size)
    model.module.eval()
    with torch.no_grad(), recording(model, routes) as taken:
        store = run_schedule(model, mbs, loss_fn, forward_only=True)
    result: dict[str, torch.Tensor] = {}
    if taken is not None:
        n, at = rows.shape[0], range(0, rows.shape[0], micro_batch_size)
        parts = None if rows is tokens else list(torch.arange(tokens.shape[0]).chunk(dims.dp))
        placed = [(torch.arange(i, i + micro_batch_size), tokens.shape[1]) for i in at]
        result["routes"] = collect(taken, placed, n, (tokens.shape[0], tokens.shape[1]), parts, dims)
    for k in keys:
        if dims.is_last_stage:
            t = torch.cat([d[k] for d in store], dim=0).float().contiguous()
        else:
            t = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        if dims.pp > 1:
            src = dist.get_process_group_ranks(dims.pp_group)[-1]
            dist.broadcast(t, src=src, group=dims.pp_group)
        if rows is not tokens:
            parts = [torch.empty_like(t) for _ in range(dims.dp)]
            dist.all_gather(parts, t, group=dims.dp_group)
            t = torch.cat(parts, dim=0)
        result[k] = t
    return result


def _forward_collect_budget(
    model: Model,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    max_tokens: int,
    fn: Callable[[dict[str, torch.Tensor], torch.Tensor], dict[str, torch.Tensor]],
    keys: list[str],
    pack: bool = False,
    routes: bool = False,
    replay: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`_forward_collect` in token-budget micro-batches: DP ranks take token-balanced
    rows (when there are at least DP rows), run them grouped by length and cut to each
    group's width (or packed: ``fn`` then sees only real tokens); the outputs go back to their
    rows and full width (0 beyond a row's length, so the result does not depend on the
    grouping), are broadcast over the pipeline and all-gathered over DP."""
    dims = model.dims
    B, S = tokens.shape
    split = dims.dp > 1 and B >= dims.dp
    parts = balance_rows(lengths, dims.dp) if split else [torch.arange(B)]
    mine = parts[dims.dp_rank] if split else parts[0]
    local = {"tokens": tokens[mine], "labels": labels_of(tokens[mine])}
    if replay is not None:  # cut with the tokens (rows, then each micro-batch's width)
        local["routes"] = replay[mine]
    plan = token_budget_split(lengths[mine], max_tokens, packed=pack)
    packs = packings_of(plan)

    def loss_fn(mb: dict[str, torch.Tensor], out: torch.Tensor) -> tuple[Any, ...]:
        return torch.zeros((), device=out.device), torch.tensor(1), fn(mb, out)

    model.module.eval()
    with torch.no_grad(), recording(model, routes) as taken:
        store = run_schedule(model, [take(local, mb) for mb in plan], loss_fn, True, packs, per_token=True)
    most = max(int(p.numel()) for p in parts)  # all_gather needs equal shapes: pad each rank's rows
    result: dict[str, torch.Tensor] = {}
    if taken is not None:
        placed = [(mb.rows, mb.width) for mb in plan]
        result["routes"] = collect(taken, placed, int(mine.numel()), (B, S), parts if split else None, dims)
    for k in keys:
        t = torch.zeros((most, S), dtype=torch.float32, device=tokens.device)
        if dims.is_last_stage:
            for mb, pk, d in zip(plan, packs, store, strict=True):
                t[mb.rows, : mb.width] = (d[k] if pk is None else pk.unpack(d[k])).float()
        if dims.pp > 1:
            src = dist.get_process_group_ranks(dims.pp_group)[-1]
            dist.broadcast(t, src=src, group=dims.pp_group)
        full = torch.zeros((B, S), dtype=torch.float32, device=tokens.device)
        if split:
            gathered = [torch.empty_like(t) for _ in range(dims.dp)]
            dist.all_gather(gathered, t, group=dims.dp_group)
            for rows, g in zip(parts, gathered, strict=True):
                full[rows] = g[: rows.numel()]
        else:
            full[mine] = t[: mine.numel()]
        result[k] = full * (torch.arange(S, device=full.device) < lengths.to(full.device)[:, None])
    return result


def vocab_parallel_argmax(logits: torch.Tensor, tp_rank: int, tp_group: Any) -> torch.Tensor:
    """Global argmax over the TP-sharded vocabulary (ties → lowest id). (b, s, v/tp) -> (b, s)."""
    v_local = logits.shape[-1]
    val, idx = logits.float().max(dim=-1)
    gidx = idx + tp_rank * v_local
    best = val.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=tp_group)
    cand = torch.where(val == best, gidx, torch.full_like(gidx, torch.iinfo(torch.long).max))
    dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=tp_group)
    return cand


@torch.no_grad()
def greedy_generate(
    model: Model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int = 0
) -> list[list[int]]:
    """Greedy decoding with full re-forward per token (reference path for parity tests)."""
    dims = model.dims
    outs: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        S = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), S), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)

        def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[Any, ...]:
            am = vocab_parallel_argmax(model_logits(model, logits), dims.tp_rank, dims.tp_group)
            return torch.zeros(()), torch.tensor(1), {"argmax": am}

        model.module.eval()
        store = run_schedule(model, [{"tokens": tokens}], loss_fn, forward_only=True)
        am = store[0]["argmax"] if dims.is_last_stage else torch.empty(tokens.shape, dtype=torch.long)
        if dims.pp > 1:
            dist.broadcast(am, src=dist.get_process_group_ranks(dims.pp_group)[-1], group=dims.pp_group)
        for i, s in enumerate(seqs):
            if done[i]:
                continue
            nxt = int(am[i, len(s) - 1])
            outs[i].append(nxt)
            s.append(nxt)
            done[i] = nxt == eos_id
        if all(done):
            break
    return outs
