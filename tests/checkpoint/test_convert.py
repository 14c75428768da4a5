"""HF ⇄ megarl conversion (tools/convert.py): HF → checkpoint at TP=2 × PP=2 → HF gives the
identical tensors; the Megatron model built from the checkpoint matches transformers (the
independent oracle) on the same tokens; the round-tripped folder loads with transformers.
Llama with untied embeddings and a vocabulary that needs TP padding; Qwen2 with tied
embeddings and QKV bias. The command line re-launches itself under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/checkpoint/worker_convert.py"
TOOL = ROOT / "tools/convert.py"
ARCHS = {"llama": dict(arch="llama", vocab=100, tie=False), "qwen2": dict(arch="qwen2", vocab=61, tie=True)}
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


def _hf_logprobs(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits
    return logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_gives_identical_tensors(base: Path, arch: str) -> None:
    _same_tensors(base / arch / "hf", base / arch / "hf_rt")
    names = set(load_file(str(base / arch / "hf_rt" / "model.safetensors")))
    assert ("lm_head.weight" in names) is (not ARCHS[arch]["tie"])
    assert any(n.endswith("q_proj.bias") for n in names) is (arch == "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_tp2pp2_matches_transformers(base: Path, arch: str) -> None:
    got = load_file(str(base / arch / "megatron_logprobs.safetensors"))
    ref = _hf_logprobs(base / arch / "hf", got["tokens"])
    diff = (got["logprobs"][:, :-1] - ref).abs().max().item()
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
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert a.get(key) == b.get(key), key
    assert json.loads((rt / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (rt / "tokenizer.model").read_bytes() == TOKENIZER_BYTES


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
