"""Less noise per seed (#45 item 3): the between-seed spread of the time-to-target benchmark's
paired comparison with and without coupled sampling.

Two arms of the benchmark's run (``benchmarks/ttt/config.yaml``, from one warm-started base)
differ in batch only — P prompts × 16 and 2P × 16, LR on the √ rule — and train the same number
of responses; each seed runs both. The paired difference d = val(2P) − val(P) at the end is what
a time-to-target comparison rests on; its between-seed σ is the noise a seed adds to it. Two
sampling modes: ``round`` (each step's own seeds) and ``prompt`` (``rollout.sampling_seed:
prompt``: a response keyed by its prompt's stream position and sample index, so both arms of a
seed draw coupled responses). Validation is ``train.val_metric: answer_prob`` (exact, no
sampling) unless ``--val-metric reward``.

    python benchmarks/coupling_noise.py --base BASE/hf_final --tasks OUT/tasks.jsonl [--seeds 3]
        # BASE: a time_to_target.py base (its hf_final and tokenizer.model); OUT/tasks.jsonl its task file

Prints one line per run and a JSON line: per mode, each arm's mean and σ over seeds, and the
mean and σ of d.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, run_train  # noqa: E402
from benchmarks.ttt import runs  # noqa: E402

CONFIG = str(ROOT / "benchmarks/ttt/config.yaml")
LR_REF, P_REF = 1.0e-4, 32


def _final_val(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return float([r["val/reward"] for r in rows if "val/reward" in r][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the warm-started base's hf_final folder")
    ap.add_argument("--tasks", required=True, help="the benchmark's task file (tasks.jsonl)")
    ap.add_argument("--out", default=str(ROOT / "runs/coupling_noise"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="P: the arms run P and 2P prompts × 16")
    ap.add_argument("--samples", type=int, default=1024, help="responses each run trains")
    ap.add_argument("--val-metric", default="answer_prob", choices=["answer_prob", "reward"])
    ap.add_argument("--num-val", type=int, default=600)
    ap.add_argument("--modes", default="round,prompt", help="rollout.sampling_seed values to compare")
    args = ap.parse_args()
    out, base = Path(args.out), Path(args.base)
    vals: dict[tuple[str, int, int], float] = {}
    for seed in range(1, args.seeds + 1):
        for mode in args.modes.split(","):
            for p in (args.prompts, 2 * args.prompts):
                run_dir = out / f"{mode}_p{p}_s{seed}"
                runs.clean_run_dir(run_dir)
                runs.copy_tokenizer(base, run_dir)
                sets = [
                    f"data.source={args.tasks}",
                    f"data.num_val={args.num_val}",
                    f"model.init_from={base}",
                    "model.tokenizer=builtin",
                    "warm_start.steps=0",
                    f"rollout.num_prompts={p}",
                    f"optim.lr={LR_REF * math.sqrt(p / P_REF):.6g}",
                    f"train.steps={args.samples // (16 * p)}",
                    "train.eval_every=0",
                    f"train.seed={seed}",
                    f"train.run_dir={run_dir}",
                    f"rollout.sampling_seed={mode}",
                    f"train.val_metric={args.val_metric}",
                ]
                t0 = time.time()
                run_train(CONFIG, sets, out / f"logs/{run_dir.name}.log", timeout=1800)
                vals[(mode, p, seed)] = _final_val(run_dir)
                print(
                    json.dumps({"run": run_dir.name, "val": vals[(mode, p, seed)], "wall_s": round(time.time() - t0)}),
                    flush=True,
                )
    report: dict[str, object] = {"benchmark": "coupling_noise", "val_metric": args.val_metric, "samples": args.samples}
    for mode in args.modes.split(","):
        small = [vals[(mode, args.prompts, s)] for s in range(1, args.seeds + 1)]
        large = [vals[(mode, 2 * args.prompts, s)] for s in range(1, args.seeds + 1)]
        d = [b - a for a, b in zip(small, large, strict=True)]
        report[mode] = {
            f"p{args.prompts}": [statistics.mean(small), statistics.stdev(small)],
            f"p{2 * args.prompts}": [statistics.mean(large), statistics.stdev(large)],
            "d_mean": statistics.mean(d),
            "d_sd": statistics.stdev(d),
            "d": d,
        }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
