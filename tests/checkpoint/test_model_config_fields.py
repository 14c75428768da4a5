"""Checkpoint metadata and the model-config fields added for llama3 RoPE and linear biases:
checkpoints written before them still load (they meant no scaling, no biases), and a model
that differs in them is refused by name; optimizer state of another expert optimizer chain is
refused by name too."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.checkpoint.meta import CheckpointError, check_expert_optimizer, layout_of
from megarl.checkpoint.meta import check_model_config as _check_model_config

OLD = {  # meta.json model_config as written before linear_bias / rope_scaling existed
    "arch": "llama",
    "num_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "head_dim": 32,
    "ffn_hidden_size": 256,
    "vocab_size": 100,
    "max_position_embeddings": 64,
    "rotary_base": 10000.0,
    "norm_eps": 1e-5,
    "tie_embeddings": False,
    "value_head": False,
    "dtype": "fp32",
}
NEW = {**OLD, "linear_bias": False, "rope_scaling": "none"}
LLAMA3 = {
    **OLD,
    "linear_bias": True,
    "rope_scaling": "llama3",
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}


def test_old_checkpoint_fits_a_plain_model() -> None:
    _check_model_config(Path("ckpt"), "actor", OLD, NEW)


def test_scaling_and_bias_differences_are_named() -> None:
    with pytest.raises(CheckpointError, match=r"saved with .*linear_bias=False.*rope_scaling='none'.*"):
        _check_model_config(Path("ckpt"), "actor", OLD, LLAMA3)
    with pytest.raises(CheckpointError, match=r"rope_scaling_factor=8\.0"):
        _check_model_config(Path("ckpt"), "actor", LLAMA3, NEW)
    _check_model_config(Path("ckpt"), "actor", LLAMA3, dict(LLAMA3))


def test_old_checkpoints_are_dense_and_expert_differences_are_named() -> None:
    """Checkpoints from before MoE meant no experts; a MoE checkpoint loaded into another
    expert count (or routing) names the field."""
    moe = {**NEW, "arch": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 64, "moe_router_topk": 2,
           "moe_norm_topk_prob": True}  # fmt: skip
    _check_model_config(Path("ckpt"), "actor", OLD, {**NEW, "num_experts": 0, "moe_router_topk": 2})
    with pytest.raises(CheckpointError, match=r"saved with .*num_experts=0.*the model has .*num_experts=4"):
        _check_model_config(Path("ckpt"), "actor", OLD, moe)
    with pytest.raises(
        CheckpointError, match=r"saved with moe_norm_topk_prob=True; the model has moe_norm_topk_prob=False"
    ):
        _check_model_config(Path("ckpt"), "actor", moe, {**moe, "moe_norm_topk_prob": False})


def _dims(tp: int, ep: int = 1, etp: int = 0) -> SimpleNamespace:
    return SimpleNamespace(world_size=2 * ep, tp=tp, pp=1, dp=ep, ep=ep, etp=etp)


def test_optimizer_state_of_another_expert_optimizer_chain_is_refused_naming_the_fields() -> None:
    """Expert TP 1 < TP (and EP > 1) chain a separate expert optimizer: a MoE checkpoint resumes
    its optimizer state only into the same chain; a dense model has no expert optimizer at any."""
    moe = {"model_config": {"num_experts": 4}, "layout": layout_of(_dims(2, etp=1))}
    check_expert_optimizer(Path("ckpt"), "actor", moe, _dims(2, etp=1))
    check_expert_optimizer(Path("ckpt"), "actor", moe, _dims(2, ep=2))  # both chained
    with pytest.raises(CheckpointError, match=r"saved at EP=1, expert TP=1 \(TP=2\).*parallel\.expert_tensor_parallel"):
        check_expert_optimizer(Path("ckpt"), "actor", moe, _dims(2))
    dense = {"model_config": {"num_experts": 0}, "layout": layout_of(_dims(2, etp=1))}
    check_expert_optimizer(Path("ckpt"), "actor", dense, _dims(2))
