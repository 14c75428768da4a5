"""What megarl can represent of an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral checkpoint, decided
before any work starts.

A converter that drops what it does not understand builds a *different model* and exits 0.
So the HF ``config.json`` is read key by key: every key that changes the forward pass is
either mapped onto :class:`megarl.config.ModelConfig` or refused with
:class:`UnsupportedHFModel` naming the key and its value. Mapped: sizes, RMSNorm eps, tied
embeddings, ``rope_theta`` (kept fractional), ``rope_scaling`` / ``rope_parameters`` of type
``default`` or ``llama3`` (Llama 3.1/3.2), Llama ``attention_bias`` + ``mlp_bias`` when both
are set (megatron's ``add_bias_linear`` covers both at once), Qwen2's QKV bias, Qwen3's q/k
norms, an explicit ``head_dim`` with head_dim × heads ≠ hidden_size (``model.kv_channels``;
Llama and Qwen3). Refused: other RoPE types (``linear``, ``dynamic``, ``yarn``, ...), partial
rotary, activations other than SiLU, one of ``attention_bias`` / ``mlp_bias`` without the
other, Qwen3 ``attention_bias``, sliding-window layers, a Qwen2 ``head_dim`` that vLLM would
ignore, quantized checkpoints. Qwen3-MoE: ``num_experts`` (transformers 5 writes it as
``num_local_experts``), ``moe_intermediate_size``, ``num_experts_per_tok`` and ``norm_topk_prob``
are mapped; MoE in only some layers (``decoder_sparse_step`` ≠ 1, ``mlp_only_layers``), shared
experts, aux-free bias routing, group-limited routing, sigmoid scores and a routing scale are
refused (:func:`_moe`). Mixtral: the same routing (softmax over all experts, top-k, always
renormalised) with ``num_local_experts`` experts of width ``intermediate_size``; a
``sliding_window`` other than null is refused. Keys that only matter for training
regularisation or generation (dropout, Mixtral's ``router_jitter_noise``, ``use_cache``, token
ids) are not refused.

This is config's side because the config's own checks need it at load time
(:func:`resolved_model`: ``megarl.config.validate`` checks the model ``init_from`` describes,
before any process starts). The checkpoint's side, its tensors and dtype, is
:mod:`megarl.checkpoint.hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.config.rules import fail
from megarl.errors import UnsupportedHFModel

if TYPE_CHECKING:
    from megarl.config.model import ModelConfig

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ROPE_TYPE_KEYS = ("rope_type", "type")


def _refuse(key: str, value: Any, why: str) -> UnsupportedHFModel:
    return UnsupportedHFModel(f"unsupported HF config {key}={value!r}: {why}")


def _rope(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig RoPE fields from ``rope_theta`` + ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5)."""
    scaling = hf_cfg.get("rope_scaling") or {}
    params = hf_cfg.get("rope_parameters") or {}
    theta = hf_cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    key, spec = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    type_key = next((k for k in _ROPE_TYPE_KEYS if k in spec), "rope_type")
    kind = spec.get(type_key, "default")
    out: dict[str, Any] = {"rotary_base": float(theta), "rope_scaling": "none"}
    known = {*_ROPE_TYPE_KEYS, "rope_theta"}
    if kind == "llama3":
        known.update(_LLAMA3_KEYS)
        for k in _LLAMA3_KEYS:
            if spec.get(k) is None:
                raise _refuse(f"{key}.{k}", None, "llama3 RoPE scaling needs it")
        out.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(spec["factor"]),
            rope_low_freq_factor=float(spec["low_freq_factor"]),
            rope_high_freq_factor=float(spec["high_freq_factor"]),
            rope_original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        )
        if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
            raise _refuse(f"{key}.high_freq_factor", spec["high_freq_factor"], "must exceed low_freq_factor")
    elif kind != "default":
        raise _refuse(f"{key}.{type_key}", kind, "megarl reproduces RoPE types 'default' and 'llama3' only")
    for k, v in spec.items():
        if k == "partial_rotary_factor" and v == 1.0:
            continue
        if k not in known:
            raise _refuse(f"{key}.{k}", v, f"not part of RoPE type '{kind}' as megarl reproduces it")
    return out


