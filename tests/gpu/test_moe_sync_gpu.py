"""The MoE weight sync into a real GPU vLLM engine (skipped without CUDA): the same sequence as
tests/weight_sync/test_moe_engine.py on CPU, where vLLM picks a GPU fused-MoE backend (Triton
for fp32) and ``megarl.engine.experts`` converts the experts with that backend's conversion.
After a first update and a second with changed weights the engine's log-probs equal
transformers' (fp32; the tolerance allows TF32 GEMMs), and the coverage check refuses a
missing expert, an unknown tensor and an unwritten parameter. vLLM's own reload is measured
and printed, not asserted: its CPU-only corruption (the skipped pre-pack) need not exist here.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.weight_sync.test_moe_engine import run_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_moe_engine_sync_on_gpu(tmp_path: Path) -> None:
    r = run_script(tmp_path, "qwen3_moe", "auto")
    print(f"MoE GPU engine vs transformers, max |Δ logprob|: {json.dumps(r)}")
    assert r["models_differ"] > 0.1
    assert r["sync_a"] < 1e-2 and r["sync_b"] < 1e-2 and r["resync_b"] < 1e-2, r
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in r["missing_expert"]
    assert "['model.layers.0.mlp.experts.gate_up_proj']" in r["unknown"]
    assert "not written: ['model.layers.1.post_attention_layernorm.weight']" in r["missing_dense"]
