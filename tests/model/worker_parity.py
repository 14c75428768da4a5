"""torchrun worker: load an HF model into a TP/PP/DP layout, compute log-probs, take one
optimizer step with a fixed GRPO loss, and save log-probs + updated HF weights (rank 0).

``--max-tokens N``: token-budget micro-batches (rows balanced over DP by tokens, grouped by
length, cut to each group's longest row) for every pass, against the same fixed-row run; ``--pack`` runs those
micro-batches padding-free (``parallel.pack_sequences``); ``--sp`` turns on sequence parallelism. Rank 0 also saves its gradient
shards per aggregation mode."""

import argparse
import dataclasses
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from megarl import algo  # noqa: E402
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import hf_state_dict, load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megarl.distributed import init_distributed  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import (  # noqa: E402
    forward_logprobs,
    forward_values,
    labels_of,
    vocab_parallel_logprobs,
)
from megarl.model.grad_stats import GradProbe, rescale  # noqa: E402
from megarl.model.microbatch import balance_rows, row_lengths, token_budget_split  # noqa: E402
from megarl.model.train import train_step  # noqa: E402
from megarl.update.evaluate import answer_probability  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--pp", type=int, default=1)
ap.add_argument("--mbs", type=int, default=4)
ap.add_argument("--agg", default="token-mean")
ap.add_argument("--dist-opt", action="store_true")
ap.add_argument("--critic-steps", type=int, default=0)
ap.add_argument("--attention", default="sdpa")
ap.add_argument("--max-tokens", type=int, default=0)
ap.add_argument("--pack", action="store_true")
ap.add_argument("--sp", action="store_true", help="sequence parallelism (parallel.sequence_parallel)")
args = ap.parse_args()

dims = init_distributed(args.tp, args.pp, seed=7)
hf_cfg, hf = read_hf_folder(args.hf)
mcfg = model_config_from_hf(hf_cfg, ModelConfig(attention=args.attention))
pcfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, micro_batch_size=args.mbs,
                      use_distributed_optimizer=args.dist_opt, sequence_parallel=args.sp)
# adam_eps well above fp32 gradient noise: with eps=1e-8 the first Adam step is ~lr·sign(g),
# which turns 1e-9 reduction-order differences in tiny gradients into lr-sized ones.
OPTIM = OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-4)
model = build_gpt(mcfg, pcfg, dims, optim=OPTIM)
adapter = LlamaQwen2Adapter(mcfg)
load_hf_tensors(model, adapter, hf)