def model_config_from_hf(hf_cfg: Mapping[str, Any], base: ModelConfig) -> ModelConfig:
    """Fill a ModelConfig from an HF config.json dict (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral), or refuse.

    Raises :class:`UnsupportedHFModel` naming the first key whose value megarl would not
    reproduce (see the module docstring).
    """
    if not isinstance(hf_cfg, Mapping):
        raise _refuse("(top level)", type(hf_cfg).__name__, "config.json must hold a JSON object")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "num_key_value_heads", "head_dim", "max_position_embeddings"):  # fmt: skip
        value = hf_cfg.get(key)
        if value is not None and not (type(value) is int and value > 0):
            raise _refuse(key, value, "must be a positive integer")
    eps = hf_cfg.get("rms_norm_eps")
    if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
        raise _refuse("rms_norm_eps", eps, "must be a positive number")
    arch = hf_cfg.get("model_type", "llama")
    if arch not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
        raise _refuse("model_type", arch, "supported: llama, qwen2, qwen3, qwen3_moe, mixtral")
    moe = _moe(hf_cfg, arch) if arch in ("qwen3_moe", "mixtral") else {}
    act = hf_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "megarl builds SwiGLU with SiLU only")
    if hf_cfg.get("quantization_config"):
        method = hf_cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "quantized weights are not supported")
    partial = hf_cfg.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _refuse("partial_rotary_factor", partial, "megarl rotates the whole head")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and hf_cfg.get("use_sliding_window"):
        raise _refuse("use_sliding_window", hf_cfg["use_sliding_window"], "megarl attends over the full context")
    if arch == "mixtral" and hf_cfg.get("sliding_window") is not None:  # Mixtral's window is on when set
        raise _refuse("sliding_window", hf_cfg["sliding_window"], "megarl attends over the full context")
    for i, kind in enumerate(hf_cfg.get("layer_types") or []):
        if kind != "full_attention":
            raise _refuse(f"layer_types[{i}]", kind, "megarl attends over the full context in every layer")
    if arch in ("qwen3", "qwen3_moe") and hf_cfg.get("attention_bias"):
        raise _refuse("attention_bias", hf_cfg["attention_bias"], "megarl builds Qwen3 without q/k/v/o biases")
    linear_bias = False
    if arch == "llama":
        attn_bias, mlp_bias = bool(hf_cfg.get("attention_bias", False)), bool(hf_cfg.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise _refuse(
                "attention_bias" if attn_bias else "mlp_bias",
                True,
                "megatron's add_bias_linear puts biases on the attention and MLP linears together; "
                "only attention_bias == mlp_bias can be represented",
            )
        linear_bias = attn_bias
    heads, hidden = hf_cfg["num_attention_heads"], hf_cfg["hidden_size"]
    head_dim = hf_cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden and arch == "qwen2":
        raise _refuse(
            "head_dim",
            head_dim,
            f"vLLM's Qwen2 uses hidden_size / num_attention_heads = {hidden} / {heads} instead; "
            "megarl would train another model than the engines run",
        )
    return dataclasses.replace(
        base,
        arch=arch,
        num_layers=hf_cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=hf_cfg.get("num_key_value_heads") or heads,
        kv_channels=0 if head_dim * heads == hidden else head_dim,
        ffn_hidden_size=hf_cfg["intermediate_size"],
        vocab_size=hf_cfg["vocab_size"],
        max_position_embeddings=hf_cfg.get("max_position_embeddings", base.max_position_embeddings),
        norm_eps=hf_cfg.get("rms_norm_eps", base.norm_eps),
        tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", False)),
        linear_bias=linear_bias,
        **_rope(hf_cfg),
        **moe,
    )


# MoE keys of other families (DeepSeek-V3, Qwen2-MoE, Mixtral-likes, GLM-4.5) with the value that
# means "not used": any other value changes the routing or adds experts megarl does not build
_MOE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "topk_method": (None, "greedy"),
    "scoring_func": (None, "softmax"),
    "routed_scaling_factor": (None, 1, 1.0),
    "moe_layer_freq": (None, 1),
    "first_k_dense_replace": (None, 0),
    "use_expert_bias": (None, False),
    "moe_router_enable_expert_bias": (None, False),
}


