"""HF ⇄ megarl conversion (tools/convert.py): HF → checkpoint at TP=2 × PP=2 → HF gives the
identical tensors; the Megatron model built from the checkpoint matches transformers (the
independent oracle) on the same tokens; the round-tripped folder loads with transformers.
Llama with untied embeddings and a vocabulary that needs TP padding; Qwen2 with tied
embeddings and QKV bias; a Llama 3.1-style model (llama3 RoPE scaling, attention and MLP
biases, fractional rope_theta, bf16, which comes back bf16); Qwen3 (q/k norms, head_dim ×
heads ≠ hidden_size, tied embeddings). The command line re-launches
itself under torchrun. HF models megarl would not reproduce are refused before any work."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from megarl.checkpoint.dist_ckpt import checkpoint_model_config
from tests.helpers import ROOT, convert_outcomes, tiny_hf_model, torchrun

WORKER = ROOT / "tests/checkpoint/worker_convert.py"
TOOL = ROOT / "tools/convert.py"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # < the 24 test positions: scaling acts
}
# Llama 3.1-style: llama3 RoPE scaling, attention + MLP biases, a fractional rope_theta, bf16
# tensors; q/k are sharpened so that position visibly changes the logits.
LLAMA3 = dict(rope_theta=10.5, rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True)
ARCHS = {
    "llama": dict(arch="llama", vocab=100, tie=False),
    "qwen2": dict(arch="qwen2", vocab=61, tie=True),
    "llama3": dict(arch="llama", vocab=100, tie=False, extra=LLAMA3, dtype="bfloat16", qk_gain=8.0),
    # Qwen3: per-head q/k RMSNorm before RoPE, head_dim 64 × 4 heads ≠ hidden 128, tied embeddings
    "qwen3": dict(arch="qwen3", vocab=61, tie=True, qk_gain=4.0),
}
TOKENIZER_BYTES = b"not a real sentencepiece model, copied verbatim"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("convert")
    for name, kw in ARCHS.items():
        hf = tiny_hf_model(base / name / "hf", seed=4, **kw)
        (hf / "tokenizer.model").write_bytes(TOKENIZER_BYTES)
    torchrun(WORKER, 4, ["--base", str(base), "--archs", *ARCHS])
    # the command line, outside torchrun: TP=2 import (re-launches itself), TP=1 export
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    q = base / "qwen2"
    for argv in (
        ["hf-to-megarl", "--hf", str(q / "hf"), "--out", str(q / "cli_ckpt"), "--tp", "2"],
        ["megarl-to-hf", "--ckpt", str(q / "cli_ckpt"), "--out", str(q / "cli_hf")],
    ):
        proc = subprocess.run(
            [sys.executable, str(TOOL), *argv], env=env, capture_output=True, text=True, timeout=300, cwd=str(base)
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return base


def _same_tensors(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _hf_logprobs(hf_dir: Path, tokens: torch.Tensor, **config_changes: Any) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(hf_dir))
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if config_changes.get("zero_biases") and name.endswith("bias"):
                p.zero_()
            if config_changes.get("unit_qk_norms") and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    with torch.no_grad():
        logits = model(tokens).logits
    return logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_gives_identical_tensors(base: Path, arch: str) -> None:
    _same_tensors(base / arch / "hf", base / arch / "hf_rt")
    names = set(load_file(str(base / arch / "hf_rt" / "model.safetensors")))
    assert ("lm_head.weight" in names) is (not ARCHS[arch]["tie"])
    assert any(n.endswith("q_proj.bias") for n in names) is (arch in ("qwen2", "llama3"))
    for bias in ("o_proj.bias", "gate_proj.bias", "up_proj.bias", "down_proj.bias"):
        assert sum(n.endswith(bias) for n in names) == (4 if arch == "llama3" else 0), bias
    for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        assert sum(n.endswith(norm) for n in names) == (4 if arch == "qwen3" else 0), norm


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_tp2pp2_matches_transformers(base: Path, arch: str) -> None:
    got = load_file(str(base / arch / "megatron_logprobs.safetensors"))
    ref = _hf_logprobs(base / arch / "hf", got["tokens"])
    diff = (got["logprobs"][:, :-1] - ref).abs().max().item()
    print(f"{arch}: Megatron TP2 PP2 vs transformers, max |Δ logprob| = {diff:.2e}")
    assert diff < 1e-4, diff


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_folder_loads_with_transformers(base: Path, arch: str) -> None:
    rt, src = base / arch / "hf_rt", base / arch / "hf"
    tokens = load_file(str(base / arch / "megatron_logprobs.safetensors"))["tokens"]
    assert torch.equal(_hf_logprobs(rt, tokens), _hf_logprobs(src, tokens))
    a, b = json.loads((src / "config.json").read_text()), json.loads((rt / "config.json").read_text())
    for key in (
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "dtype",
    ):
        assert a.get(key) == b.get(key), key
    assert json.loads((rt / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (rt / "tokenizer.model").read_bytes() == TOKENIZER_BYTES


def test_llama3_features_each_change_the_logits(base: Path) -> None:
    """The 1e-4 agreement above would fail without any one feature: dropping the llama3
    scaling, truncating rope_theta to an int or dropping the biases moves transformers'
    own log-probs far more (what the converter used to build)."""
    got = load_file(str(base / "llama3" / "megatron_logprobs.safetensors"))
    hf = base / "llama3" / "hf"
    rope = {**LLAMA3_ROPE, "rope_theta": 10.5}
    for change in (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10.5}},
        {"rope_parameters": {**rope, "rope_theta": 10.0}},
        {"zero_biases": True},
    ):
        diff = (got["logprobs"][:, :-1] - _hf_logprobs(hf, got["tokens"], **change)).abs().max().item()
        print(f"llama3 Megatron vs transformers with {change}: max |Δ logprob| = {diff:.3f}")
        assert diff > 1e-3, (change, diff)  # 10× the agreement tolerance


def test_qwen3_qk_norms_change_the_logits(base: Path) -> None:
    """Qwen3's 1e-4 agreement would fail had the q/k norm weights not been carried over (unit
    weights, megatron's init) or had the norms been left out (what a Llama build would do)."""
    got = load_file(str(base / "qwen3" / "megatron_logprobs.safetensors"))
    diff = got["logprobs"][:, :-1] - _hf_logprobs(base / "qwen3" / "hf", got["tokens"], unit_qk_norms=True)
    print(f"qwen3 Megatron vs transformers with unit q/k norms: max |Δ logprob| = {diff.abs().max().item():.3f}")
    assert diff.abs().max().item() > 1e-3
    mcfg = checkpoint_model_config(base / "qwen3" / "ckpt")
    assert (mcfg.arch, mcfg.head_dim, mcfg.kv_channels, mcfg.hidden_size) == ("qwen3", 64, 64, 128)