g = torch.Generator().manual_seed(123)
B, S = 16, 20
tokens = torch.randint(3, mcfg.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses after a 6-token prompt
    mask[b, 5 : 5 + 4 + (b % 9)] = 1.0
rewards = torch.rand(B, generator=g)
group_ids = torch.arange(B) // 4
adv = algo.grpo_advantages(rewards, group_ids)

lengths = row_lengths(mask)
budget = {"lengths": lengths, "max_tokens": args.max_tokens, "pack": args.pack}
lp = forward_logprobs(model, tokens, micro_batch_size=args.mbs, temperature=1.0, with_entropy=True, **budget)
per = B // dims.dp
rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
groups = None
if args.max_tokens:  # rows balanced over DP by tokens, micro-batches by the budget
    rows = balance_rows(lengths, dims.dp)[dims.dp_rank]
    groups = token_budget_split(lengths[rows], args.max_tokens, packed=args.pack)
    sizes = torch.tensor([[g.rows.numel(), g.width] for g in groups])
    print(f"dp_rank={dims.dp_rank} rows={rows.tolist()} micro-batches (rows, width)={sizes.tolist()} pack={args.pack}")
    assert len({(int(n), int(w)) for n, w in sizes}) > 1, "the test needs unequal micro-batches"
old = lp["logprobs"].clone()
result = {"logprobs": lp["logprobs"], "entropy": lp["entropy"], "tokens": tokens, "lengths": lengths}
# train.val_metric=answer_prob: 13 rows (not a multiple of DP × micro-batch: padded inside), the
# answer = each row's 1-3 ids after its 6-token prompt (short: probabilities ~1/vocab, not ~0)
amask = torch.zeros(13, S)
for b in range(13):
    amask[b, 5 : 6 + b % 3] = 1.0
apcfg = dataclasses.replace(pcfg, max_tokens_per_micro_batch=args.max_tokens, pack_sequences=args.pack)
result["answer_prob"] = torch.tensor([answer_probability(model, tokens[:13], amask, apcfg)], dtype=torch.float64)
weights = {}


def policy_loss_fn(mode, denom):
    def loss_fn(mb, logits):
        cur = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 0.7)
        per_tok, _ = algo.policy_loss(cur, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
        loss = algo.aggregate(per_tok, mb["mask"], mode=mode, global_denominator=denom)
        return loss, {"loss": loss.detach()}

    return loss_fn


# One optimizer step per aggregation mode, each on a fresh copy of the same HF weights.
for mode in algo.LOSS_AGG_MODES:
    m = model if mode == args.agg else build_gpt(mcfg, pcfg, dims, optim=OPTIM)
    if m is not model:
        load_hf_tensors(m, adapter, hf)
    denom = algo.global_denominator(mode, mask, fixed_normalizer=16.0)
    batch = {"tokens": tokens[rows], "mask": mask[rows], "adv": adv[rows], "old": old[rows]}
    stats, gnorm = train_step(m, batch, policy_loss_fn(mode, denom), micro_batch_size=args.mbs, groups=groups)
    result[f"{mode}/loss"] = torch.tensor([stats["loss"]])
    result[f"{mode}/grad_norm"] = torch.tensor([gnorm])
    # this rank's gradient shards after the DP reduction (the optimizer step leaves them in place)
    result.update({f"grad:{mode}/{k}": p.main_grad.detach().clone() for k, p in m.core.named_parameters()})
    sd = hf_state_dict(m, adapter)
    weights.update({f"{mode}/{k}": v for k, v in sd.items()})

# Gradient-noise probe: DP ranks' local mean-gradient norms and per-micro-batch norms,
# against brute force (fresh models stepped on each part alone, own denominator).
PROBE_OPTIM = OptimConfig(lr=1e-3, clip_grad=1e9, adam_eps=1e-4)
units = mask.sum(1)
pm = build_gpt(mcfg, pcfg, dims, optim=PROBE_OPTIM)
load_hf_tensors(pm, adapter, hf)
pm.probe = GradProbe(dims, microbatch=dims.pp == 1 and not args.max_tokens)  # as the planner
pm.probe.start()
denom = algo.global_denominator("token-mean", mask)
# a measured update keeps contiguous DP rows (megarl.update.rows.update_rows); with a budget at
# DP > 1 its micro-batches follow the budget (at DP = 1 the probe refuses the budget)
prow = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
pgroups = token_budget_split(lengths[prow], args.max_tokens, packed=args.pack) if args.max_tokens and dims.dp > 1 else None
_, gn = train_step(
    pm,
    {"tokens": tokens[prow], "mask": mask[prow], "adv": adv[prow], "old": old[prow]},
    policy_loss_fn("token-mean", denom),
    micro_batch_size=args.mbs,
    groups=pgroups,
)
total = float(units.sum())
per_rank = [float(units[r * per : (r + 1) * per].sum()) for r in range(dims.dp)]
result["probe/global_sq"] = torch.tensor([gn**2])
result["probe/rank_sq"] = torch.tensor([rescale(x, n, total) for x, n in zip(pm.probe.gather_local(), per_rank)])
if pm.probe.microbatch:  # every micro-batch of every DP rank, rank-major (the planner's parts)
    mb_units = [float(u.sum()) for u in units.split(args.mbs)]
    mb = pm.probe.gather_microbatches() if dims.dp > 1 else pm.probe.mb_sq
    result["probe/mb_sq"] = torch.tensor([rescale(x, n, total) for x, n in zip(mb, mb_units, strict=True)])
if dims.dp == 1 and dims.pp == 1:
    # brute force: each half (= a DP2 rank's rows) and each micro-batch alone
    for name, size in (("half", B // 2), ("part", args.mbs)):
        norms = []
        for i in range(0, B, size):
            sl = slice(i, i + size)
            fm = build_gpt(mcfg, pcfg, dims, optim=PROBE_OPTIM)
            load_hf_tensors(fm, adapter, hf)
            d = algo.global_denominator("token-mean", mask[sl])
            _, g2 = train_step(fm, {"tokens": tokens[sl], "mask": mask[sl], "adv": adv[sl], "old": old[sl]},
                               policy_loss_fn("token-mean", d), micro_batch_size=min(args.mbs, size))
            norms.append(g2**2)
        result[f"probe/brute_{name}_sq"] = torch.tensor(norms)

# The Adam-preconditioned probe (coordinator.noise_kind adam): pm has taken one Adam step, so
# P = 1/(sqrt(v_hat)+eps) exists; a second update on the same rows, every norm of P*g.
from megarl.model.adam_state import adam_preconditioner  # noqa: E402

if not args.dist_opt:  # (refused with the distributed optimizer: it holds one shard of v)
    inner = pm.optimizer.optimizer
    P = {}  # per parameter name, before the step (the factor the step applies)
    for n, p in pm.core.named_parameters():
        st, grp = inner.state[p], inner.param_groups[0]
        P[n] = 1.0 / ((st["exp_avg_sq"] / (1 - grp["betas"][1] ** float(st["step"]))).sqrt() + grp["eps"])
    w1 = {n: p.detach().clone() for n, p in pm.core.named_parameters()}
    pm.probe.start(adam_preconditioner(pm.optimizer, pm.module))
    train_step(
        pm,
        {"tokens": tokens[prow], "mask": mask[prow], "adv": adv[prow], "old": old[prow]},
        policy_loss_fn("token-mean", denom),
        micro_batch_size=args.mbs,
        groups=pgroups,
    )
    result["adam/global_sq"] = torch.tensor([pm.probe.global_sq])
    result["adam/rank_sq"] = torch.tensor([rescale(x, n, total) for x, n in zip(pm.probe.gather_local(), per_rank)])
    if pm.probe.microbatch:
        mb = pm.probe.gather_microbatches() if dims.dp > 1 else pm.probe.mb_sq
        result["adam/mb_sq"] = torch.tensor([rescale(x, n, total) for x, n in zip(mb, mb_units, strict=True)])
    if dims.dp == 1 and dims.pp == 1 and dims.tp == 1:
        # brute force: the whole batch, each half and each micro-batch alone at pm's weights, |P*g|^2
        for name, size in (("all", B), ("half", B // 2), ("part", args.mbs)):
            norms, plain = [], []
            for i in range(0, B, size):
                sl = slice(i, i + size)
                fm = build_gpt(mcfg, pcfg, dims, optim=PROBE_OPTIM)
                with torch.no_grad():
                    for n, p in fm.core.named_parameters():
                        p.copy_(w1[n])
                fm.optimizer.reload_model_params()
                d = algo.global_denominator("token-mean", mask[sl])
                train_step(fm, {"tokens": tokens[sl], "mask": mask[sl], "adv": adv[sl], "old": old[sl]},
                           policy_loss_fn("token-mean", d), micro_batch_size=min(args.mbs, size))
                norms.append(sum(float(((P[n] * p.main_grad).double() ** 2).sum()) for n, p in fm.core.named_parameters()))
                plain.append(sum(float((p.main_grad.double() ** 2).sum()) for _, p in fm.core.named_parameters()))
            result[f"adam/brute_{name}_sq"] = torch.tensor(norms)
            result[f"adam/brute_plain_{name}_sq"] = torch.tensor(plain)

# Critic: value head on the same trunk, one clipped value-loss step.
critic = build_gpt(dataclasses.replace(mcfg, tie_embeddings=False), pcfg, dims, value_head=True, optim=OPTIM)
with torch.no_grad():
    src = dict(model.core.named_parameters())
    for name, p in critic.core.named_parameters():
        if name.startswith("output_layer."):
            p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
        else:
            p.copy_(src[name])
critic.optimizer.reload_model_params()
v0 = forward_values(critic, tokens, micro_batch_size=args.mbs, **budget)
returns = torch.rand(B, S, generator=g)
denom = algo.global_denominator("token-mean", mask)


def value_loss_fn(mb, out):
    per_tok = algo.value_loss(out[..., 0], mb["old_values"], mb["returns"], mb["mask"], clip=0.2)
    loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
    return loss, {"loss": loss.detach()}


vbatch = {"tokens": tokens[rows], "mask": mask[rows], "old_values": v0[rows], "returns": returns[rows]}
vstats, vnorm = train_step(critic, vbatch, value_loss_fn, micro_batch_size=args.mbs, value_model=True, groups=groups)
v1 = forward_values(critic, tokens, micro_batch_size=args.mbs, **budget)
# Value loss on a fixed batch keeps falling over further steps (value targets held fixed).
fixed = {**vbatch, "old_values": v1[rows], "returns": rewards[:, None].expand(B, S)[rows]}


def fixed_loss_fn(mb, out):
    per_tok = algo.value_loss(out[..., 0], mb["old_values"], mb["returns"], mb["mask"], clip=None)
    loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
    return loss, {"loss": loss.detach()}


losses = []
for _ in range(args.critic_steps):
    st, _ = train_step(critic, fixed, fixed_loss_fn, micro_batch_size=args.mbs, value_model=True, groups=groups)
    losses.append(st["loss"])
result["critic/fixed_batch_losses"] = torch.tensor(losses or [0.0])
result.update({"critic/values0": v0, "critic/values1": v1, "critic/loss": torch.tensor([vstats["loss"]]),
               "critic/grad_norm": torch.tensor([vnorm])})

if dims.is_rank0:
    from safetensors.torch import save_file

    out = Path(args.out)
    save_file(result, str(out / "result.safetensors"))
    save_file(weights, str(out / "updated.safetensors"))

# leave together and tear the groups down explicitly (a rank exiting while its peer still holds
# live gloo groups can abort in their destructors: "terminate called without an active exception")
import torch.distributed as dist  # noqa: E402

from megarl.distributed import shutdown  # noqa: E402

dist.barrier()
shutdown()
