"""tools/gpu_clock_check.py (#45 item 6) on CPU: the clock's per-step price it compares with is
the clock's own, the model it times has the clock's size, and the dry run measures every phase
with megarl's real model, forward and train step (its numbers mean nothing on a CPU)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megarl.coordinator.clock import Clock  # noqa: E402
from tools.gpu_clock_check import (  # noqa: E402
    CLOCKS,
    DRY,
    GPU_MID,
    clock_decode_step_s,
    fit_line,
    parameters,
)


def test_the_timed_model_is_the_clocks_model() -> None:
    clock = Clock.load(CLOCKS, "gpu-mid")
    assert parameters(GPU_MID) == pytest.approx(clock.p["params"], rel=0.01)  # 1.544e9 vs 1.54e9
    assert GPU_MID.num_layers == clock.p["layers"] and GPU_MID.num_query_groups == clock.p["kv_heads"]
    assert GPU_MID.head_dim == clock.p["head_dim"] and GPU_MID.prompt == clock.p["prompt_tokens"]
    assert GPU_MID.response == pytest.approx(clock.mean_response(), abs=5)


def test_decode_step_price_is_the_engine_simulations() -> None:
    """One sequence of one token: the engine simulation charges its prefill and one decode step
    at the prompt's context — the step is what the script compares with."""
    clock = Clock.load(CLOCKS, "gpu-mid")
    p, hw = clock.p, clock.hw
    prefill = 2 * p["params"] * p["prompt_tokens"] / (hw["peak_flops"] * p["forward_mfu"])
    assert clock_decode_step_s(clock, 1, int(p["prompt_tokens"])) + prefill == pytest.approx(
        clock.engine_s([1]), rel=1e-12
    )
    # large batches leave the memory roof: compute-bound steps grow with n
    assert clock_decode_step_s(clock, 4096, 150) > 2 * clock_decode_step_s(clock, 1024, 150)


def test_fit_line() -> None:
    a, b = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert (a, b) == pytest.approx((1.0, 2.0))


def test_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    report = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "tools/gpu_clock_check.py", "--cpu-dry-run", "--repeats", "1",
                        "--report", str(report)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(report.read_text())
    assert out["model_params"] == parameters(DRY)
    assert [(d["n"], d["context"]) for d in out["decode"]] == [(n, c) for c in DRY.decode_contexts for n in DRY.batches]
    assert all(d["measured_s"] > 0 and d["clock_s"] > 0 for d in out["decode"])
    assert [b["batch"] for b in out["batches"]] == list(DRY.batches)
    assert all(b["logprob_s"] > 0 and b["train_s"] > 0 for b in out["batches"])
    assert all(math.isfinite(v) for v in out["fit"].values())
    assert r.stdout.count("MEASURED ") == len(out["decode"]) + len(out["batches"])


def test_no_cuda_exit() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "tools/gpu_clock_check.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 3 and "no CUDA device" in r.stdout
