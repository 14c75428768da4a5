"""``algo.router_replay: rollout`` on a GPU (skipped without CUDA and a CUDA vLLM): a real vLLM
engine returns each sample's routes (its V2 model runner), they travel the reply frame and the
batch packing, and the trainer's old-log-prob forward sends every routed token to exactly the
engine's experts (``routes_engine_script.py``, one subprocess). Written for the GPU; not yet run
on one (this project's lent GPUs carry no vLLM)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("routes_engine_script.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the gpu extra)"),
]


def test_replayed_experts_equal_the_engines(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"engine routes replayed in the trainer: {r}")
    assert r["rows_ok"] and r["routed_tokens"] > 0
    assert r["replayed_equal"]
    assert set(r["engine_vs_old"]) == {
        "moe/engine_route_mismatch",
        *(f"moe/engine_route_mismatch/layer{i}" for i in range(4)),
    }
    assert r["engine_vs_old"]["moe/engine_route_mismatch"] < 0.05  # fp32 both sides: near-ties only
