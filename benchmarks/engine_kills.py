"""Step time while engines die: two engines, one killed again and again (#41 E).

Runs `megarl train` on the demo config (examples/grpo_cpu.yaml with its warm start) with
``rollout.num_engines=2``, three variants interleaved (A B C A B C ...) ``--repeats`` times:

    calm        no engine dies
    blocking    ``rollout.engine_restart=blocking``: a dead engine is restarted and given the
                current weights before the fleet goes on (what megarl did before #41 E)
    background  ``rollout.engine_restart=background``: the survivor takes the dead engine's
                prompts, the dead one restarts in its own thread and rejoins at an update

The kills are real SIGKILLs placed by the test hook ``MEGARL_FAULT``: every ``--every``-th
step from step 2 on, the engine alternating, half of them with the engine's /generate in
flight (mid-generation) and half while it is idle (the trainer computing log-probs). Seeded
generation: every variant trains on the same samples (the table checks the final rewards).

Per variant: RL time (sum of the steps), the median and the worst step, and the median of
the steps from a kill up to (not including) the next one, the steps "with a restart going on".
Ratios are per repeat, against the calm run of the same repeat, then the median and range.

    python benchmarks/engine_kills.py [--repeats 3] [--steps 16] [--every 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, step_metrics, table  # noqa: E402

VARIANTS = ("calm", "blocking", "background")


def faults(steps: int, every: int) -> str:
    """MEGARL_FAULT: a kill every ``every`` steps from step 2; step s samples with version s."""
    out = []
    for k, step in enumerate(range(2, steps, every)):
        phase = "generate" if k % 2 == 0 else "logprobs"
        out.append(f"kill_engine_at={phase}:version={step}:engine={k % 2}")
    return ";".join(out)


def run(variant: str, out: Path, steps: int, every: int, timeout: int) -> list[dict[str, float]]:
    sets = ["rollout.num_engines=2", "rollout.seeded=true", "coordinator.enabled=false"]
    sets.append(f"rollout.engine_restart={'blocking' if variant == 'blocking' else 'background'}")
    os.environ["MEGARL_FAULT"] = "" if variant == "calm" else faults(steps, every)
    try:
        return step_metrics(str(ROOT / "examples/grpo_cpu.yaml"), out, steps, sets, timeout)
    finally:
        os.environ.pop("MEGARL_FAULT", None)


def summarise(rows: list[dict[str, float]], kill_steps: list[int]) -> dict[str, float]:
    totals = [r["timing/step/total"] for r in rows]
    hit = [r["timing/step/total"] for r in rows if any(k <= r["step"] for k in kill_steps)]
    return {
        "rl_s": sum(totals),
        "median_step_s": statistics.median(totals),
        "worst_step_s": max(totals),
        "after_kill_median_s": statistics.median(hit) if hit else float("nan"),
        "restarts": rows[-1].get("fleet/restarts", 0.0),
        "rejoins": max(r.get("fleet/rejoins", 0.0) for r in rows),
        "final_reward": rows[-1]["rollout/reward_mean"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=3, help="steps between kills")
    ap.add_argument("--out", type=Path, default=Path("/tmp/engine_kills"))
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    kill_steps = list(range(2, args.steps, args.every))
    print(f"MEGARL_FAULT={faults(args.steps, args.every)}", flush=True)
    res: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS:
            t0 = time.perf_counter()
            rows = run(v, args.out / f"{v}_rep{r}", args.steps, args.every, args.timeout)
            res[v].append(summarise(rows, kill_steps))
            print(f"{v} repeat {r}: {len(rows)} steps, RL {res[v][-1]['rl_s']:.1f}s "
                  f"(wall {time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    table_rows, summary = [], {}
    for v in VARIANTS:
        per = res[v]
        row: dict[str, object] = {"variant": v}
        for k in per[0]:
            row[k] = round(statistics.median(p[k] for p in per), 3)
        ratio = [p["after_kill_median_s"] / c["after_kill_median_s"] for p, c in zip(per, res["calm"])]
        rl = [p["rl_s"] / c["rl_s"] for p, c in zip(per, res["calm"])]
        row["after_kill_vs_calm"] = f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        row["rl_vs_calm"] = f"{statistics.median(rl):.2f} ({min(rl):.2f}-{max(rl):.2f})"
        table_rows.append(row)
        summary[v] = {"per_repeat": per, "after_kill_vs_calm": ratio, "rl_vs_calm": rl}
    cols = ["variant", "rl_s", "rl_vs_calm", "median_step_s", "after_kill_median_s", "after_kill_vs_calm",
            "worst_step_s", "restarts", "rejoins", "final_reward"]  # fmt: skip
    print(f"{len(kill_steps)} kills at steps {kill_steps}; medians over {args.repeats} repeats, ratios per repeat")
    print(table(table_rows, cols))
    print(json.dumps({
        "benchmark": "engine_kills", "steps": args.steps, "kills": kill_steps, "repeats": args.repeats,
        "after_kill_ratio_background": statistics.median(summary["background"]["after_kill_vs_calm"]),
        "after_kill_ratio_blocking": statistics.median(summary["blocking"]["after_kill_vs_calm"]),
        "rl_ratio_background": statistics.median(summary["background"]["rl_vs_calm"]),
        "rl_ratio_blocking": statistics.median(summary["blocking"]["rl_vs_calm"]),
        **summary,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
