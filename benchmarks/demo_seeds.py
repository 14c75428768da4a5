"""The README's demo figures: `make demo`'s run (examples/grpo_cpu.yaml, coordinator on) for
several seeds, one after the other, with mean and spread.

Per seed: validation reward before RL (after the warm start) and after, RL wall time and
total wall time, the mean phase split of a step, and the sequence of rollout batches the
coordinator chose (responses, with the step each took effect), how many of its changes reversed
the one before (the demo should make none), the time model's eras (changes of the machine's
speed it saw, docs/COORDINATOR.md §2) and the LR it ended at.

    python benchmarks/demo_seeds.py [--seeds 1,2,3] [--out runs/bench_demo_seeds]
        [--set KEY=VALUE ...] [--arm NAME:KEY=VALUE[,KEY=VALUE...]]

``--set`` applies to every run. ``--arm`` also runs that variant on every seed, right after
the control's run of the same seed (interleaved: both see the same minutes of the machine),
and adds its table and the per-seed differences arm − control.

Prints a table and one JSON line (means, sample standard deviations, per-seed values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, run_train, table  # noqa: E402

PHASES = ("generate", "logprobs", "update", "sync", "observe")


def batch_path(records: list[dict[str, Any]]) -> tuple[list[tuple[int, int]], float]:
    """[(step, responses)] at each change of the rollout batch, and the last step's LR."""
    path: list[tuple[int, int]] = []
    lr = float("nan")
    for r in records:
        if "rollout/responses" not in r:
            continue
        b = int(r["rollout/responses"])
        if not path or path[-1][1] != b:
            path.append((int(r["step"]), b))
        lr = float(r.get("train/lr", lr))
    return path, lr


def reversals(path: list[tuple[int, int]]) -> int:
    """Changes of the batch that go the other way from the change before (512 → 1024 → 512: 1):
    the "flips back and forth" issue #13 asks the demo not to make."""
    moves = [b1 > b0 for (_, b0), (_, b1) in zip(path, path[1:], strict=False)]
    return sum(a != b for a, b in zip(moves, moves[1:], strict=False))


def one(seed: int, out: Path, sets: list[str] = [], name: str = "") -> dict[str, Any]:  # noqa: B006
    run = out / f"{name}seed{seed}"
    s = run_train(
        str(ROOT / "examples/grpo_cpu.yaml"),
        ["train.resume=never", f"train.seed={seed}", f"train.run_dir={run}", *sets],
        out / f"{name}seed{seed}.log",
    )
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in recs if "timing/step/update" in r]
    path, lr = batch_path(recs)
    row: dict[str, Any] = {
        "seed": seed,
        "val_start": s["val/reward_start"],
        "val_end": s["val/reward_end"],
        "rl_s": s["rl_wall_s"],
        "total_s": s["wall_s"],
        "batches": " → ".join(f"{b}@{st}" for st, b in path),
        "reversals": reversals(path),
        "eras": int(steps[-1].get("coord/time_eras", 0)) if steps else 0,
        "final_lr": lr,
    }
    for p in PHASES:
        row[p] = statistics.mean(float(r.get(f"timing/step/{p}", 0.0)) for r in steps)
    return row


COLUMNS = ["seed", "val_start", "val_end", "rl_s", "total_s", *PHASES, "final_lr", "reversals", "eras", "batches"]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"seeds": [r["seed"] for r in rows]}
    for k in ("val_start", "val_end", "rl_s", "total_s", *PHASES):
        vals = [float(r[k]) for r in rows]
        summary[k] = {
            "mean": round(statistics.mean(vals), 4),
            "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0,
            "per_seed": [round(v, 4) for v in vals],
        }
    summary["batches"] = [r["batches"] for r in rows]
    summary["reversals"] = [r["reversals"] for r in rows]
    summary["eras"] = [r["eras"] for r in rows]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_demo_seeds"))
    ap.add_argument("--set", action="append", default=[], dest="sets", help="KEY=VALUE for every run")
    ap.add_argument("--arm", default="", help="NAME:KEY=VALUE[,KEY=VALUE...], run after the control per seed")
    args = ap.parse_args()
    out = Path(args.out)
    arm_name, _, arm_sets = args.arm.partition(":")
    if args.arm and not arm_sets:
        ap.error(f"--arm {args.arm!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    rows, arm_rows = [], []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(one(seed, out, args.sets))
        if args.arm:
            arm_rows.append(one(seed, out, [*args.sets, *arm_sets.split(",")], name=f"{arm_name}_"))
    print(table(rows, COLUMNS))
    summary: dict[str, Any] = {"benchmark": "demo_seeds", **summarise(rows)}
    if args.arm:
        print(f"arm {arm_name}: {arm_sets}")
        print(table(arm_rows, COLUMNS))
        summary["arm"] = {"name": arm_name, "sets": arm_sets, **summarise(arm_rows)}
        summary["arm_minus_control"] = {
            k: [round(float(a[k]) - float(c[k]), 4) for a, c in zip(arm_rows, rows, strict=True)]
            for k in ("val_end", "rl_s")
        }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
