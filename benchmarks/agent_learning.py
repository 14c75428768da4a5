"""Does multi-turn RL with a tool learn? The #43 learning check, pre-registered.

The task: ``examples/agent_calc_cpu.yaml`` — products of three-digit numbers (``builtin:multiply``),
which the tiny model cannot compute, with the built-in calculator. Two arms per seed, one after
the other (interleaved: both see the same minutes of the machine):

* ``agent``: the example — a warm start on demonstrated episodes (tool call, the calculator's
  answer, the final answer) of at most ``WARM_STEPS`` steps, stopped by the example's
  ``warm_start.stop_at_exact`` (0.3), then ``RL_STEPS`` steps of multi-turn GRPO;
* ``single``: the same model, data, warm-start settings and RL steps with no environment
  (``env.fn=""``): one prompt → one answer, no tool. (Its answers are products it cannot
  compute: no batch reaches the stopping share, so it always takes the ``WARM_STEPS``.)

Measured: greedy validation accuracy on the held-out rows (``val/reward``: exact product) after
the warm start and at the end. Bars (fixed by #43, unchanged since the first registration):

* ``agent_end − agent_start ≥ 0.15`` (multi-turn RL over its own tool-using warm start), and
* ``agent_end − single_end ≥ 0.2`` (over single-turn RL without tools),

each on the mean over ``SEEDS`` with its spread and a one-sided 90 % t lower bound of the paired
difference, and ≤ 15 minutes a seed here.

History. The first registration (9fc3999: a fixed 140-step warm start chosen on seed 7, 150 RL
steps, seeds 41–43) failed the first bar: 0.680 → 0.828, 0.648 → 0.828, 0 → 0 (mean gain
+0.109). Diagnosis on the tuning seeds (7, 8, 9; never on judging seeds): before ~130–150 warm
steps (by seed) greedy tool calls are well formed but carry made-up operands (seed 7 at 120
steps: 127 of 128 validation calls with the wrong expression, the answers not copied from the
calculator's result either) — the 2-layer model learns to copy abruptly, and greedy validation
jumps from 0 to ~0.5 within 10 steps and to ~0.8 within 20, so a fixed length lands on either
side by the luck of the seed. And at sampling temperature 1 the 73-id calls break (~60 % tool
errors, ~45 % of episodes cut by the long error observation): from a 0.41 warm start the
sampled reward was ~1 % and RL crept to 0.60 in 150 steps (seed 7). The example now stops its
warm start on what it has taught (``warm_start.stop_at_exact``: the share of a batch the model
reproduces exactly, teacher-forced — what greedy decoding would write) and samples at 0.6
(seed 7: tool errors 1–5 %, sampled reward 0.3–0.7, validation 0.41 → 0.83 in 70 steps).
Tuning seeds 7 / 8 / 9, agent arm, 100 RL steps: warm start stopped after 138 / 126 / 137 steps,
validation 0.414 → 0.820, 0.211 → 0.828, 0.406 → 0.805; the single arm (seed 7) 0 → 0. The
agent's ceiling, 0.828, is the share of six-digit products among the validation rows (106 of
128): the model copies the result by position, and a five-digit one comes out shifted
(46786 → 74678), on every tuning seed. This second registration uses fresh seeds
``SEEDS`` (61–63, never run before); every setting was chosen on ``TUNING_SEEDS`` only.

    python -m benchmarks.agent_learning --tune         # the agent arm on TUNING_SEEDS
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
SEEDS = [61, 62, 63]
"""Judging seeds: fresh (never run before this registration; no setting was picked on them)."""
TUNING_SEEDS = [7, 8, 9]
"""The seeds every setting here and in the example was chosen on."""
WARM_STEPS = 300
"""Warm-start steps at most (``warm_start.steps``): the agent arm stops at the example's
``stop_at_exact`` (tuning seeds 7 / 8 / 9: after 138 / 126 / 137 steps), the single arm runs all of them."""
RL_STEPS = 100
"""RL steps of both arms (tuning seeds at temperature 0.6: the agent arm's validation 0.41 → 0.82,
0.21 → 0.83, 0.41 → 0.81, within 0.03 of its end after 30–60 steps; ~4.5 min a seed)."""
BARS = {"agent_gain": 0.15, "over_single": 0.2}


COLS = ["arm", "seed", "warm", "warm_taken", "warm_exact", "start", "end", "minutes"]


def _run(arm: str, seed: int, out: Path) -> dict[str, Any]:
    sets = [f"train.seed={seed}", f"warm_start.steps={WARM_STEPS}", f"train.steps={RL_STEPS}", f"train.run_dir={out}",
            "train.tensorboard=false", "train.resume=never"]  # fmt: skip
    if arm == "single":
        sets.append("env.fn=")
    t0 = time.perf_counter()
    summary = run_train(CONFIG, sets, out.with_suffix(".log"), timeout=1800)
    return {"arm": arm, "seed": seed, "warm": WARM_STEPS, "warm_taken": summary["warm_start/steps"],
            "warm_exact": summary["warm_start/final_exact"], "start": summary["val/reward_start"],
            "end": summary["val/reward_end"], "minutes": (time.perf_counter() - t0) / 60}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help="the agent arm on TUNING_SEEDS (never the judging seeds)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_agent_learning"))
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    if args.tune:
        for seed in TUNING_SEEDS:
            rows.append(_run("agent", seed, out / f"tune_agent_s{seed}"))
            print(table(rows[-1:], COLS), flush=True)
        print(table(rows, COLS))
        print(json.dumps({"agent_learning_tune": rows}))
        return
    for seed in SEEDS:
        for arm in ("agent", "single"):
            rows.append(_run(arm, seed, out / f"{arm}_s{seed}"))
            print(table(rows[-1:], COLS), flush=True)
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
    print(table(rows, COLS))
    print(json.dumps({"agent_learning": result}))


if __name__ == "__main__":
    main()
