"""MoE on this machine (#44): trainer tokens/s at EP=1 vs EP=2, and the weight sync of a MoE
model vs a dense model of the same total size.

* ``train``: two gloo ranks (``torchrun``), a Qwen3-MoE of ``--layers`` × hidden 256 with 8
  experts of width 256 (top-2), one optimizer step of a GRPO-style loss over ``--rows`` × 128
  tokens per rank, at EP=1 (each rank all 8 experts, DP=2) and EP=2 (each rank 4, tokens
  exchanged all-to-all). Blocks of one warm-up and 3 timed steps, the layouts alternating,
  ``--repeats`` blocks each; the model is rebuilt per block (outside the timing). Tokens/s =
  both ranks' tokens / the step's wall time (rank 0's; every step ends in collectives).
* ``sync``: one process, one real vLLM CPU engine per model, both started before timing: the
  MoE model (its experts written in the engine's fused-MoE layout and checked by the coverage
  check, ``megarl.engine.experts``) and a dense Qwen3 whose MLP has the same parameters
  (ffn = 8 × 256), pushed alternately (``WeightSync.push``, shm), one warm-up each then
  ``--repeats`` pairs. Reported: seconds per sync and the MoE / dense ratio per pair.

Prints a table per part and one JSON line: EP=2 / EP=1 tokens/s per block pair and MoE / dense
sync time per pair, with means and spread (a ratio > 1 means EP=2 is faster / the MoE sync slower).
On two CPU cores EP buys no compute (both ranks run anyway); it shows the all-to-all's cost.

    python -m benchmarks.moe [--parts train,sync] [--repeats 5] [--layers 4] [--rows 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, mean_bound, table  # noqa: E402

EXPERTS, WIDTH, HIDDEN, SEQ = 8, 256, 256, 128


def model_config(layers: int, moe: bool) -> Any:
    from megarl.config import ModelConfig

    common = dict(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, vocab_size=8192,
                  max_position_embeddings=256)  # fmt: skip
    if moe:
        return ModelConfig(arch="qwen3_moe", num_experts=EXPERTS, moe_ffn_hidden_size=WIDTH, ffn_hidden_size=WIDTH,
                           moe_router_topk=2, **common)  # fmt: skip
    return ModelConfig(arch="qwen3", ffn_hidden_size=EXPERTS * WIDTH, **common)


def train_worker(args: argparse.Namespace) -> None:
    """(Under torchrun, 2 ranks.) Times optimizer steps at EP=1 and EP=2, alternating blocks."""
    import torch

    from megarl import algo
    from megarl.config import OptimConfig, ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt
    from megarl.model.forward import labels_of, vocab_parallel_logprobs
    from megarl.model.train import train_step

    mcfg = model_config(args.layers, moe=True)
    g = torch.Generator().manual_seed(0)
    rows = args.rows
    tokens = torch.randint(3, mcfg.vocab_size, (rows, SEQ), generator=g)
    mask = torch.zeros(rows, SEQ)
    mask[:, 16:] = 1.0
    adv = torch.randn(rows, generator=g)
    old = torch.full((rows, SEQ), -9.0)
    denom = algo.global_denominator("token-mean", mask) * 2  # both ranks' tokens

    def loss(mb: Any, logits: torch.Tensor) -> Any:
        cur = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        per_tok, _ = algo.policy_loss(cur, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
        value = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
        return value, {"loss": value.detach()}

    times: dict[int, list[float]] = {1: [], 2: []}
    for block in range(2 * args.repeats):
        ep = 1 if block % 2 == 0 else 2
        dims = init_distributed(1, 1, seed=0, ep=ep)
        pcfg = ParallelConfig(data_parallel=2, expert_parallel=ep, micro_batch_size=rows)
        model = build_gpt(mcfg, pcfg, dims, optim=OptimConfig(lr=1e-5))
        batch = {"tokens": tokens, "mask": mask, "adv": adv, "old": old}
        block_times = []
        for i in range(4):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            train_step(model, batch, loss, micro_batch_size=rows)
            if i:  # the first is a warm-up
                block_times.append(time.perf_counter() - t0)
        times[ep].append(sorted(block_times)[1])  # the block's median of 3
        del model
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"times": times, "tokens": 2 * rows * SEQ}))


def run_train_part(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / "train.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", "--out", str(out), "--layers", str(args.layers), "--rows", str(args.rows),
           "--repeats", str(args.repeats)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-5000:])
    res = json.loads(out.read_text())
    t1, t2 = res["times"]["1"], res["times"]["2"]
    rows = [{"block": i + 1, "ep1_s": a, "ep2_s": b, "ep1_tok_s": res["tokens"] / a, "ep2_tok_s": res["tokens"] / b,
             "ep2/ep1": a / b} for i, (a, b) in enumerate(zip(t1, t2, strict=True))]  # fmt: skip
    print(table(rows, ["block", "ep1_s", "ep2_s", "ep1_tok_s", "ep2_tok_s", "ep2/ep1"]))
    mean, sd, _ = mean_bound([r["ep2/ep1"] for r in rows])
    return {"tokens_per_step": res["tokens"], "ep2_over_ep1_tokens_per_s": [round(r["ep2/ep1"], 3) for r in rows],
            "mean": round(mean, 3), "sd": _round(sd)}  # fmt: skip


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 3)


def run_sync_part(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter
    from megarl.checkpoint.hf_io import gather_hf_tensors
    from megarl.config import ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.engine.staging import MANIFEST
    from megarl.fleet.fleet import Fleet
    from megarl.model.builder import build_gpt
    from megarl.weight_sync.sync import WeightSync

    dims = init_distributed(1, 1, seed=0)
    side: dict[str, Any] = {}
    try:
        for name, moe in (("moe", True), ("dense", False)):
            mcfg = model_config(args.layers, moe)
            model = build_gpt(mcfg, ParallelConfig(), dims, trainable=False)
            adapter = LlamaQwen2Adapter(mcfg)
            hf_dir = tmp / name
            hf_dir.mkdir()
            adapter.hf_config(2, 1, 0).save_pretrained(str(hf_dir))
            named = gather_hf_tensors(model, adapter)
            (hf_dir / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in named}))
            fleet = Fleet.start_local(hf_dir, 1, 1, 0.25, tmp / f"logs_{name}", seed=0, start_timeout_s=600)
            side[name] = {"model": model, "fleet": fleet, "sync": WeightSync(model, adapter, fleet, 256.0, transport="shm"),
                          "params": sum(p.numel() for p in model.core.parameters())}  # fmt: skip
        times: dict[str, list[float]] = {"moe": [], "dense": []}
        for r in range(args.repeats + 1):  # the first pair warms up (first reload allocates)
            for name in ("moe", "dense"):
                t0 = time.perf_counter()
                side[name]["sync"].push(r + 1)
                if r:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for s in side.values():
            s["sync"].cleanup()
            s["fleet"].shutdown()
    rows = [{"pair": i + 1, "moe_s": a, "dense_s": b, "moe/dense": a / b}
            for i, (a, b) in enumerate(zip(times["moe"], times["dense"], strict=True))]  # fmt: skip
    print(f"params: moe {side['moe']['params'] / 1e6:.2f} M, dense {side['dense']['params'] / 1e6:.2f} M")
    print(table(rows, ["pair", "moe_s", "dense_s", "moe/dense"]))
    mean, sd, _ = mean_bound([r["moe/dense"] for r in rows])
    return {"params_M": {k: round(v["params"] / 1e6, 3) for k, v in side.items()},
            "moe_over_dense_sync_s": [round(r["moe/dense"], 3) for r in rows], "mean": round(mean, 3),
            "sd": _round(sd)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="train,sync")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="rows of 128 tokens per rank per step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        train_worker(args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"layers": args.layers, "repeats": args.repeats}
    tmp = Path(tempfile.mkdtemp(prefix="megarl_moebench_"))
    try:
        if "train" in args.parts:
            result["train"] = run_train_part(args, tmp)
        if "sync" in args.parts:
            result["sync"] = run_sync_part(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"moe": result}))


if __name__ == "__main__":
    main()
