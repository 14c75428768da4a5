"""A CPU engine's GEMM choice (``rollout.cpu_gemm``): packed oneDNN kernels (vLLM's default,
updated by its layer-wise reload) or plain ``F.linear`` on the parameters (updated by a copy
in place). Either way every update must reach every layer: a real vLLM engine, updated twice
with two different transformers models, gives each model's log-probs in turn — including a
tied LM head, which keeps a kernel built from the embedding when packed."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.config import ModelConfig
from megarl.engine.loading import loads_in_place
from megarl.engine.staging import MANIFEST
from megarl.engine.worker_ext import PLAIN_GEMM_MAX_HIDDEN, cpu_gemm_mode
from megarl.errors import EngineError
from megarl.fleet.fleet import Fleet
from tests.helpers import tiny_hf_model

SEQS = [[1, 5 + i, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 3, 7, 11, 15] for i in range(3)]


def test_cpu_gemm_mode_rule() -> None:
    assert cpu_gemm_mode("auto", PLAIN_GEMM_MAX_HIDDEN, on_cpu=True) == "plain"
    assert cpu_gemm_mode("auto", PLAIN_GEMM_MAX_HIDDEN + 1, on_cpu=True) == "packed"
    assert cpu_gemm_mode("plain", 4096, on_cpu=True) == "plain"
    assert cpu_gemm_mode("packed", 64, on_cpu=True) == "packed"
    assert cpu_gemm_mode("plain", 64, on_cpu=False) == "packed"  # GPU layers compute from their parameters
    with pytest.raises(EngineError, match="cpu_gemm 'onednn' unknown"):
        cpu_gemm_mode("onednn", 64, on_cpu=True)


def test_loads_in_place_only_when_no_layer_holds_a_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert loads_in_place(model)  # no CPU dispatch at all (a GPU model)
    for m in model:
        m.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
    assert loads_in_place(model)
    model[1].cpu_linear = lambda x, w, b: x  # type: ignore[assignment]  # a packed kernel
    assert not loads_in_place(model)


def _reference(hf: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tokens = torch.tensor(SEQS)
    with torch.no_grad():
        return model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize(("mode", "tp"), [("packed", 1), ("plain", 1), ("plain", 2)])
def test_successive_updates_reach_every_layer(tmp_path: Path, mode: str, tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: the engine's two vLLM worker processes build and update the model themselves, so
    the plain GEMM must reach them (``MEGARL_CPU_GEMM``), or they would reload layer-wise."""
    if tp > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core each (vLLM asks for NUMA nodes otherwise)
    models = [tiny_hf_model(tmp_path / f"hf{k}", arch="qwen3", vocab=64, tie=True, seed=k, qk_gain=4.0) for k in (1, 2)]
    refs = [_reference(hf) for hf in models]
    assert (refs[0] - refs[1]).abs().max() > 0.1  # the two models are told apart
    adapter = LlamaQwen2Adapter(model_config_from_hf(json.loads((models[0] / "config.json").read_text()), ModelConfig()))
    engine_dir = tmp_path / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))
    logs = tmp_path / "logs"
    fleet = Fleet.start_local(
        engine_dir, 1, tp, 0.25, logs, seed=0, request_timeout_s=120, start_timeout_s=300, cpu_gemm=mode
    )
    diffs = []
    try:
        for version, (hf, ref) in enumerate(zip(models * 2, refs * 2), start=1):  # A, B, A, B
            staged = fleet.staging_dir / f"v{version}" / "model.safetensors"
            staged.parent.mkdir()
            shutil.copy(hf / "model.safetensors", staged)
            fleet.update_weights(version, [str(staged)])
            got = torch.tensor(fleet.logprobs(SEQS, temperature=1.0)[0])
            diffs.append((got - ref).abs().max().item())
    finally:
        fleet.shutdown()
    print(f"{mode}, engine TP {tp}: max |Δ logprob| after each update: {', '.join(f'{d:.1e}' for d in diffs)}")
    assert max(diffs) < 1e-3, diffs
    log = (logs / "engine0.log").read_text()
    assert f"CPU GEMM {mode}" in log  # the engine ran the mode asked for ...
    reloaded = "weight updates: vLLM's layer-wise reload" in log  # ... and updated the way that mode needs
    assert reloaded == (mode == "packed"), mode
