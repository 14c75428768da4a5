"""Routing replay (``algo.router_replay: trainer``, ``megarl.model.routes``) on the MoE worker's
model and batch, called by ``worker_moe.py`` at each TP 1 layout (EP 1 and EP 2, DP 2):

1. the routes of the old forward are recorded (fixed micro-batches, all-gathered over DP) and,
   again, in token-budget micro-batches, padded and packed (EP 1);
2. every router is perturbed; then, weights held (lr 0), one update forward runs with live
   routing and the same with the recorded routes replayed, in one micro-batch per rank (the
   routers' choices hooked), in fixed micro-batches, in token-budget micro-batches and packed (EP 1):
   the log-probs' drift from the old forward, their sum, the routers' gradients, and the
   routes' mismatch metric against the live routes of a recorded forward after the perturbation.

The routers are first set to HF's init scale (weights of std 0.02, as in a fresh MoE; the shared
test model scales them up to keep its routing margins far above fp32 noise). What replay removes
is the drift of tokens whose experts change; a router perturbation also changes the weights of
the experts a token keeps, which replay keeps too (that is how the routers learn). With small
router logits the first dominates (a swapped expert carries about half of the token's MoE
output); with confident routers (the shared model's, std ~1) the second does: there the same
perturbation moved log-probs by 6.4e-3 live and 5.9e-3 replayed (a session-30 experiment).

``algo.router_replay: rollout`` (:func:`engine_replay_checks`): the routes recorded before the
perturbation play the engine's, laid out as vLLM returns them (every layer: gathered over the
pipeline stages) and carried by a ``RolloutBatch``; phase 2 (``megarl.update.evaluate``) then
replays them in the old-log-prob forward in fixed micro-batches, token budgets and packed, and
counts its live choices against them (``moe/engine_route_mismatch``).

Everything is returned under ``{layout}/r3/``; ``tests/model/test_moe.py`` asserts it."""

import torch
import torch.distributed as dist

from megarl.config import AlgoConfig, ParallelConfig, RolloutConfig
from megarl.model.builder import Model
from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs
from megarl.model.microbatch import row_lengths, token_budget_split
from megarl.model.train import train_step
from megarl.types import RolloutBatch
from megarl.update.evaluate import evaluate

BUDGET = 40  # tokens per budget micro-batch: 8-15-token rows, 2-4 to a micro-batch
LAYERS = 4  # the model's (every one a MoE layer); a pipeline stage holds some of them


def _routers(model: Model) -> list[torch.nn.Module]:
    return [layer.mlp.router for layer in model.core.decoder.layers]


