"""Fixed per-step costs at the demo scale: the part of an RL step that is not model compute.

Runs `megarl train` on the demo config (examples/grpo_cpu.yaml, what `make demo` runs, with
its warm start) once per source tree given with --code, interleaved (A B A B ...) --repeats
times, and reads each run's metrics.jsonl. Engines time their own model forward
(MEGARL_ENGINE_TIME_MODEL=1, forward hooks in the worker). Per step, steps after --skip:

    compute      = engine model forward (fleet/model_s) + logprobs phase + update phase
    non-compute  = step total - compute, of which
      rollout host   generate phase - fleet/generate_s: prompts, rewards, decode, pack, broadcast
      requests       fleet/generate_s - fleet/engine_s: HTTP round trips, health checks, (de)serialisation
      vllm overhead  fleet/engine_s - fleet/model_s: scheduling, per-request sampling, output objects
      sync           the sync phase: gather, bucket write, begin/load/commit, vLLM reload, integrity check
      other          advantages + observe + time between the phases

A tree without the fleet/* metrics (megarl before they existed) gets --untimed-model-s, or
else the model seconds of the runs that have them (the samples are the same: seeded
generation, same weights; the table checks that the rewards agree), and its generate-phase
split is not shown. The trainer's
logprobs and update phases count as compute here (their own overheads are the subject of
token-budget batching, not of this benchmark).

    python benchmarks/step_overhead.py --code /tmp/megarl_base --code . [--repeats 3] [--steps 10]

Prints a table (median per step over all steps of all repeats) and one JSON line.
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

PARTS = ("rollout_host", "requests", "vllm_overhead", "sync", "other")


def split(m: dict[str, float], model_s: float | None) -> dict[str, float]:
    """One step's seconds: compute, non-compute and its parts (see the module docstring)."""
    ph = {k.removeprefix("timing/step/"): v for k, v in m.items() if k.startswith("timing/step/")}
    have = "fleet/model_s" in m and m["fleet/model_s"] > 0
    model = m["fleet/model_s"] if have else (model_s or 0.0)
    out = {"total": ph["total"], "model_gen": model, "logprobs": ph["logprobs"], "update": ph["update"]}
    out["compute"] = model + ph["logprobs"] + ph["update"]
    out["non_compute"] = ph["total"] - out["compute"]
    out["sync"] = ph["sync"]
    out["other"] = ph["total"] - sum(v for k, v in ph.items() if k != "total") + ph["advantages"] + ph.get("observe", ph.get("plan", 0.0))
    if have:
        out["rollout_host"] = ph["generate"] - m["fleet/generate_s"]
        out["requests"] = m["fleet/generate_s"] - m["fleet/engine_s"]
        out["vllm_overhead"] = m["fleet/engine_s"] - model
    else:
        out["generate_non_model"] = ph["generate"] - model
    out["reward_mean"] = m["rollout/reward_mean"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, action="append", required=True, help="a megarl source tree (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/step_overhead"))
    ap.add_argument("--set", action="append", default=[], dest="sets", help="extra --set for every run")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--untimed-model-s", type=float, default=None,
                    help="model seconds per step for trees without fleet/model_s (default: the timed runs' median)")  # fmt: skip
    args = ap.parse_args()
    codes = [c.resolve() for c in args.code]
    runs: dict[int, list[list[dict[str, float]]]] = {i: [] for i in range(len(codes))}
    for r in range(args.repeats):
        for i, code in enumerate(codes):
            t0 = time.perf_counter()
            config = str(code / "examples/grpo_cpu.yaml")
            steps = step_metrics(config, args.out / f"tree{i}_rep{r}", args.steps, args.sets, args.timeout, code)
            runs[i].append(steps[args.skip :])
            print(f"tree {i} ({code}) repeat {r}: {len(steps)} steps in {time.perf_counter() - t0:.0f}s", flush=True)
    timed = [m["fleet/model_s"] for rs in runs.values() for steps in rs for m in steps if m.get("fleet/model_s")]
    model_s = (
        args.untimed_model_s if args.untimed_model_s is not None else (statistics.median(timed) if timed else None)
    )
    rows, summary = [], {}
    for i, code in enumerate(codes):
        per_step = [split(m, model_s) for steps in runs[i] for m in steps]
        keys = sorted({k for s in per_step for k in s})
        med = {k: statistics.median(s[k] for s in per_step if k in s) for k in keys}
        per_repeat = [statistics.median(split(m, model_s)["non_compute"] for m in steps) for steps in runs[i]]
        row = {"tree": str(code), **{k: round(v * 1e3, 1) for k, v in med.items() if k != "reward_mean"}}
        row["non_compute_repeats_ms"] = " ".join(f"{x * 1e3:.0f}" for x in per_repeat)
        row["reward_mean"] = round(med["reward_mean"], 4)
        rows.append(row)
        summary[f"tree{i}"] = {"code": str(code), "median_ms": row, "non_compute_per_repeat_s": per_repeat}
    cols = ["tree", "total", "compute", "non_compute", "non_compute_repeats_ms", "model_gen", "logprobs", "update",
            "rollout_host", "requests", "vllm_overhead", "generate_non_model", "sync", "other", "reward_mean"]  # fmt: skip
    print("milliseconds per step (median)")
    print(table(rows, cols))
    if len(codes) == 2:
        a, b = rows[0]["non_compute"], rows[1]["non_compute"]
        summary["non_compute_ratio"] = a / b if b else float("inf")
        print(f"non-compute per step: {a:.1f} ms -> {b:.1f} ms ({summary['non_compute_ratio']:.2f}x less)")
    print(json.dumps({"benchmark": "step_overhead", "engine_model_s_median": model_s, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
