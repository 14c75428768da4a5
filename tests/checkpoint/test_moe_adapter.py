"""The MoE part of the Megatron ⇄ HF mapping (Qwen3-MoE and Mixtral names), by name and layout
alone (no process groups): both megatron expert naming forms (``SequentialMLP``'s
``local_experts.{i}``, TE's grouped ``linear_fc1.weight{i}``) at TP 1 and 2 take HF tensors apart
and put them back bitwise; EP ranks' local expert indices map to global ones and back. The
numbers against transformers are in tests/model/test_moe.py."""

import dataclasses

import pytest
import torch

from megarl.checkpoint.experts import is_expert, to_global, to_local
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter
from megarl.config import ModelConfig

MOE = ModelConfig(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    num_query_groups=1,
    kv_channels=8,
    ffn_hidden_size=24,
    num_experts=4,
    moe_ffn_hidden_size=6,
    vocab_size=11,
)
# Mixtral: its experts are ffn_hidden_size wide
FAMILIES = {"qwen3_moe": MOE, "mixtral": dataclasses.replace(MOE, arch="mixtral", ffn_hidden_size=6)}
HF_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
HF_GATE_UP = {"qwen3_moe": ("gate_proj", "up_proj"), "mixtral": ("w1", "w3")}
FORMS = {
    "sequential": lambda g, fc: f"mlp.experts.local_experts.{g}.linear_fc{fc}.weight",
    "grouped": lambda g, fc: f"mlp.experts.linear_fc{fc}.weight{g}",
}


def _megatron_shapes(m: ModelConfig, tp: int, form: str) -> dict[str, list[int]]:
    f, h = m.expert_ffn_hidden_size, m.hidden_size
    shapes = {}
    for layer in range(m.num_layers):
        p = f"decoder.layers.{layer}."
        shapes[p + "mlp.router.weight"] = [m.num_experts, h]
        for g in range(m.num_experts):
            shapes[p + FORMS[form](g, 1)] = [2 * f // tp, h]
            shapes[p + FORMS[form](g, 2)] = [h, f // tp]
    return shapes


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_tensors_round_trip_bitwise(family: str, form: str, tp: int) -> None:
    m = FAMILIES[family]
    adapter = LlamaQwen2Adapter(m)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in adapter.hf_shapes().items()}
    back: dict[str, torch.Tensor] = {}
    for name, shape in _megatron_shapes(m, tp, form).items():
        shards = [adapter.from_hf(name, hf, 0, tp, r, torch.Size(shape)) for r in range(tp)]
        dim = adapter.split_dim(name)
        full = shards[0] if dim is None else torch.cat(shards, dim=dim)
        back.update(adapter.to_hf(name, full, 0, tp))
    moe_names = {n for n in hf if f".{HF_BLOCK[family]}." in n}
    assert set(back) == moe_names and len(moe_names) == 2 * (1 + 4 * 3)
    for n in moe_names:
        assert torch.equal(back[n], hf[n]), n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fc1_shards_hold_gate_then_up_of_their_rows(family: str) -> None:
    """At TP 2 each rank's linear_fc1 is [gate rows of the shard; up rows of the shard]."""
    adapter = LlamaQwen2Adapter(FAMILIES[family])
    f = FAMILIES[family].expert_ffn_hidden_size
    gate = torch.arange(f * 16.0).reshape(f, 16)
    prefix = f"model.layers.1.{HF_BLOCK[family]}.experts.3."
    gate_name, up_name = (f"{prefix}{proj}.weight" for proj in HF_GATE_UP[family])
    hf = {gate_name: gate, up_name: -gate}
    name = "decoder.layers.1." + FORMS["sequential"](3, 1)
    shard = adapter.from_hf(name, hf, 0, 2, 1, torch.Size([f, 16]))
    assert torch.equal(shard, torch.cat([gate[f // 2 :], -gate[f // 2 :]]))
    assert [n for n, _ in adapter.to_hf(name, torch.cat([gate, -gate]), 0, 1)] == [gate_name, up_name]


def test_mixtral_names_are_its_checkpoints() -> None:
    """Router and w1/w3/w2 as MixtralForCausalLM.save_pretrained writes them (w2 = down)."""
    adapter = LlamaQwen2Adapter(FAMILIES["mixtral"])
    shapes = adapter.hf_shapes()
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == [4, 16]
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == [16, 6]
    assert not any(".mlp." in n or "_norm." in n for n in shapes)  # no dense MLP, no q/k norms
    w2 = torch.randn(16, 6)
    assert adapter.to_hf("decoder.layers.1.mlp.experts.linear_fc2.weight3", w2, 2, 1) == [
        ("model.layers.3.block_sparse_moe.experts.3.w2.weight", w2)
    ]


def test_local_and_global_expert_indices() -> None:
    for form in FORMS.values():
        local = "decoder.layers.5." + form(1, 2)
        assert is_expert(local)
        assert to_global(local, ep_rank=3, local_experts=2) == "decoder.layers.5." + form(7, 2)
        assert to_local(to_global(local, 3, 2), 3, 2) == local
    for other in ("decoder.layers.5.mlp.router.weight", "decoder.layers.5.mlp.linear_fc1.weight"):
        assert not is_expert(other) and to_global(other, 3, 2) == other


def test_hf_config_is_qwen3_moe() -> None:
    cfg = LlamaQwen2Adapter(MOE).hf_config(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    assert cfg.model_type == "qwen3_moe" and cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (4, 6, 2)
    assert cfg.norm_topk_prob is True and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    assert cfg.head_dim == 8


def test_hf_config_is_mixtral() -> None:
    cfg = LlamaQwen2Adapter(FAMILIES["mixtral"]).hf_config(eos_token_id=2, bos_token_id=1, pad_token_id=0)
    assert cfg.model_type == "mixtral" and cfg.architectures == ["MixtralForCausalLM"]
    assert (cfg.num_local_experts, cfg.intermediate_size, cfg.num_experts_per_tok) == (4, 6, 2)
    assert cfg.sliding_window is None and cfg.head_dim == 8
