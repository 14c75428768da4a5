"""Does RL teach a user's own model? Greedy accuracy on held-out word problems before and
after GRPO, for several seeds, with ``examples/byo_chat_math.yaml`` as a user runs it.

Setup (all local, deterministic): ``examples/make_byo_model.py`` makes a small random Qwen2
HF folder with a byte-level BPE tokenizer + ChatML template and a JSONL of word problems with
``\\boxed{}`` answers (128 held-out problems last). Each seed is one ``megarl train``
subprocess, one at a time: warm start (supervised, the reference answer as the assistant
turn) → greedy validation ("before RL") → GRPO with the ``math`` reward → greedy validation
("after RL"). The seed is ``train.seed`` (warm-start batches, sampling, prompt order); model,
tokenizer and data are the same for every seed.

Prints a table (seed, val before RL, val after RL, gain, RL wall s, total wall s) and one
JSON line with the mean and spread (sample standard deviation, min, max) of each column.

``--control``: after each seed's RL run, the same seed again with **no RL** and the warm start
made longer by as many steps as fit in that seed's RL wall time (at the warm start's own
seconds per step, measured in the RL run: ``warm_start_s`` of its summary). Its greedy
accuracy after the longer warm start is the control: if RL's gain were only more training,
the control would gain as much. Prints the control's accuracy and RL's gain over it, paired
by seed.

    python benchmarks/byo_learning.py [--seeds 1,2,3] [--control] [--out runs/byo_learning] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, run_train, table  # noqa: E402
from examples.make_byo_model import make_all  # noqa: E402
from megarl.metrics import read_metrics  # noqa: E402

CONFIG = str(ROOT / "examples/byo_chat_math.yaml")
COLS = ["seed", "val_before_rl", "val_after_rl", "gain", "rl_wall_s", "total_wall_s"]


def one_seed(seed: int, model: Path, data: Path, out: Path, extra: list[str], timeout: int) -> dict[str, Any]:
    """One ``megarl train`` run; the validation numbers come from its metrics.jsonl (step 0 =
    after the warm start, before RL; the last record = after RL), the times from its summary."""
    run_dir = out / f"seed{seed}"
    sets = [
        f"model.init_from={model}",
        f"data.source={data}",
        f"train.seed={seed}",
        f"train.run_dir={run_dir}",
        "train.resume=never",
        "train.tensorboard=false",
        *extra,
    ]
    t0 = time.perf_counter()
    summary = run_train(CONFIG, sets, out / f"seed{seed}.log", timeout=timeout)
    wall = time.perf_counter() - t0
    vals = [(r["step"], r["val/reward"]) for r in read_metrics(run_dir) if "val/reward" in r]
    if not vals or vals[0][0] != 0:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no validation record at step 0 (found {vals[:3]})")
    before, after = vals[0][1], vals[-1][1]
    return {
        "seed": seed,
        "val_before_rl": before,
        "val_after_rl": after,
        "gain": after - before,
        "rl_wall_s": summary["rl_wall_s"],
        "warm_start_s": summary.get("warm_start_s", float("nan")),
        "total_wall_s": wall,  # the whole command: start-up, warm start, RL, validation, export, exit
        "val_curve": vals,
    }


def control(seed: int, rl: dict[str, Any], model: Path, data: Path, out: Path, extra: list[str], timeout: int,
            ws_steps: int) -> dict[str, Any]:  # fmt: skip
    """The seed without RL: ``ws_steps`` + the warm-start steps that fit in the RL run's wall time."""
    more = round(rl["rl_wall_s"] / (rl["warm_start_s"] / ws_steps))
    row = one_seed(seed, model, data, out / "control", [*extra, f"warm_start.steps={ws_steps + more}", "train.steps=0"],
                   timeout)  # fmt: skip
    return {
        "seed": seed,
        "warm_start_steps": ws_steps + more,
        "extra_warm_start_s": row["warm_start_s"] - rl["warm_start_s"],
        "rl_wall_s": rl["rl_wall_s"],
        "val_control": row["val_after_rl"],  # step 0 = after the longer warm start; no RL step
        "val_after_rl": rl["val_after_rl"],
        "rl_minus_control": rl["val_after_rl"] - row["val_after_rl"],
    }


def spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for col in COLS[1:]:
        xs = [float(r[col]) for r in rows]
        out[col] = {
            "mean": statistics.fmean(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs),
            "max": max(xs),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values, run one at a time")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/byo_learning", help="model, data and run folders")
    ap.add_argument("--set", action="append", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--timeout", type=int, default=900, help="limit per run, seconds (the issue's budget: 15 min)")
    ap.add_argument("--control", action="store_true", help="also run each seed's warm-start-only control")
    args = ap.parse_args()
    model, data = make_all(args.out / "byo")
    ws_steps = int(next((s.split("=", 1)[1] for s in reversed(args.set) if s.startswith("warm_start.steps=")),
                        yaml.safe_load(Path(CONFIG).read_text())["warm_start"]["steps"]))  # fmt: skip
    rows, controls = [], []
    for seed in (int(s) for s in args.seeds.split(",")):
        row = one_seed(seed, model, data, args.out, args.set, args.timeout)
        print(
            f"seed {seed}: val {row['val_before_rl']:.3f} -> {row['val_after_rl']:.3f}, curve {row['val_curve']}",
            flush=True,
        )
        rows.append(row)
        if args.control:
            controls.append(control(seed, row, model, data, args.out, args.set, args.timeout, ws_steps))
            print(f"seed {seed} control: {controls[-1]}", flush=True)
    print(table(rows, COLS))
    result: dict[str, Any] = {"byo_learning": spread(rows), "seeds": [r["seed"] for r in rows], "overrides": args.set}
    if controls:
        ccols = ["seed", "warm_start_steps", "extra_warm_start_s", "rl_wall_s", "val_control", "val_after_rl",
                 "rl_minus_control"]  # fmt: skip
        print(table(controls, ccols))
        diffs = [c["rl_minus_control"] for c in controls]
        result["control"] = {
            "rows": controls,
            "rl_minus_control_mean": statistics.fmean(diffs),
            "rl_minus_control_std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "min": min(diffs),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
