"""Behaviour parity of a restructuring: the same short runs before and after, every logged
value compared.

    python -m tools.parity run OUT            # 12-step GRPO, PPO and pipelined GRPO into OUT/<name>
    python -m tools.parity compare BEFORE AFTER

``run`` trains each config with ``megarl train`` (warm start 40, save every 6, the coordinator
warmed up in 3 steps, so checkpoints, validation and batch choices are all exercised);
``compare`` reads both runs' ``metrics.jsonl`` and prints every value that differs, leaving out
what measures time (keys with a timing, wall-clock or rate part). Exit code 1 when any differs.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

COMMON = [
    "train.steps=12",
    "warm_start.steps=40",
    "train.eval_every=6",
    "train.save_every=6",
    "coordinator.warmup_steps=3",
    "coordinator.cooldown_steps=3",
]
RUNS = {
    "grpo": ("examples/grpo_cpu.yaml", []),
    "ppo": ("examples/ppo_cpu.yaml", []),
    # the coordinator off: with a batch generated ahead its choice can hinge on measured phase
    # times (two runs of one tree chose 384 and 256 at step 10), and this run checks the pipeline
    "pipelined": ("examples/grpo_cpu.yaml", ["rollout.max_staleness=1", "algo.tis_cap=2", "coordinator.enabled=false"]),
}
TIME_PARTS = ("timing", "_s/", "wait", "frac", "per_s", "throughput", "sync/", "probe_s", "time", "goodput")
"""A key holding any of these measures time, or is computed from measured times (the
coordinator's predicted goodput): it differs between any two runs."""


def timed(key: str) -> bool:
    return any(p in key for p in TIME_PARTS) or key.endswith("_s")


def run(out: Path) -> None:
    for name, (config, extra) in RUNS.items():
        sets = [*COMMON, *extra, f"train.run_dir={out / name}", "train.resume=never"]
        cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", config]
        for s in sets:
            cmd += ["--set", s]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(before: Path, after: Path) -> int:
    differ = compared = 0
    for name in RUNS:
        a, b = records(before / name), records(after / name)
        if len(a) != len(b):
            print(f"{name}: {len(a)} records before, {len(b)} after")
            differ += 1
        for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
            for key in sorted(set(ra) | set(rb)):
                if timed(key):
                    continue
                compared += 1
                va, vb = ra.get(key), rb.get(key)
                if va != vb and not (
                    isinstance(va, float) and isinstance(vb, float) and math.isnan(va) and math.isnan(vb)
                ):
                    differ += 1
                    print(f"{name} record {i} {key}: {va!r} -> {vb!r}")
    print(json.dumps({"compared": compared, "differ": differ}))
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.parity")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    raise SystemExit(main())