def _moe(hf_cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig MoE fields of a Qwen3-MoE or Mixtral config.json, or the first key megarl would
    not reproduce. A Mixtral expert is ``intermediate_size`` wide and its k weights are always
    renormalised (transformers' ``MixtralTopKRouter``; it has no ``norm_topk_prob``)."""
    for key, neutral in _MOE_NEUTRAL.items():
        if hf_cfg.get(key) not in neutral:
            raise _refuse(key, hf_cfg[key], "megarl builds top-k softmax routing over routed experts only")
    step = hf_cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise _refuse("decoder_sparse_step", step, "megarl builds a mixture of experts in every layer")
    if hf_cfg.get("mlp_only_layers"):
        raise _refuse("mlp_only_layers", hf_cfg["mlp_only_layers"], "megarl builds a mixture of experts in every layer")
    names = [k for k in ("num_experts", "num_local_experts") if k in hf_cfg]
    if not names:
        raise _refuse("num_experts", None, f"a {arch} config needs it (or num_local_experts)")
    if len(names) == 2 and hf_cfg["num_experts"] != hf_cfg["num_local_experts"]:
        raise _refuse(
            "num_local_experts", hf_cfg["num_local_experts"], f"differs from num_experts={hf_cfg['num_experts']}"
        )
    out: dict[str, Any] = {}
    for field, key in (
        ("num_experts", names[0]),
        ("moe_ffn_hidden_size", "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"),
        ("moe_router_topk", "num_experts_per_tok"),
    ):
        value = hf_cfg.get(key)
        if not (type(value) is int and value > 0):
            raise _refuse(key, value, "must be a positive integer")
        out[field] = value
    if out["moe_router_topk"] > out["num_experts"]:
        raise _refuse("num_experts_per_tok", out["moe_router_topk"], f"exceeds num_experts={out['num_experts']}")
    # Qwen3-MoE: transformers' default is False (Qwen3-30B-A3B's config.json sets true)
    return {**out, "moe_norm_topk_prob": arch == "mixtral" or bool(hf_cfg.get("norm_topk_prob", False))}


def resolved_model(m: ModelConfig) -> ModelConfig:
    """The model the run will build: ``m`` itself, or its shape from ``m.init_from``'s config.json
    (the folder checked first: it exists, holds a config.json and safetensors weights)."""
    if not m.init_from:
        return m
    _check_hf_folder(m.init_from)
    cfg_file = Path(m.init_from) / "config.json"
    try:
        hf_cfg = json.loads(cfg_file.read_text())
        return model_config_from_hf(hf_cfg, m)
    except json.JSONDecodeError as e:
        fail("model.init_from", m.init_from, f"{cfg_file} is not valid JSON ({e.msg}, line {e.lineno})")
    except (KeyError, ValueError) as e:  # AdapterError, UnsupportedHFModel: the key and value named
        reason = e.args[0] if len(e.args) == 1 else e
        if type(e) is KeyError:  # a key the model's shape needs is absent
            reason = f"missing key {reason!r}"
        fail("model.init_from", m.init_from, f"{cfg_file}: {reason}")


def _check_hf_folder(src: str) -> None:
    folder = Path(src)
    if not folder.is_dir():
        fail("model.init_from", src, "does not exist (expected an HF model folder)")
    if not (folder / "config.json").is_file():
        fail("model.init_from", src, "has no config.json: not an HF model folder")
    if not list(folder.glob("*.safetensors")):
        fail("model.init_from", src, "has no *.safetensors weights")
