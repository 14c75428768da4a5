"""A vLLM engine built from the trainer's engine folder is the model the trainer converted.

The trainer writes the engines' config.json and update manifest from the one adapter
(``LlamaQwen2Adapter.hf_config`` / ``hf_shapes``); the engines start on it and receive every
tensor by name. For a Llama 3.1-style model (llama3 RoPE scaling, attention and MLP biases,
fractional rope_theta) a real vLLM engine must then give transformers' log-probs: without
the scaling in config.json vLLM would build other RoPE frequencies, and without the biases
in the manifest the update would be refused. For Qwen3 (q/k norms, head_dim × heads ≠
hidden_size, tied embeddings) likewise.
"""

import json
import shutil
from pathlib import Path

import torch

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.config import ModelConfig
from megarl.engine.staging import MANIFEST
from megarl.fleet.fleet import Fleet
from tests.helpers import tiny_hf_model

LLAMA3 = dict(
    rope_theta=10.5,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    attention_bias=True,
    mlp_bias=True,
)
SEQS = [
    [1, 5 + i, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 3, 7, 11, 15, 19, 23, 27, 31] for i in range(3)
]


def _engine_vs_transformers(tmp_path: Path, hf: Path, adapter: LlamaQwen2Adapter) -> float:
    """max |Δ logprob| between transformers on ``hf`` and a real vLLM engine started on the
    adapter's engine folder (what components._write_engine_folder writes) and fed ``hf``'s
    tensors by name."""
    from transformers import AutoModelForCausalLM

    engine_dir = tmp_path / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tokens = torch.tensor(SEQS)
    with torch.no_grad():
        ref = model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]

    fleet = Fleet.start_local(
        engine_dir,
        num_engines=1,
        engine_tp=1,
        kv_cache_gb=0.25,
        log_dir=tmp_path / "logs",
        seed=0,
        request_timeout_s=120,
        start_timeout_s=300,
    )
    try:
        staged = fleet.staging_dir / "test" / "model.safetensors"  # engines read only their staging folder
        staged.parent.mkdir(exist_ok=True)
        shutil.copy(hf / "model.safetensors", staged)
        fleet.update_weights(1, [str(staged)])
        got = torch.tensor(fleet.logprobs(SEQS, temperature=1.0)[0])
    finally:
        fleet.shutdown()
    return (got - ref).abs().max().item()


def test_engine_from_adapter_config_matches_transformers(tmp_path: Path) -> None:
    hf = tiny_hf_model(tmp_path / "hf", vocab=64, seed=4, extra=LLAMA3, qk_gain=8.0)
    mcfg = model_config_from_hf(json.loads((hf / "config.json").read_text()), ModelConfig())
    assert (mcfg.rope_scaling, mcfg.rotary_base, mcfg.linear_bias) == ("llama3", 10.5, True)
    adapter = LlamaQwen2Adapter(mcfg)
    diff = _engine_vs_transformers(tmp_path, hf, adapter)
    written = json.loads((tmp_path / "hf_engine" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "llama3" and written["mlp_bias"] is True
    print(f"vLLM vs transformers, llama3 RoPE + biases, fp32: max |Δ logprob| = {diff:.2e}")
    assert diff < 1e-3, diff


def test_qwen3_engine_matches_transformers(tmp_path: Path) -> None:
    """Qwen3: vLLM must apply the synced q/k norms and build heads of the explicit head_dim
    (64 × 4 heads ≠ hidden 128) from the engine folder's config.json."""
    hf = tiny_hf_model(tmp_path / "hf", arch="qwen3", vocab=64, tie=True, seed=4, qk_gain=4.0)
    mcfg = model_config_from_hf(json.loads((hf / "config.json").read_text()), ModelConfig())
    adapter = LlamaQwen2Adapter(mcfg)
    assert "model.layers.0.self_attn.q_norm.weight" in adapter.hf_shapes()
    diff = _engine_vs_transformers(tmp_path, hf, adapter)
    written = json.loads((tmp_path / "hf_engine" / "config.json").read_text())
    assert (written["architectures"], written["head_dim"], written["tie_word_embeddings"]) == (
        ["Qwen3ForCausalLM"],
        64,
        True,
    )
    print(f"vLLM vs transformers, Qwen3 (q/k norms, head_dim 64 x 4 != 128), fp32: max |Δ logprob| = {diff:.2e}")
    assert diff < 1e-3, diff
