"""Does multi-turn RL with a tool learn? The #43 learning check, pre-registered.

The task: ``examples/agent_calc_cpu.yaml`` — products of three-digit numbers (``builtin:multiply``),
which the tiny model cannot compute, with the built-in calculator. Two arms per seed, one after
the other (interleaved: both see the same minutes of the machine):

* ``agent``: the example — a warm start of ``WARM_STEPS`` steps on demonstrated episodes (tool
  call, the calculator's answer, the final answer), then ``RL_STEPS`` steps of multi-turn GRPO;
* ``single``: the same model, data, warm-start length and RL steps with no environment
  (``env.fn=""``): one prompt → one answer, no tool.

Measured: greedy validation accuracy on the held-out rows (``val/reward``: exact product) after
the warm start and at the end. Bars (fixed here before the judging runs; #43):

* ``agent_end − agent_start ≥ 0.15`` (multi-turn RL over its own tool-using warm start), and
* ``agent_end − single_end ≥ 0.2`` (over single-turn RL without tools),

each on the mean over ``SEEDS`` with its spread and a one-sided 90 % t lower bound of the paired
difference, and ≤ 15 minutes a seed here. ``WARM_STEPS`` was chosen on seed ``TUNING_SEED`` only
(``--tune``: the warm-start lengths in ``TUNE_WARM``, one agent run each), never on ``SEEDS``.

    python -m benchmarks.agent_learning --tune         # choose WARM_STEPS (seed 7 only)
    python -m benchmarks.agent_learning                # the judging runs (SEEDS)

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, mean_bound, run_train, table

CONFIG = str(ROOT / "examples/agent_calc_cpu.yaml")
SEEDS = [41, 42, 43]
"""Judging seeds: fresh (no setting was picked on them)."""
TUNING_SEED = 7
TUNE_WARM = [110, 120, 130, 140]
WARM_STEPS = 140
"""Warm-start steps of both arms, set from ``--tune`` on TUNING_SEED before the judging runs
(2026-12-06, 60 RL steps each: 110, 120 and 130 left greedy validation at 0 and no reward to
learn from; 140 started at 0.52 and ended at 0.63, still rising)."""
RL_STEPS = 150
"""RL steps of both arms (60 in the tuning runs; raised for the judging runs because the tuning
seed was still rising at 60, within the 15 minutes a seed)."""
BARS = {"agent_gain": 0.15, "over_single": 0.2}


def _run(arm: str, seed: int, warm: int, out: Path) -> dict[str, Any]:
    sets = [f"train.seed={seed}", f"warm_start.steps={warm}", f"train.steps={RL_STEPS}", f"train.run_dir={out}",
            "train.tensorboard=false"]  # fmt: skip
    if arm == "single":
        sets.append("env.fn=")
    t0 = time.perf_counter()
    summary = run_train(CONFIG, sets, out.with_suffix(".log"), timeout=1800)
    return {"arm": arm, "seed": seed, "warm": warm, "start": summary["val/reward_start"],
            "end": summary["val/reward_end"], "minutes": (time.perf_counter() - t0) / 60}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help="choose WARM_STEPS on TUNING_SEED (agent arm only)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_agent_learning"))
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    if args.tune:
        for warm in TUNE_WARM:
            rows.append(_run("agent", TUNING_SEED, warm, out / f"tune_w{warm}"))
            print(table(rows[-1:], ["arm", "seed", "warm", "start", "end", "minutes"]), flush=True)
        print(table(rows, ["arm", "seed", "warm", "start", "end", "minutes"]))
        print(json.dumps({"agent_learning_tune": rows}))
        return
    for seed in SEEDS:
        for arm in ("agent", "single"):
            rows.append(_run(arm, seed, WARM_STEPS, out / f"{arm}_s{seed}"))
            print(table(rows[-1:], ["arm", "seed", "warm", "start", "end", "minutes"]), flush=True)
    by = {(r["arm"], r["seed"]): r for r in rows}
    gain = [by["agent", s]["end"] - by["agent", s]["start"] for s in SEEDS]
    over = [by["agent", s]["end"] - by["single", s]["end"] for s in SEEDS]
    result = {"warm_steps": WARM_STEPS, "rl_steps": RL_STEPS, "seeds": SEEDS, "bars": BARS, "rows": rows}
    for name, diffs in (("agent_gain", gain), ("over_single", over)):
        mean, sd, low = mean_bound(diffs, 0.90)
        result[name] = {"per_seed": [round(d, 3) for d in diffs], "mean": round(mean, 3), "sd": round(sd, 3),
                        "lower90": round(low, 3), "passes": bool(mean >= BARS[name])}  # fmt: skip
    seed_minutes = [sum(r["minutes"] for r in rows if r["seed"] == s and r["arm"] == "agent") for s in SEEDS]
    result["agent_minutes_per_seed"] = [round(m, 1) for m in seed_minutes]
    print(table(rows, ["arm", "seed", "warm", "start", "end", "minutes"]))
    print(json.dumps({"agent_learning": result}))


if __name__ == "__main__":
    main()
