"""Transformer Engine's grouped GEMM for the experts (``model.moe_grouped_gemm``, GPU only): a
locally made Qwen3-MoE loaded into TE's spec with and without it gives the same logits, both
equal to transformers' (fp32; the tolerance allows TF32 GEMMs), and its weights read back
bitwise — the two naming forms (``linear_fc1.weight{i}`` and ``local_experts.{i}``) convert alike.
On CPU the option is refused by name (it needs ``transformer_impl=transformer_engine``)."""

from pathlib import Path

import pytest
import torch

from megarl.config import ConfigError, load_config, validate
from tests.helpers import tiny_hf_model


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.moe_grouped_gemm=true"], "model.moe_grouped_gemm=True needs a MoE model"),
        (
            ["model.arch=qwen3_moe", "model.num_experts=4", "model.hidden_size=128", "model.moe_grouped_gemm=true"],
            "model.moe_grouped_gemm=True needs model.transformer_impl=transformer_engine",
        ),
    ],
)
def test_grouped_gemm_refused_without_its_requirements(sets: list[str], message: str) -> None:
    cfg = load_config(None, sets)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_matches_sequential_experts_and_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformer_engine")
    import dataclasses

    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
    from megarl.checkpoint.hf_io import hf_state_dict, load_hf_tensors, read_hf_folder
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt

    hf_dir = tiny_hf_model(tmp_path / "hf", arch="qwen3_moe")
    hf_cfg, hf = read_hf_folder(hf_dir)
    base = dataclasses.replace(model_config_from_hf(hf_cfg, ModelConfig()), transformer_impl="transformer_engine")
    dims = init_distributed(1, 1, seed=0)
    tokens = torch.randint(3, base.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for grouped in (False, True):
        mcfg = dataclasses.replace(base, moe_grouped_gemm=grouped)
        model = build_gpt(mcfg, ParallelConfig(), dims, trainable=False)
        names = [n for n, _ in model.core.named_parameters()]
        assert any(("linear_fc1.weight0" in n) == grouped for n in names if ".experts." in n)
        load_hf_tensors(model, LlamaQwen2Adapter(mcfg), hf)
        back = hf_state_dict(model, LlamaQwen2Adapter(mcfg))
        assert all(torch.equal(back[k].cpu(), hf[k]) for k in hf)
        model.module.eval()
        with torch.no_grad():
            t = tokens.to(dims.device)
            logits[grouped] = model.core(t, torch.arange(16, device=dims.device).expand_as(t), None)[..., : base.vocab_size]
    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        want = ref(tokens).logits
    print(f"grouped vs sequential {(logits[True] - logits[False]).abs().max().item():.2e}, "
          f"grouped vs transformers {(logits[True].cpu() - want).abs().max().item():.2e}")  # fmt: skip
    assert (logits[True] - logits[False]).abs().max().item() < 1e-3
    assert (logits[True].cpu() - want).abs().max().item() < 1e-2
