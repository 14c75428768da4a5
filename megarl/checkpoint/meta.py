"""A checkpoint's small files and metadata: the per-model config and layout (``meta.json``),
whether a checkpoint's model config fits the model it is loaded into, the trainer's RNG state,
durable small writes (write + fsync), and pruning to ``train.keep_last``."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.integrity import CheckpointError, complete_checkpoints, resolve_checkpoint
from megarl.config import ModelConfig
from megarl.model.builder import Model

FORMAT_VERSION = 1
DTYPE_FIELD = "dtype"
"""The one model-config field that may differ at load time (values are cast)."""
_ADDED_FIELD_DEFAULTS: dict[str, Any] = {
    "linear_bias": False,
    "rope_scaling": "none",
    "num_experts": 0,
    "moe_ffn_hidden_size": 0,
    "moe_router_topk": 2,
    "moe_norm_topk_prob": True,
}
"""Model-config fields added after the first checkpoints: their values in older checkpoints."""

logger = logging.getLogger("megarl.checkpoint")


def model_config_dict(model: Model) -> dict[str, Any]:
    """The :class:`ModelConfig` fields that define ``model``'s parameters, read off the model.

    Stored in ``meta.json`` so a load can name the field that differs, and so tools can rebuild
    the model (``megarl-to-hf``) from the checkpoint alone. Collective over the PP group.
    """
    cfg, core = model.config, model.core
    experts = cfg.num_moe_experts or 0
    return {
        "arch": _arch(cfg),
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": int(getattr(core, "max_sequence_length", 0)),
        "rotary_base": float(getattr(core, "rotary_base", 0.0)),
        "norm_eps": float(cfg.layernorm_epsilon),
        "tie_embeddings": bool(getattr(core, "share_embeddings_and_output_weights", False)),
        "linear_bias": bool(cfg.add_bias_linear),
        # the router's function (not its coefficients or dtype: they change training, not the model)
        "num_experts": experts,
        "moe_ffn_hidden_size": int(cfg.moe_ffn_hidden_size or 0) if experts else 0,
        "moe_router_topk": int(cfg.moe_router_topk) if experts else 2,
        "moe_norm_topk_prob": not cfg.moe_router_pre_softmax if experts else True,
        **getattr(core, "megarl_rope_scaling", {"rope_scaling": "none"}),  # set by the builder
        "value_head": has_value_head(model),
        DTYPE_FIELD: "bf16" if cfg.bf16 else "fp32",
    }


def _arch(cfg: Any) -> str:
    # builder: add_qkv_bias == (arch == "qwen2"), qk_layernorm == (arch in qwen3, qwen3_moe),
    # routed experts only with qwen3_moe (q/k norms) and mixtral (llama attention)
    if cfg.add_qkv_bias:
        return "qwen2"
    if cfg.qk_layernorm:
        return "qwen3_moe" if cfg.num_moe_experts else "qwen3"
    return "mixtral" if cfg.num_moe_experts else "llama"


def checkpoint_model_config(ckpt_dir: str | Path, name: str = "actor") -> ModelConfig:
    """The :class:`ModelConfig` of model ``name`` in a checkpoint (to rebuild it elsewhere)."""
    path = resolve_checkpoint(ckpt_dir)
    saved = read_meta(path)["models"]
    if name not in saved:
        raise CheckpointError(f"checkpoint {path} has no model '{name}' (it holds: {', '.join(sorted(saved))})")
    fields = dict(saved[name]["model_config"])
    head_dim, value_head = fields.pop("head_dim"), fields.pop("value_head")
    if value_head:
        raise CheckpointError(f"checkpoint {path} model '{name}' has a value head: it is not a language model")
    mcfg = ModelConfig(**fields)
    if mcfg.head_dim != head_dim:  # head_dim × heads ≠ hidden_size (Qwen3): explicit kv_channels
        mcfg.kv_channels = head_dim
    return mcfg


# --------------------------------------------------------------------------- exact resume


def check_model_config(path: Path, mname: str, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise naming every model-config field that differs (dtype only logs: values are cast)."""
    # checkpoints (and callers' dicts) from before these fields existed meant their defaults
    saved, current = {**_ADDED_FIELD_DEFAULTS, **saved}, {**_ADDED_FIELD_DEFAULTS, **current}
    keys = sorted(set(saved) | set(current))
    diff = [k for k in keys if k != DTYPE_FIELD and saved.get(k) != current.get(k)]
    if diff:
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        now = ", ".join(f"{k}={current.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {path} model '{mname}' does not fit the model being loaded: saved with {was}; "
            f"the model has {now}"
        )
    if saved.get(DTYPE_FIELD) != current.get(DTYPE_FIELD):
        logger.info(
            "checkpoint %s model '%s': %s weights are cast to %s",
            path,
            mname,
            saved.get(DTYPE_FIELD),
            current.get(DTYPE_FIELD),
        )