def replay_checks(model: Model, tokens: torch.Tensor, mask: torch.Tensor, mbs: int) -> dict[str, torch.Tensor]:
    """Token budgets (and packing) at EP 1 only: megarl refuses them with EP > 1 (DP ranks could
    run different numbers of micro-batches, and the experts' all-to-all would wait forever)."""
    dims, out = model.dims, {}
    B, S = tokens.shape
    with torch.no_grad():  # routers at HF's init scale (std 0.02): near-uniform routing (module docstring)
        for r in _routers(model):
            r.weight.mul_(0.02 / r.weight.std())
    lengths = row_lengths(mask)
    fwd = forward_logprobs(model, tokens, micro_batch_size=mbs, temperature=1.0, routes=True)
    old, routes = fwd["logprobs"], fwd["routes"]
    out["routes"] = routes
    budgets = [("budget", False), ("packed", True)] if dims.ep == 1 else []
    for name, pack in budgets:
        got = forward_logprobs(
            model,
            tokens,
            micro_batch_size=mbs,
            temperature=1.0,
            lengths=lengths,
            max_tokens=BUDGET,
            pack=pack,
            routes=True,
        )["routes"]
        out[f"routes_{name}"] = got
    beyond = torch.arange(S) >= lengths[:, None]
    routes = routes.masked_fill(beyond[:, :, None, None], -1)  # as megarl.update.evaluate keeps them

    g = torch.Generator().manual_seed(5)  # one noise per global layer, whichever stage holds it
    noise = [torch.randn(_routers(model)[0].weight.shape, generator=g) for _ in range(LAYERS)]
    with torch.no_grad():
        for r in _routers(model):
            r.weight.add_(noise[r.layer_number - 1] * 0.2 * r.weight.std())
    live_after = forward_logprobs(model, tokens, micro_batch_size=mbs, temperature=1.0, routes=True)["routes"]
    out["routes_live_after"] = live_after
    model.routes.mismatch(dims)  # counts start at 0
    out |= engine_replay_checks(model, tokens, mask, mbs, routes, [name for name, _ in budgets])

    denom = float(mask.sum())
    rows = slice(dims.dp_rank * B // dims.dp, (dims.dp_rank + 1) * B // dims.dp)
    n = rows.stop - rows.start

    def loss_fn(mb, logits):
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        m = mb["mask"]
        stats = {"lp": (lp.detach() * m).sum(), "drift": ((lp.detach() - mb["old"]).abs() * m).sum(), "n": m.sum()}
        return (lp * m).sum() / denom, stats

    def update(name: str, replay: bool, micro: int, groups=None) -> None:
        batch = {"tokens": tokens[rows], "mask": mask[rows], "old": old[rows]}
        if replay:
            batch["routes"] = routes[rows]
        stats, _ = train_step(model, batch, loss_fn, micro_batch_size=micro, lr=0.0, groups=groups)
        key = f"{name}/"
        out[key + "drift"] = torch.tensor([stats["drift"] / stats["n"]], dtype=torch.float64)
        out[key + "lp"] = torch.tensor([stats["lp"]], dtype=torch.float64)
        out[key + "router_grad"] = torch.stack([r.weight.main_grad.detach().clone() for r in _routers(model)])
        metrics = model.routes.mismatch(dims)
        out[key + "mismatch"] = torch.tensor([metrics.get(f"moe/route_mismatch/layer{i}", -1.0) for i in range(LAYERS)])

    update("live", False, n)
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, inp, o: seen.append(o[1].detach().clone())) for r in _routers(model)]
    update("replay_one", True, n)  # one micro-batch per rank: the router sees [s, b] flattened
    for h in hooks:
        h.remove()
    out["replayed_map"] = torch.stack([m.reshape(S, n, -1).transpose(0, 1) for m in seen], dim=2)  # (n, S, L, E)
    update("replay_fixed", True, mbs)
    for name, pack in budgets:
        update(f"replay_{name}", True, mbs, token_budget_split(lengths[rows], BUDGET, packed=pack))
    return out


def engine_replay_checks(
    model: Model, tokens: torch.Tensor, mask: torch.Tensor, mbs: int, routes: torch.Tensor, budgets: list[str]
) -> dict[str, torch.Tensor]:
    """Phase 2 of ``algo.router_replay: rollout`` with ``routes`` (this stage's, recorded before
    the perturbation) as the engine's: every layer's, int16, in a RolloutBatch."""
    dims, out = model.dims, {}
    engine = routes.to(torch.int32)
    if dims.pp > 1:  # the engine returns every layer: the stages' routes side by side, in stage order
        parts = [torch.empty_like(engine) for _ in range(dims.pp)]
        dist.all_gather(parts, engine, group=dims.pp_group)
        engine = torch.cat(parts, dim=2)
    out["engine_routes"] = engine.to(torch.int16)
    B = tokens.shape[0]
    batch = RolloutBatch(
        tokens=tokens,
        mask=mask,
        engine_logprobs=None,
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        response_lens=mask.sum(1).long(),
        truncated=torch.zeros(B, dtype=torch.bool),
        version=0,
        routes=engine.to(torch.int16),
    )
    algo = AlgoConfig(router_replay="rollout", kl_coef=0.0)
    for name in ["fixed", *budgets]:
        p = ParallelConfig(micro_batch_size=mbs, max_tokens_per_micro_batch=0 if name == "fixed" else BUDGET)
        p.pack_sequences = name == "packed"
        ev = evaluate(algo, RolloutConfig(), p, batch, model, None, None)
        assert ev.old_logprobs is not None and ev.routes is not None
        out[f"engine_{name}/old"] = ev.old_logprobs
        out[f"engine_{name}/lp"] = (ev.old_logprobs * mask).sum().double()[None]  # (the update's: DP-reduced)
        out[f"engine_{name}/routes"] = ev.routes
        metric = [ev.route_mismatch.get(f"moe/engine_route_mismatch/layer{i}", -1.0) for i in range(LAYERS)]
        out[f"engine_{name}/mismatch"] = torch.tensor(metric)
    return out
