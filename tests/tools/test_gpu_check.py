"""tools/gpu_check.py on CPU: the no-CUDA exit, and the dry run of every check (real megatron,
real megarl update path, a real CPU fp32 reference child process) passing with numbers.

The bf16 dry run drives megatron's bf16 training path (bf16 params, fp32 main params) on CPU
against the fp32 reference, so the parity check has to see (small, nonzero) differences, and
it runs with a budget no run can meet, so the FAIL → exit 1 path is exercised too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.gpu_check import EXIT_FAIL, EXIT_NO_CUDA, TOL, TOL_FP32  # noqa: E402


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, "tools/gpu_check.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _results(path: Path) -> dict[str, dict]:
    return {r["check"]: r for r in json.loads(path.read_text())["results"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_exits_3_with_a_clear_message() -> None:
    proc = _run()
    assert proc.returncode == EXIT_NO_CUDA
    assert "no CUDA device" in proc.stdout and "--cpu-dry-run" in proc.stdout


def _common(res: dict[str, dict], tol: dict[str, float]) -> None:
    assert res["pytest-gpu"]["status"] == "PASS"
    par = res["actor-parity"]
    assert par["status"] == "PASS", par["summary"]
    assert par["logprob_max"] <= tol["logprob_max"] and par["main_param_max"] <= tol["main_param_max"]
    assert par["update_cos"] >= tol["update_cos"] and par["grad_norm_ref"] > 0.1
    assert res["process-groups"]["status"] == "PASS" and res["process-groups"]["backend"] == "gloo"
    assert res["cpu-tensor-collectives"]["status"] == "PASS" and res["cpu-tensor-collectives"]["errors"] == {}
    loop = res["grpo-loop"]
    assert loop["status"] == "PASS", loop["summary"]
    assert len(loop["loss"]) == 5 and loop["loss"][-1] < loop["loss"][0] - 0.05
    assert loop["objective_after"] > loop["objective_before"]
    assert loop["probe_mb"] == [2] * 5 and loop["median_step_s"] > 0
    for name in ("cuda-ipc-wire", "transformer-engine", "vllm-paths"):
        assert res[name]["status"] == "NOT RUNNABLE"
        assert res[name]["summary"].startswith("not runnable on this device: ")


def test_cpu_dry_run_fp32_passes_with_numbers(tmp_path: Path) -> None:
    proc = _run("--cpu-dry-run", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all runnable checks passed" in proc.stdout
    res = _results(tmp_path / "r.json")
    _common(res, TOL_FP32)
    assert res["budget"]["status"] == "PASS"


def test_cpu_dry_run_bf16_sees_bf16_differences_and_a_failed_check_exits_1(tmp_path: Path) -> None:
    proc = _run("--cpu-dry-run", "--dry-run-dtype", "bf16", "--budget-s", "0.5", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == EXIT_FAIL, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED: budget" in proc.stdout
    res = _results(tmp_path / "r.json")
    _common(res, TOL)
    par = res["actor-parity"]
    assert par["dtype"] == "bf16 on cpu vs fp32 on cpu"
    # bf16 rounding is visible (an fp32 run would give exactly 0) but far inside the tolerance
    assert 1e-4 < par["logprob_max"] < TOL["logprob_max"] / 5
    assert 0 < par["main_param_max"] < 1e-3 and par["update_cos"] > 0.999
    assert res["budget"]["status"] == "FAIL"
