"""``megarl convert`` with a Qwen3-MoE model: HF → checkpoint at EP=2 (the command re-launches
itself on two ranks, each holding half the experts) → HF at EP=1 gives the identical tensors,
and a config transformers rebuilds the same model from; a Mixtral model the same way (one
process: its other layouts are read back bitwise in tests/model/test_moe.py); MoE models megarl
would not reproduce, and expert splits that do not fit, are refused in one line before any work."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, convert_outcomes, tiny_hf_model

TOOL = ROOT / "tools/convert.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}


def _convert(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *argv], env=ENV, capture_output=True, text=True, timeout=300, cwd=str(cwd)
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("moe_convert")
    hf = tiny_hf_model(base / "hf", arch="qwen3_moe", seed=3, qk_gain=4.0)
    for argv in (
        ["hf-to-megarl", "--hf", str(hf), "--out", str(base / "ckpt"), "--ep", "2"],
        ["megarl-to-hf", "--ckpt", str(base / "ckpt"), "--out", str(base / "back")],
    ):
        proc = _convert(*argv, cwd=base)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return base


def test_ep2_checkpoint_exports_identical_tensors(base: Path) -> None:
    a, b = load_file(str(base / "hf/model.safetensors")), load_file(str(base / "back/model.safetensors"))
    assert set(a) == set(b) and "model.layers.3.mlp.experts.3.down_proj.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_exported_config_rebuilds_the_same_model(base: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = json.loads((base / "back/config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["moe_intermediate_size"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"]) == (64, 2, True)
    tokens = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in ("hf", "back"):
        model = AutoModelForCausalLM.from_pretrained(str(base / folder), dtype=torch.float32)
        assert model.config.num_experts == 4 and model.config.head_dim == 32
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_mixtral_round_trips_bitwise_through_convert(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_model(tmp_path / "hf", arch="mixtral", seed=3, qk_gain=4.0)
    got, _ = convert_outcomes(
        {
            "import": ["hf-to-megarl", "--hf", str(hf), "--out", str(tmp_path / "ckpt")],
            "export": ["megarl-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")],
        }
    )
    assert got == {"import": "exit 0", "export": "exit 0"}, got
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back/model.safetensors"))
    assert set(a) == set(b) and "model.layers.3.block_sparse_moe.experts.3.w2.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = json.loads((tmp_path / "back/config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["intermediate_size"], cfg["num_experts_per_tok"]) == (4, 64, 2)
    assert cfg["sliding_window"] is None
    tokens = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (hf, tmp_path / "back"):
        with torch.no_grad():
            logits.append(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_unsupported_moe_models_and_splits_are_refused_before_any_work(tmp_path: Path) -> None:
    good = tiny_hf_model(tmp_path / "good", arch="qwen3_moe", seed=1)
    mixtral = tiny_hf_model(tmp_path / "mixtral", arch="mixtral", seed=1)
    dense = tiny_hf_model(tmp_path / "dense", arch="qwen3", seed=1)
    cases = {  # case -> (config.json changes, extra flags, the text the one line names)
        "sparse_step": ({"decoder_sparse_step": 2}, [], "decoder_sparse_step=2"),
        "shared_experts": ({"shared_expert_intermediate_size": 64}, [], "shared_expert_intermediate_size=64"),
        "group_limited": ({"n_group": 2, "topk_group": 1}, [], "n_group=2"),
        "ep_3": ({}, ["--ep", "3"], "--ep=3 does not divide num_experts=4"),
        "tp_3": ({}, ["--tp", "3"], "--tp=3 does not divide num_attention_heads=4"),
        "mixtral_window": ({"sliding_window": 4096}, [], "sliding_window=4096: megarl attends over the full context"),
        "mixtral_ep_3": ({}, ["--ep", "3"], "--ep=3 does not divide num_local_experts=4"),
    }
    argvs = {}
    for case, (changes, flags, _) in cases.items():
        d = tmp_path / case
        shutil.copytree(mixtral if case.startswith("mixtral") else good, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        argvs[case] = ["hf-to-megarl", "--hf", str(d), "--out", str(d) + "_ckpt", *flags]
    argvs["dense_ep"] = ["hf-to-megarl", "--hf", str(dense), "--out", str(dense) + "_ckpt", "--ep", "2"]
    got, megatron_imported = convert_outcomes(argvs)
    assert megatron_imported is False  # refused before megatron (or torchrun) started
    expected = {case: needle for case, (_, _, needle) in cases.items()}
    expected["dense_ep"] = "--ep=2 needs a mixture-of-experts model"
    for case, needle in expected.items():
        assert needle in got[case] and "\n" not in got[case], (case, got[case])
        assert not Path(argvs[case][4]).exists(), case
