"""RoPE frequency scaling that megatron-core does not parameterise fully.

megatron-core 0.16.1's ``RotaryEmbedding(rope_scaling=True)`` applies Llama 3.x scaling with
only ``factor`` configurable: low/high frequency factors and the original context length are
fixed at 1, 4 and 8192. Every released Llama 3.1/3.2 uses those values, but a model that
does not would silently get other frequencies. So megarl builds the GPTModel unscaled and
replaces its ``inv_freq`` with :func:`llama3_inv_freq` of the HF config's own four numbers.

Formula (Meta's Llama 3.1 reference ``apply_scaling``; transformers
``modeling_rope_utils._compute_llama3_parameters``), with wavelength ``λ = 2π / f``,
``L = original_max_position_embeddings``, ``s = factor``:

* ``λ < L / high_freq_factor``: high frequency, kept: ``f``;
* ``λ > L / low_freq_factor``: low frequency, scaled: ``f / s``;
* otherwise interpolated: ``(1 - a) f / s + a f`` with
  ``a = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megarl.config import ModelConfig


def llama3_inv_freq(
    inv_freq: torch.Tensor,  # (dim/2,) unscaled RoPE inverse frequencies, rad/token
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:  # (dim/2,) scaled inverse frequencies, same dtype
    """Llama 3.x RoPE scaling of ``inv_freq`` (see the module docstring)."""
    old_len = float(original_max_position_embeddings)
    low_wavelen = old_len / low_freq_factor
    high_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope_scaling(gpt: Any, mcfg: ModelConfig) -> None:
    """Scale the frequencies of a freshly built GPTModel's RoPE as ``mcfg`` says (in place)."""
    gpt.megarl_rope_scaling = rope_scaling_fields(mcfg)  # read back by checkpoint metadata
    if mcfg.rope_scaling == "none":
        return
    rot = gpt.rotary_pos_emb
    rot.inv_freq = llama3_inv_freq(
        rot.inv_freq,
        factor=mcfg.rope_scaling_factor,
        low_freq_factor=mcfg.rope_low_freq_factor,
        high_freq_factor=mcfg.rope_high_freq_factor,
        original_max_position_embeddings=mcfg.rope_original_max_position_embeddings,
    )


def rope_scaling_fields(mcfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig fields that define RoPE scaling (only ``rope_scaling`` when it is none)."""
    if mcfg.rope_scaling == "none":
        return {"rope_scaling": "none"}
    return {
        "rope_scaling": mcfg.rope_scaling,
        "rope_scaling_factor": float(mcfg.rope_scaling_factor),
        "rope_low_freq_factor": float(mcfg.rope_low_freq_factor),
        "rope_high_freq_factor": float(mcfg.rope_high_freq_factor),
        "rope_original_max_position_embeddings": int(mcfg.rope_original_max_position_embeddings),
    }