def test_converted_checkpoint_format(base: Path) -> None:
    root = base / "llama" / "ckpt"
    assert (root / "latest").read_text() == "hf_import"
    meta = json.loads((root / "hf_import" / "meta.json").read_text())
    assert meta["layout"] == {"world_size": 4, "tp": 2, "pp": 2, "dp": 1}
    assert meta["models"]["actor"]["has_optimizer"] is False
    assert meta["models"]["actor"]["padded_vocab"] == 112  # 100 padded to a multiple of 8 × TP
    for f in ("hf_config.json", "generation_config.json", "tokenizer.model", "COMPLETE"):
        assert (root / "hf_import" / f).is_file(), f


def test_command_line_with_relaunch_and_resharding(base: Path) -> None:
    q = base / "qwen2"
    meta = json.loads((q / "cli_ckpt" / "hf_import" / "meta.json").read_text())
    assert meta["layout"]["tp"] == 2  # written by 2 torchrun ranks
    _same_tensors(q / "hf", q / "cli_hf")  # read back at TP=1 in one process
    assert (q / "cli_hf" / "tokenizer.model").read_bytes() == TOKENIZER_BYTES


# --------------------------------------------------------------------------- refusals

REFUSED = {
    # case -> (config.json changes, the one line that must name key and value)
    "yarn": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        "rope_parameters.rope_type='yarn'",
    ),
    "dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'"),
    "linear": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='linear'"),
    "gelu": ({"hidden_act": "gelu"}, "unsupported HF config hidden_act='gelu'"),
    "attention_bias_only": ({"attention_bias": True}, "unsupported HF config attention_bias=True"),
    "llama3_extra_key": ({"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4, "beta_fast": 32}}, "beta_fast=32"),
    "biases_missing": (
        {"attention_bias": True, "mlp_bias": True},
        "tensor 'model.layers.0.mlp.down_proj.bias' [128] is missing",
    ),
    "extra_tensor": ({}, "tensor 'model.layers.0.self_attn.q_norm.weight' [32] is not part of the model"),
}

def test_unsupported_models_are_refused_before_any_work(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    good = tiny_hf_model(tmp_path / "good", vocab=61, seed=1)
    dirs = {}
    for case, (changes, _) in REFUSED.items():
        d = tmp_path / case
        shutil.copytree(good, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[case] = str(d)
    save_file(
        {"model.layers.0.self_attn.q_norm.weight": torch.ones(32)}, str(tmp_path / "extra_tensor" / "more.safetensors")
    )
    got, megatron_imported = convert_outcomes(
        {case: ["hf-to-megarl", "--hf", hf, "--out", hf + "_ckpt", "--tp", "2"] for case, hf in dirs.items()}
    )
    assert megatron_imported is False  # refused before megatron (or torchrun) started
    for case, (_, needle) in REFUSED.items():
        line = got[case]
        assert needle in line and "\n" not in line and line.startswith(str(tmp_path / case / "config.json")), (
            case,
            line,
        )
        assert not (tmp_path / f"{case}_ckpt").exists(), case
    # the command line: exit status 2 and the same single line on stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    cli = subprocess.run(
        [sys.executable, str(TOOL), "hf-to-megarl", "--hf", dirs["gelu"], "--out", str(tmp_path / "o"), "--tp", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stderr.strip() == f"megarl: convert error: {got['gelu']}", cli.stderr