def has_value_head(model: Model) -> bool:
    """A critic: the last stage's output layer is megarl's value head (collective over PP)."""
    from megarl.model.value_head import ValueHead

    flag = torch.tensor([int(isinstance(getattr(model.core, "output_layer", None), ValueHead))])
    if model.dims.pp > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=model.dims.pp_group)
    return bool(flag.item())


def read_meta(path: Path) -> dict[str, Any]:
    meta: dict[str, Any] = read_json(path, "meta.json")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format_version={meta.get('format_version')}, this megarl reads {FORMAT_VERSION}"
        )
    return meta


def read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        return dict(json.loads((path / name).read_text()))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {name} is unreadable ({type(e).__name__}: {e})") from e


def layout_of(dims: Any) -> dict[str, int]:
    ep = {"ep": dims.ep} if dims.ep > 1 else {}  # (absent at EP 1: checkpoints from before EP)
    etp = {"etp": dims.etp} if dims.etp else {}  # (absent at expert TP = TP)
    return {"world_size": dims.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, **ep, **etp}


def _expert_optimizer(layout: dict[str, int], num_experts: int) -> bool:
    """Whether a model of this layout chains a second, expert optimizer (megatron does at EP > 1,
    megarl at expert TP < TP: :func:`megarl.model.builder._reduce_experts_over_tp`)."""
    return bool(num_experts) and (layout.get("ep", 1) > 1 or "etp" in layout)


def check_expert_optimizer(path: Path, mname: str, saved: dict[str, Any], dims: Any) -> None:
    """Refuse, before reading, optimizer state saved with another optimizer chain (dense alone vs
    dense + experts): megatron's load fails on it with a KeyError listing every tensor."""
    experts = int(saved["model_config"].get("num_experts", 0))
    before, now = saved.get("layout", {}), layout_of(dims)
    if _expert_optimizer(before, experts) != _expert_optimizer(now, experts):
        saved_as = f"EP={before.get('ep', 1)}, expert TP={before.get('etp', before.get('tp'))}"
        raise CheckpointError(
            f"checkpoint {path} model '{mname}' was saved at {saved_as} (TP={before.get('tp')}), whose optimizer "
            f"state is laid out {'with' if _expert_optimizer(before, experts) else 'without'} a separate expert "
            "optimizer: resume with that parallel.expert_parallel and parallel.expert_tensor_parallel "
            "(or load the weights alone)"
        )


def meta_of(models: dict[str, Model]) -> dict[str, Any]:
    import megatron.core

    dims = next(iter(models.values())).dims
    return {
        "format_version": FORMAT_VERSION,
        "megatron_core": getattr(megatron.core, "__version__", ""),
        "layout": layout_of(dims),
        "models": {
            mname: {
                "model_config": model_config_dict(m),
                "has_optimizer": m.optimizer is not None,
                "distributed_optimizer": m.optimizer is not None and uses_distopt(m),
                "padded_vocab": m.padded_vocab,
                "layout": layout_of(m.dims),
            }
            for mname, m in models.items()
        },
    }


def rng_state() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    for key, value in get_cuda_rng_tracker().get_states().items():
        out[f"tracker/{key}"] = value
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    tracker = {k.split("/", 1)[1]: v for k, v in state.items() if k.startswith("tracker/")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(root: Path, keep_last: int) -> None:
    done = complete_checkpoints(root)
    for old in done[: max(0, len(done) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def uses_distopt(model: Model) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(model.optimizer, "chained_optimizers", [model.optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in opts)
