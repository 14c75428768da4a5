"""Trainer time with fixed-row micro-batches vs token-budget micro-batches (padded and packed), same batch.

A GRPO-like batch with realistic mixed lengths: ``--rows`` responses drawn uniformly from
5–256 tokens after prompts of 8–16 tokens, right-padded to the batch's longest row. One
"trainer pass" is what a step's trainer does with it: the forward-only old log-probs
(``forward_logprobs``) and one optimizer step (``train_step``, PPO-clip token-mean loss).
``fixed``: ``--mbs`` rows per micro-batch, every row padded to the batch's longest (today's
path, ``parallel.max_tokens_per_micro_batch: 0``). ``budget``: rows grouped by length into
micro-batches of at most ``--mbs × S`` tokens (the fixed path's own padded micro-batch, so
the activation memory bound is the same), each cut to its longest row. ``packed``: the same
budget, each micro-batch run padding-free as one packed row (``parallel.pack_sequences``:
per-sequence positions and causal attention; the split then minimises micro-batches). lr = 0
keeps the weights identical across repeats, so the losses (and log-probs) must agree to fp32
round-off. Variants are interleaved (order alternates every repeat); the median of
``--repeats`` is reported after one warm-up each. Prints a table and one JSON line of ratios
(fixed time / budget time, fixed / packed, budget / packed) plus the max abs loss and
log-prob differences from the fixed path.

    flock /tmp/megarl-heavy.lock torchrun --standalone --nproc-per-node=1 benchmarks/token_budget.py \
        [--rows 64] [--mbs 16] [--layers 4] [--hidden 256] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")
from benchmarks.common import table  # noqa: E402


def make_batch(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, S) right-padded with 0 and mask (B, S) (1 where tokens[t+1] is a response token)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(8, 17, (rows,), generator=g)
    resp = torch.randint(5, 257, (rows,), generator=g)
    S = int((prompts + resp).max())
    tokens = torch.zeros(rows, S, dtype=torch.long)
    mask = torch.zeros(rows, S)
    for i, (p, r) in enumerate(zip(prompts.tolist(), resp.tolist(), strict=True)):
        tokens[i, : p + r] = torch.randint(3, vocab, (p + r,), generator=g)
        mask[i, p - 1 : p + r - 1] = 1.0
    return tokens, mask


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=16, help="fixed path: rows per micro-batch")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from megarl import algo
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt
    from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs
    from megarl.model.microbatch import padded_tokens, row_lengths, token_budget_split
    from megarl.model.train import train_step

    dims = init_distributed(1, 1, seed=args.seed)
    h = args.hidden
    mcfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=h,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=2 * h,
        max_position_embeddings=512,
        vocab_size=args.vocab,
    )
    model = build_gpt(mcfg, ParallelConfig(micro_batch_size=args.mbs), dims, optim=OptimConfig(lr=0.0), seed=args.seed)
    n_params = sum(p.numel() for p in model.module.parameters())
    tokens, mask = make_batch(args.rows, args.vocab, args.seed)
    B, S = tokens.shape
    lengths = row_lengths(mask)
    budget = args.mbs * S
    plans = {
        "fixed": None,
        "budget": token_budget_split(lengths, budget),
        "packed": token_budget_split(lengths, budget, packed=True),
    }
    adv = algo.grpo_advantages(torch.rand(B, generator=torch.Generator().manual_seed(1)), torch.arange(B) // 8)
    denom = algo.global_denominator("token-mean", mask)
    old = forward_logprobs(model, tokens, micro_batch_size=args.mbs, temperature=1.0)["logprobs"]

    def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        per_tok, _ = algo.policy_loss(lp, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
        loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
        return loss, {"loss": loss.detach()}

    batch = {"tokens": tokens, "mask": mask, "adv": adv, "old": old}
    results: dict[str, dict[str, Any]] = {}

    def run(variant: str) -> tuple[float, float]:
        on, pack = variant != "fixed", variant == "packed"
        t0 = time.perf_counter()
        lp = forward_logprobs(
            model,
            tokens,
            micro_batch_size=args.mbs,
            temperature=1.0,
            lengths=lengths,
            max_tokens=budget if on else 0,
            pack=pack,
        )["logprobs"]
        t1 = time.perf_counter()
        stats, _ = train_step(model, batch, loss_fn, micro_batch_size=args.mbs, lr=0.0, groups=plans[variant])
        t2 = time.perf_counter()
        results[variant] = {"logprobs": lp, "loss": stats["loss"]}
        return t1 - t0, t2 - t1

    variants = ["fixed", "budget", "packed"]
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for v in variants:
        run(v)  # warm-up
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            times[v].append(run(v))

    real = int(lengths.sum())
    padded = {v: B * S if p is None else padded_tokens(p) for v, p in plans.items()}
    n_mbs = {v: B // args.mbs if p is None else len(p) for v, p in plans.items()}
    rows: list[dict[str, Any]] = []
    med: dict[str, dict[str, float]] = {}
    for v in variants:
        f = statistics.median(t[0] for t in times[v])
        tr = statistics.median(t[1] for t in times[v])
        tot = statistics.median(t[0] + t[1] for t in times[v])
        med[v] = {"forward": f, "train": tr, "trainer": tot}
        rows.append(
            {
                "variant": v,
                "micro_batches": n_mbs[v],
                "tokens_computed": padded[v],
                "forward_s": f,
                "train_step_s": tr,
                "trainer_s": tot,
                "loss": results[v]["loss"],
            }
        )
    m = mask.bool()
    loss_diff = {v: abs(results["fixed"]["loss"] - results[v]["loss"]) for v in ("budget", "packed")}
    lp_diff = {v: float((results["fixed"]["logprobs"] - results[v]["logprobs"])[m].abs().max()) for v in loss_diff}

    def ratio(a: str, b: str) -> dict[str, float]:
        return {k: round(med[a][k] / med[b][k], 3) for k in ("forward", "train", "trainer")}

    if dims.is_rank0:
        print(
            f"{n_params / 1e6:.2f}M params, {B} rows × S={S} (real tokens {real}, {real / (B * S):.0%} of the "
            f"padded batch), budget {budget} tokens = {args.mbs} rows × S, {args.threads} threads, "
            f"median of {args.repeats}"
        )
        print(table(rows, list(rows[0])))
        print(
            json.dumps(
                {
                    "benchmark": "token_budget",
                    "ratios": ratio("fixed", "budget"),
                    "ratios_packed": ratio("fixed", "packed"),
                    "ratios_budget_over_packed": ratio("budget", "packed"),
                    "max_abs_loss_diff": loss_diff["budget"],
                    "max_abs_logprob_diff": lp_diff["budget"],
                    "max_abs_loss_diff_packed": loss_diff["packed"],
                    "max_abs_logprob_diff_packed": lp_diff["packed"],
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
