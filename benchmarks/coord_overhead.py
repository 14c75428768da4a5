"""The coordinator's own cost: grad probe + planning as a fraction of step time (issue #13's
"probe + planning ≤ 2 % of step time"), side by side across source trees.

Runs `megarl train` on the demo config (examples/grpo_cpu.yaml, its warm start, TP = 2,
micro-batches of 64) with the coordinator measuring but not adapting
(``coordinator.adapt=false``), so every tree trains the same batches with the same LR, at
each ``--prompts`` count (× 16 responses: 8 → 2 micro-batches a step, 32 → 8). Each tree given
with --code runs once per batch per repeat, interleaved (A B A B ...). Per step after --skip:

    probe     Σ coord/probe_s/<model>: the micro-batch norms and their collectives
    plan      timing/step/observe (timing/step/plan before 2026-12-06): gathering the timings, the coordinator's observe and plan
    fraction  (probe + plan) / timing/step/total

    python benchmarks/coord_overhead.py --code /tmp/megarl_base --code . [--prompts 8,32] [--repeats 2] [--steps 12]

Prints a table (medians per step over all steps of all repeats) and one JSON line with, for two
trees, the ratio of their probe times and of their fractions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import step_metrics, table  # noqa: E402


def cost(m: dict[str, float]) -> dict[str, float]:
    """One step's coordinator cost, seconds, and its fraction of the step."""
    probe = sum(v for k, v in m.items() if k.startswith("coord/probe_s/"))
    plan = m.get("timing/step/observe", m.get("timing/step/plan", 0.0))  # (older trees: "plan")
    total = m["timing/step/total"]
    return {"probe": probe, "plan": plan, "total": total, "fraction": (probe + plan) / total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, action="append", required=True, help="a megarl source tree (repeatable)")
    ap.add_argument("--prompts", default="8,32", help="comma-separated prompts per step (× 16 responses)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/coord_overhead"))
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    codes = [c.resolve() for c in args.code]
    prompts = [int(p) for p in args.prompts.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    seen: dict[tuple[int, int], list[dict[str, float]]] = {(i, p): [] for i in range(len(codes)) for p in prompts}
    for r in range(args.repeats):
        for p in prompts:
            for i, code in enumerate(codes):
                t0 = time.perf_counter()
                sets = ["coordinator.adapt=false", "coordinator.min_prompts=4", f"rollout.num_prompts={p}"]
                steps = step_metrics(
                    str(code / "examples/grpo_cpu.yaml"), args.out / f"tree{i}_p{p}_rep{r}", args.steps, sets,
                    args.timeout, code,
                )  # fmt: skip
                if not any(k.startswith("coord/probe_s/") for k in steps[-1]):
                    raise RuntimeError(f"tree {code}: no coord/probe_s metrics (is the coordinator on?)")
                seen[(i, p)] += [cost(m) for m in steps[args.skip :]]
                print(f"tree {i} ({code}) P={p} repeat {r}: {len(steps)} steps in {time.perf_counter() - t0:.0f}s")
    rows, summary = [], {}
    for (i, p), per_step in seen.items():
        med = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
        rows.append({
            "tree": i, "responses": p * 16, "step_ms": round(med["total"] * 1e3, 1),
            "probe_ms": round(med["probe"] * 1e3, 2), "plan_ms": round(med["plan"] * 1e3, 2),
            "fraction_pct": round(med["fraction"] * 100, 2), "steps": len(per_step),
        })  # fmt: skip
        summary[f"tree{i}_p{p}"] = {"code": str(codes[i]), **med}
    print(table(rows, ["tree", "responses", "step_ms", "probe_ms", "plan_ms", "fraction_pct", "steps"]))
    if len(codes) == 2:
        for p in prompts:
            a, b = summary[f"tree0_p{p}"], summary[f"tree1_p{p}"]
            summary[f"probe_ratio_p{p}"] = a["probe"] / b["probe"] if b["probe"] else float("inf")
            summary[f"fraction_ratio_p{p}"] = a["fraction"] / b["fraction"] if b["fraction"] else float("inf")
    print(json.dumps({"benchmark": "coord_overhead", "codes": [str(c) for c in codes], **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
