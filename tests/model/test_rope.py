"""megarl's llama3 RoPE scaling against transformers' (the oracle) and megatron-core's own."""

from __future__ import annotations

import pytest
import torch

from megarl.model.rope import llama3_inv_freq

CASES = {
    # (rope_theta, head_dim, factor, low, high, original_max_position_embeddings)
    "llama-3.1-8b": (500000.0, 128, 8.0, 1.0, 4.0, 8192),
    "llama-3.2-1b": (500000.0, 64, 32.0, 1.0, 4.0, 8192),
    "tiny-test-model": (10.5, 32, 4.0, 1.0, 4.0, 16),
    "other-factors": (10000.0, 64, 6.0, 2.0, 8.0, 1024),
}


def _base(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@pytest.mark.parametrize("case", CASES)
def test_llama3_inv_freq_matches_transformers(case: str) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, dim, factor, low, high, orig = CASES[case]
    cfg = LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        max_position_embeddings=4 * orig,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        },
    )
    expected, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = llama3_inv_freq(
        _base(theta, dim),
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=orig,
    )
    assert scale == 1.0
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # the case is not trivial: some frequencies are scaled, some interpolated
    assert (got < _base(theta, dim) * 0.999).any()


def test_megatron_builtin_scaling_only_fits_the_default_factors() -> None:
    """megatron's rope_scaling fixes low/high/original at 1/4/8192: equal there, wrong elsewhere
    (which is why megarl applies its own)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for case, same in (("llama-3.1-8b", True), ("tiny-test-model", False)):
        theta, dim, factor, low, high, orig = CASES[case]
        rot = RotaryEmbedding(
            dim, 1.0, rotary_base=theta, rope_scaling=True, rope_scaling_factor=factor, use_cpu_initialization=True
        )
        ours = llama3_inv_freq(
            _base(theta, dim),
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=orig,
        )
        assert torch.allclose(rot.inv_freq, ours, rtol=1e-6, atol=0) is same, case
