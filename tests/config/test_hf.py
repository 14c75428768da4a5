"""Reading HF config.json into a ModelConfig: every key that changes the forward pass is mapped
or refused by name (pure; the end-to-end checks are in tests/checkpoint/test_convert.py)."""

import re

import pytest

from megarl.config import ModelConfig
from megarl.config.hf import UnsupportedHFModel, model_config_from_hf

# Llama-3.1-8B's config.json as published (transformers 4 layout: rope_theta + rope_scaling)
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


def test_llama31_config_maps_every_rope_number() -> None:
    m = model_config_from_hf(LLAMA31, ModelConfig())
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert (m.rope_original_max_position_embeddings, m.rotary_base, m.num_query_groups) == (8192, 500000.0, 8)
    assert m.linear_bias is False


def test_transformers5_rope_parameters_and_fractional_theta() -> None:
    cfg = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta")}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.6}
    m = model_config_from_hf(cfg, ModelConfig())
    assert (m.rope_scaling, m.rotary_base) == ("none", 12345.6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method='awq'"),
        ({"mlp_bias": True}, "mlp_bias=True: megatron's add_bias_linear"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor=None"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"model_type": "qwen2", "head_dim": 64}, "head_dim=64: vLLM's Qwen2 uses hidden_size"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True: megarl builds Qwen3 without"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types[1]='sliding_attention'"),
    ],
)
def test_refusals_name_key_and_value(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedHFModel, match="unsupported HF config " + re.escape(message)):
        model_config_from_hf({**LLAMA31, **change}, ModelConfig())


# Qwen3-0.6B's config.json as published: head_dim 128 × 16 heads ≠ hidden_size 1024
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_06b_config_maps_head_dim_and_tied_embeddings() -> None:
    m = model_config_from_hf(QWEN3_06B, ModelConfig())
    assert (m.arch, m.head_dim, m.kv_channels, m.hidden_size, m.num_attention_heads) == ("qwen3", 128, 128, 1024, 16)
    assert (m.tie_embeddings, m.norm_eps, m.rotary_base, m.linear_bias) == (True, 1e-6, 1e6, False)
    # a head_dim that equals hidden_size / heads stays implicit
    assert model_config_from_hf({**QWEN3_06B, "head_dim": 64}, ModelConfig()).kv_channels == 0


def test_qwen2_sliding_window_is_refused() -> None:
    qwen = {**LLAMA31, "model_type": "qwen2", "use_sliding_window": True, "rope_scaling": None}
    with pytest.raises(UnsupportedHFModel, match="use_sliding_window=True"):
        model_config_from_hf(qwen, ModelConfig())
