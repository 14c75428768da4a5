"""How close each phase of an RL step runs to this machine's limit, measured in one run.

First the limits, with the thread count the trainer uses (--threads, default 2 = this
machine's cores): the best of fp32 ``torch.mm`` at (tokens × h) @ (h × k) shapes from the
model's own layers and a square 2048 one (FLOP/s), and a 256 MiB tensor copy (GB/s, counting
bytes read + written). Then `megarl train` runs --steps real steps (the engine times its
model forward, MEGARL_ENGINE_TIME_MODEL=1), and each phase's achieved rate is computed from
its metrics, steps after --skip, median:

    generate     2·N · (response tokens + prompt tokens)  /  engine model forward seconds
                 (and / the whole generate phase: what the step sees)
    logprobs     2·N · sequence tokens · forward passes   /  logprobs phase seconds
    update       6·N · sequence tokens · ppo_epochs        /  update phase seconds
    sync         weight bytes                             /  sync phase seconds   (vs memcpy)

N counts the weights that multiply activations: every 2-D weight of the exported HF model,
with the embedding counted once, as the LM head (a lookup is not a matmul); attention's
score FLOPs are left out (short sequences). Sequence tokens are the batch's real tokens
(prompt + response, no padding): padding shows as a lower fraction, not as work. Forward
passes in the logprobs phase follow ``megarl.update.evaluate`` (π_old when samples are reused
or KL is a reward, π_ref when KL is on).

    python benchmarks/roofline.py [--config examples/grpo_cpu.yaml] [--steps 6] [--set k=v ...]
    python benchmarks/roofline.py --scale b --steps 3 --skip 1 --timeout 2400   # ~17 min
        (--scale: vs_trl.py's model and batch at that scale, its tuned layout, no warm start)

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, step_metrics, table  # noqa: E402


def best_time(fn: Any, repeats: int = 5) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def matmul_flops(shapes: list[tuple[int, int, int]]) -> dict[str, float]:
    """FLOP/s of fp32 ``torch.mm`` (m×k)@(k×n) per shape, best of 5."""
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / best_time(lambda a=a, b=b: torch.mm(a, b))
    return out


def memcpy_bytes_per_s(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_time(lambda: dst.copy_(src))


def weight_count(hf_dir: Path) -> tuple[int, int]:
    """(N multiplying weights, bytes of all weights) of an exported HF folder."""
    from safetensors import safe_open

    n, nbytes, has_head = 0, 0, False
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():
            t = fh.get_slice(name)
            shape = t.get_shape()
            numel = 1
            for d in shape:
                numel *= d
            nbytes += 4 * numel
            has_head |= name == "lm_head.weight"
            if len(shape) == 2 and name != "model.embed_tokens.weight":
                n += numel
        if not has_head:  # tied: the embedding is the LM head's matmul
            shape = fh.get_slice("model.embed_tokens.weight").get_shape()
            n += shape[0] * shape[1]
    return n, nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples/grpo_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/roofline"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--scale", choices=["a", "b"], help="vs_trl.py's sets at this scale, tuned layout (before --set)")
    args = ap.parse_args()
    if args.scale:
        from benchmarks.vs_trl import SCALES, _scale_sets

        tuned = SCALES[args.scale]["variants"]["tuned"]
        args.sets = [*_scale_sets(args.scale), *tuned, "warm_start.steps=0", *args.sets]

    steps = step_metrics(args.config, args.out / "run", args.steps, args.sets, args.timeout)
    from megarl.config import load_config

    cfg = load_config(args.config, args.sets)
    steps = steps[args.skip :]
    n, wbytes = weight_count(args.out / "run" / "hf_final")
    torch.set_num_threads(args.threads)  # the limits, measured after the run (no engine competes)
    h, f = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    tok = int(statistics.median(m["rollout/sequence_tokens"] for m in steps))
    mm = matmul_flops([(tok, h, 2 * f), (tok, f, h), (tok, h, h), (2048, 2048, 2048)])
    peak, copy = max(mm.values()), memcpy_bytes_per_s()

    a = cfg.algo
    critic = a.name == "ppo"  # megarl.components: PPO has a critic (values ≈ one more forward)
    fwd = int(a.ppo_epochs * a.mini_batches > 1 or a.kl_mode == "reward" or critic)
    fwd += int(a.kl_coef > 0) + int(critic)  # π_ref; the critic's values

    def med(key: str) -> float:
        return statistics.median(float(m.get(key, 0.0)) for m in steps)

    seq, resp = med("rollout/sequence_tokens"), med("rollout/tokens")
    prompts = med("rollout/responses") / cfg.rollout.samples_per_prompt
    prompt_tokens = (seq - resp) / max(med("rollout/responses"), 1) * prompts  # prefill once per prompt (prefix cache)
    gen_flop = 2 * n * (resp + prompt_tokens)
    rows = []

    def row(phase: str, work: float, unit: str, seconds: float, limit: float) -> None:
        rate = work / seconds if seconds else 0.0
        rows.append({"phase": phase, "work": f"{work:.3g} {unit}", "seconds": seconds,
                     "achieved": f"{rate / 1e9:.3g} G{unit}/s", "limit": f"{limit / 1e9:.3g} G{unit}/s",
                     "fraction": rate / limit})  # fmt: skip

    row("generate (model forward)", gen_flop, "FLOP", med("fleet/model_s"), peak)
    row("generate (whole phase)", gen_flop, "FLOP", med("timing/step/generate"), peak)
    row(f"logprobs ({fwd} forward)", 2 * n * seq * fwd, "FLOP", med("timing/step/logprobs"), peak)
    row("update", 6 * n * seq * a.ppo_epochs * (1 + int(critic)), "FLOP", med("timing/step/update"), peak)
    row("sync", med("sync/bytes") or wbytes, "B", med("timing/step/sync"), copy)
    print(f"N = {n / 1e6:.3g}M multiplying weights; {seq:.0f} sequence tokens, {resp:.0f} response tokens per step")
    print("matmul limits: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in mm.items()))
    print(f"memcpy: {copy / 1e9:.1f} GB/s (read + write, {args.threads} threads)")
    print(table(rows, ["phase", "work", "seconds", "achieved", "limit", "fraction"]))
    summary = {
        "benchmark": "roofline",
        "config": args.config,
        "sets": args.sets,
        "threads": args.threads,
        "n_weights": n,
        "matmul_flops": mm,
        "matmul_peak_flops": peak,
        "memcpy_bytes_per_s": copy,
        "phases": {r["phase"]: {"seconds": r["seconds"], "fraction": r["fraction"]} for r in rows},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
