"""Wall time (and samples) to reach a validation reward on the demo task, side by side:

  small        fixed 8 prompts × 16 samples, lr_ref
  large        fixed 32 × 16, same lr_ref
  large_sqrt   fixed 32 × 16, lr_ref × sqrt(4)
  coordinator  starts at 8 × 16, the coordinator picks batch (8..64 prompts) and sqrt-scaled LR

All runs start from the same warm-started actor (made once, exported to HF, `model.init_from`),
TP=2 + one vLLM engine, validation every 5 steps (validation time excluded). Several seeds.
Prints a table and one JSON line of ratios (fixed / coordinator, mean over seeds).

    python benchmarks/time_to_target.py [--seeds 2] [--target 0.45] [--max-steps 120]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, run_train, table  # noqa: E402

CONFIG = str(ROOT / "examples/grpo_cpu.yaml")
VARIANTS = {
    "small": ["rollout.num_prompts=8", "coordinator.enabled=false"],
    "large": ["rollout.num_prompts=32", "coordinator.enabled=false"],
    "large_sqrt": ["rollout.num_prompts=32", "optim.lr=2e-4", "coordinator.enabled=false"],
    "coordinator": ["rollout.num_prompts=8", "coordinator.enabled=true", "coordinator.min_prompts=8",
                    "coordinator.max_prompts=64", "coordinator.warmup_steps=5", "coordinator.cooldown_steps=3",
                    "coordinator.lr_rule=sqrt", "coordinator.lr_max=4e-4"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.45)
    ap.add_argument("--max-steps", type=int, default=120)
    ap.add_argument("--out", default=str(ROOT / "runs/bench_ttt"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    base = out / "base"
    if not (base / "hf_final" / "model.safetensors").exists():
        run_train(CONFIG, ["train.steps=0", f"train.run_dir={base}"], out / "logs/base.log")
    common = [f"model.init_from={base / 'hf_final'}", "warm_start.steps=0", f"train.steps={args.max_steps}",
              "train.eval_every=5", f"train.target_val_reward={args.target}", "train.tensorboard=false",
              "optim.lr=1e-4"]
    rows = []
    for seed in range(args.seeds):
        for name in args.variants.split(","):
            run = out / f"{name}_s{seed}"
            s = run_train(CONFIG, common + VARIANTS[name] + [f"train.seed={seed + 1}", f"train.run_dir={run}"],
                          out / f"logs/{name}_s{seed}.log")
            rows.append({"variant": name, "seed": seed, "reached": "time_to_target_s" in s,
                         "time_s": s.get("time_to_target_s"), "steps": s.get("steps_to_target"),
                         "samples": s.get("samples_to_target"), "val_start": s.get("val/reward_start"),
                         "rl_wall_s": s.get("rl_wall_s")})
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows, ["variant", "seed", "reached", "time_s", "steps", "samples", "val_start", "rl_wall_s"]))
    ratios: dict[str, float | None] = {}
    coord = [r for r in rows if r["variant"] == "coordinator"]
    for name in VARIANTS:
        if name == "coordinator":
            continue
        fixed = [r for r in rows if r["variant"] == name]
        for key in ("time_s", "samples"):
            pairs = [(f[key], c[key]) for f in fixed for c in coord if f["seed"] == c["seed"] and f[key] and c[key]]
            ratios[f"{name}/coordinator_{key}"] = statistics.mean(a / b for a, b in pairs) if pairs else None
    ratios["reached"] = {n: sum(r["reached"] for r in rows if r["variant"] == n) for n in VARIANTS}  # type: ignore[assignment]
    print(json.dumps({"benchmark": "time_to_target", "target": args.target, "seeds": args.seeds,
                      "wall_s": time.time() - t0, **ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
