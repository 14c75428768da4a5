"""``megarl train`` from a Qwen3 HF folder (``model.init_from``): q/k norms, head_dim 64 × 4
heads ≠ hidden 128, tied embeddings, bf16 tensors. TP=2 trainer ranks and a real vLLM engine
built from the adapter's engine folder; the weight-sync probe (engine log-probs vs the
trainer's on the same tokens) must pass after every step's sync. The end-of-run export
(hf_final/) keeps the source's bf16: config.json and the safetensors agree."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megarl.checkpoint.hf_config import export_dtype
from megarl.config import ModelConfig, load_config
from megarl.data.prompts import load_prompts
from megarl.data.tokenizer import train_tokenizer
from megarl.metrics import read_metrics
from tests.helpers import ROOT, megarl_train, tiny_hf_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("qwen3")
    run, hf = base / "run", base / "hf"
    sets = [
        f"model.init_from={hf}",
        "train.steps=2",
        "train.eval_every=0",
        "warm_start.steps=0",
        "coordinator.enabled=false",
        "rollout.num_prompts=8",
        "rollout.samples_per_prompt=4",
        "parallel.micro_batch_size=16",
        "data.num_train=200",
        "data.num_val=8",
        "train.tensorboard=false",
        "weight_sync.integrity_every=1",  # the probe after every sync (the demo checks every 10th)
        f"train.run_dir={run}",
    ]
    # the run's tokenizer, trained beforehand as the run would (it reuses it): the model's
    # vocabulary is the tokenizer's, as in a real HF folder, so every sampled id decodes
    cfg = load_config(ROOT / "examples" / "grpo_cpu.yaml", sets)
    rows, _ = load_prompts(cfg.data, cfg.data.seed)
    tok = train_tokenizer([r.prompt + r.answer for r in rows[:5000]], run / "tokenizer")
    tiny_hf_model(hf, arch="qwen3", vocab=tok.vocab_size, tie=True, seed=3, dtype="bfloat16", qk_gain=4.0)
    proc = megarl_train("grpo_cpu.yaml", sets)
    (run / "stdout.log").write_text(proc.stdout + proc.stderr)
    return run


def test_two_steps_with_engine_parity(run_dir: Path) -> None:
    steps = [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    probes = [r["sync/integrity_max_abs_diff"] for r in steps]
    print(f"Qwen3 megarl train: sync/integrity_max_abs_diff per step = {probes}")
    assert all(p < 1e-3 for p in probes), probes  # weight_sync.integrity_tol
    engine_cfg = json.loads((run_dir / "hf_engine" / "config.json").read_text())
    assert (engine_cfg["architectures"], engine_cfg["head_dim"]) == (["Qwen3ForCausalLM"], 64)


def test_hf_final_keeps_the_source_dtype(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = run_dir / "hf_final"
    cfg = json.loads((hf / "config.json").read_text())
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        norms = [k for k in f.keys() if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert (cfg["model_type"], cfg["head_dim"], cfg["dtype"]) == ("qwen3", 64, "bfloat16")
    assert dtypes == {"BF16"}, dtypes
    assert len(norms) == 8
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    assert model.dtype == torch.bfloat16


def test_export_dtype_rule(tmp_path: Path) -> None:
    """Same rule as ``megarl convert megarl-to-hf --dtype auto``."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    assert export_dtype(ModelConfig(init_from=str(tmp_path))) == "float16"
    assert export_dtype(ModelConfig(init_from=str(tmp_path), dtype="bf16")) == "float16"
    assert export_dtype(ModelConfig(dtype="bf16")) == "bfloat16"  # was: fp32 tensors labelled bfloat16
    assert export_dtype(ModelConfig()) == "float32"
