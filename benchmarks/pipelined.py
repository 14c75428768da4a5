"""Pipelined rollouts on disjoint cores: does overlapping generation with the update bring the
step down to the slower of the two, and does the one-step lag cost reward?

The disaggregated case in miniature: the vLLM engine on core 0, the trainer (TP=1, one rank)
on core 1. `megarl train` runs under `taskset -c 1`; a watcher pins every thread of the run's
engine process to core 0 as soon as it appears (and keeps re-pinning threads it starts later),
and vLLM's OpenMP threads are bound to core 0 (VLLM_CPU_OMP_THREADS_BIND=0).

Runs, all from one warm-started actor (made once, `model.init_from`), the demo task and batch
(GRPO, 32 prompts × 16 samples unless --prompts), TIS cap 2 in both so only the lag differs:
  staleness 0   generate, then train (today's loop)
  staleness 1   the engine generates step s+1 while the trainer updates on step s
for --seeds seeds each. Per run (steps after the first two): step time; generate = the fleet's
generation of one batch (k=0: `timing/step/generate`, k=1: `pipeline/batch_generate_s`);
train = everything the trainer does itself (log-probs + advantages + update + sync + observe);
step / max(generate, train) (goal for k=1: ≤ 1.15); mean staleness; the fractions of the step
the trainer and the fleet waited; validation reward at the start and the end.

    python benchmarks/pipelined.py [--seeds 3] [--steps 30] [--prompts 32] [--out runs/bench_pipelined]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, run_train, table  # noqa: E402

CONFIG = str(ROOT / "examples/grpo_cpu.yaml")
COMMON = [
    "parallel.tensor_parallel=1",
    "coordinator.enabled=false",
    "train.tensorboard=false",
    "train.eval_every=0",
    "algo.tis_cap=2",
    "optim.lr=1e-4",
    "optim.schedule=constant",
]
ENGINE_CORE, TRAINER_CORE = 0, 1


def pin_engines(run_dir: Path, stop: threading.Event) -> None:
    """Pin every thread of the engine process serving ``run_dir`` to ENGINE_CORE until ``stop``."""
    marker = str(run_dir / "hf_engine").encode()
    while not stop.wait(0.05):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"megarl.engine.server" not in cmd or marker not in cmd:
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if os.sched_getaffinity(int(tid)) != {ENGINE_CORE}:
                        os.sched_setaffinity(int(tid), {ENGINE_CORE})
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # a process or thread that just ended


def pinned_run(sets: list[str], run_dir: Path, log: Path) -> dict[str, Any]:
    """`megarl train` with the trainer on TRAINER_CORE and its engine on ENGINE_CORE."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CPU_OMP_THREADS_BIND=str(ENGINE_CORE))
    cmd = ["taskset", "-c", str(TRAINER_CORE), sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG]
    cmd += [a for s in [*sets, f"train.run_dir={run_dir}"] for a in ("--set", s)]
    stop = threading.Event()
    watcher = threading.Thread(target=pin_engines, args=(run_dir, stop), daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    finally:
        stop.set()
        watcher.join()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = next(ln for ln in reversed((proc.stdout + proc.stderr).splitlines()) if " summary {" in ln)
    return dict(json.loads(summary.split(" summary ", 1)[1]))


def step_figures(run_dir: Path, k: int, skip: int = 2) -> dict[str, float]:
    """Means over the steps after the first ``skip`` (start-up, pipeline fill)."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "timing/step/total" in r][skip:]

    def mean(f: Any) -> float:
        return statistics.mean(f(r) for r in steps)

    t = "timing/step/"
    gen = mean(lambda r: r["pipeline/batch_generate_s"] if k else r[f"{t}generate"])
    train = mean(lambda r: sum(r[f"{t}{p}"] for p in ("logprobs", "advantages", "update", "sync", "observe")))
    step = mean(lambda r: r[f"{t}total"])
    return {
        "step_s": step,
        "generate_s": gen,
        "train_s": train,
        "step/max": step / max(gen, train),
        "lag": mean(lambda r: r["pipeline/staleness_mean"]),
        "trainer_wait": mean(lambda r: r["pipeline/trainer_wait_frac"]),
        "fleet_wait": mean(lambda r: r["pipeline/fleet_wait_frac"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "runs/bench_pipelined"))
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores (engine on core 0, trainer on core 1)")
    out = Path(args.out)
    t0 = time.time()
    base = out / "base"
    if not (base / "hf_final" / "model.safetensors").exists():  # the warm-started actor, once
        run_train(CONFIG, ["parallel.tensor_parallel=1", "train.steps=0", f"train.run_dir={base}"], out / "logs/base.log")
    common = [*COMMON, f"model.init_from={base / 'hf_final'}", "warm_start.steps=0", f"train.steps={args.steps}",
              f"rollout.num_prompts={args.prompts}"]
    rows = []
    for seed in range(1, args.seeds + 1):
        for k in (0, 1):
            run = out / f"k{k}_s{seed}"
            s = pinned_run([*common, f"rollout.max_staleness={k}", f"train.seed={seed}"], run, out / f"logs/{run.name}.log")
            rows.append({"staleness": k, "seed": seed, **step_figures(run, k),
                         "val_start": s.get("val/reward_start"), "val_end": s.get("val/reward_end")})
            print(json.dumps(rows[-1]), flush=True)
    cols = ["staleness", "seed", "step_s", "generate_s", "train_s", "step/max", "lag", "trainer_wait",
            "fleet_wait", "val_start", "val_end"]
    print(table(rows, cols))

    def avg(k: int, key: str) -> float:
        return statistics.mean(r[key] for r in rows if r["staleness"] == k)

    print(json.dumps({
        "benchmark": "pipelined", "seeds": args.seeds, "steps": args.steps, "prompts": args.prompts,
        "k0_step_s": avg(0, "step_s"), "k1_step_s": avg(1, "step_s"), "speedup": avg(0, "step_s") / avg(1, "step_s"),
        "k1_step_over_max": avg(1, "step/max"), "k0_val_end": avg(0, "val_end"), "k1_val_end": avg(1, "val_end"),
        "val_end_sd": statistics.stdev([r["val_end"] for r in rows]) if len(rows) > 2 else None,
        "wall_s": time.time() - t0,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
