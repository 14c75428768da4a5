"""How the online B_simple reads when |G|² is not resolved from zero: synthetic gradients, the
coordinator's own estimator (``microbatch_estimates`` + ``NoiseScaleEstimator``).

Each step draws B samples' mean gradients in B/16 parts of 16 samples around a true gradient G
(|G|² = 0.22) with per-sample noise of trace 2750 (true B_simple = 12,500 samples) spread over
``dims`` directions, and updates the EMA (β = 0.9, each step weighted by its parts' degrees of
freedom). After ``steps`` steps it records the point estimate EMA(tr Σ)/EMA(|G|²), which the
estimator returns only while EMA(|G|²) > 0, and whether the band's upper end is finite.

Real gradient noise sits in few directions; the fewer, the noisier |G_B|² is, and the more often
EMA(|G|²) is small or negative. Reading the ratio only when it is positive selects the steps
where |G|² came out high, so the point estimate reads low, the more so the smaller the batch
(fewer degrees of freedom per step): it "follows the batch" with no change in the true noise.

    python benchmarks/noise_selection_bias.py [--replicates 200] [--steps 30]

Prints a table and one JSON line {"median_over_truth": {dims: {batch: median / truth}}}. Pure NumPy,
~40 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402
from megarl.coordinator.noise import NoiseScaleEstimator, microbatch_estimates, parts_dof  # noqa: E402

G2, TRACE, PART = 0.22, 2750.0, 16


def replicate(rng: np.random.Generator, g: np.ndarray, batch: int, steps: int, beta: float) -> tuple[float | None, bool]:
    """One run of ``steps`` steps at ``batch`` samples: (point estimate or None, band finite)."""
    k = batch // PART
    sd = np.sqrt(TRACE / g.size / PART)  # per part: the mean of PART samples
    est = NoiseScaleEstimator(beta=beta)
    for _ in range(steps):
        parts = g + rng.standard_normal((k, g.size)) * sd
        whole = parts.mean(0)
        g2, tr = microbatch_estimates([float(p @ p) for p in parts], [PART] * k, float(whole @ whole))
        est.update(g2, tr, parts_dof(k))
    band = est.band()
    return est.b_simple, band is not None and np.isfinite(band[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicates", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--beta", type=float, default=0.9)
    ap.add_argument("--dims", default="10,50,2000", help="directions the noise lives in (comma-separated)")
    ap.add_argument("--batches", default="128,256,512,1024", help="samples per step (multiples of 16)")
    args = ap.parse_args()
    truth = TRACE / G2
    rows, out = [], {}
    for dims in (int(x) for x in args.dims.split(",")):
        rng = np.random.default_rng(dims)
        g = rng.standard_normal(dims)
        g *= np.sqrt(G2) / np.linalg.norm(g)
        out[str(dims)] = {}
        for batch in (int(x) for x in args.batches.split(",")):
            reads, finite = [], 0
            for _ in range(args.replicates):
                b, fin = replicate(rng, g, batch, args.steps, args.beta)
                finite += fin
                if b is not None:
                    reads.append(b / truth)
            q = np.quantile(reads, [0.25, 0.5, 0.75]) if reads else [float("nan")] * 3
            rows.append({"noise dims": dims, "batch": batch, "parts": batch // PART,
                         "estimate defined": f"{len(reads)}/{args.replicates}", "median / truth": f"{q[1]:.2f}",
                         "IQR": f"{q[0]:.2f}-{q[2]:.2f}", "band finite": f"{finite}/{args.replicates}"})  # fmt: skip
            out[str(dims)][str(batch)] = round(float(q[1]), 3)
    print(f"true B_simple {truth:.0f} samples; {args.steps} steps, EMA beta {args.beta}, parts of {PART}")
    print(table(rows, ["noise dims", "batch", "parts", "estimate defined", "median / truth", "IQR", "band finite"]))
    print(json.dumps({"median_over_truth": out, "steps": args.steps, "replicates": args.replicates}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
