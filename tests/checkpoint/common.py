"""Shared pieces of the checkpoint test workers: build a model from an HF folder, fixed
per-step data and a fixed loss, and a few train steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.checkpoint.hf_io import load_hf_tensors, read_hf_folder
from megarl.config import ModelConfig, OptimConfig, ParallelConfig
from megarl.distributed import ParallelDims
from megarl.model.builder import Model, build_gpt
from megarl.model.forward import labels_of, vocab_parallel_logprobs
from megarl.model.train import train_step

B, S, MBS = 8, 16, 2


def build(
    hf_dir: str | Path,
    dims: ParallelDims,
    *,
    dist_opt: bool = False,
    trainable: bool = True,
    hidden_size: int | None = None,
) -> tuple[Model, LlamaQwen2Adapter]:
    """A model of ``dims``' layout initialised from the HF folder (Adam, lr 1e-3, clip 1.0)."""
    hf_cfg, hf = read_hf_folder(hf_dir)
    mcfg = model_config_from_hf(hf_cfg, ModelConfig())
    if hidden_size is not None:  # a deliberately different shape
        mcfg.hidden_size = hidden_size
    pcfg = ParallelConfig(
        tensor_parallel=dims.tp, pipeline_parallel=dims.pp, micro_batch_size=MBS, use_distributed_optimizer=dist_opt
    )
    ocfg = OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6, weight_decay=0.01)
    model = build_gpt(mcfg, pcfg, dims, trainable=trainable, optim=ocfg)
    adapter = LlamaQwen2Adapter(mcfg)
    if hidden_size is None:
        load_hf_tensors(model, adapter, hf)
    return model, adapter


def batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    """The fixed global batch of optimizer step ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S)
    for b in range(B):
        mask[b, 4 : 4 + 3 + (b + step) % 8] = 1.0
    return {"tokens": tokens, "mask": mask}


def sft_step(model: Model, step: int, lr: float | None = None) -> tuple[float, float]:
    """One optimizer step of token-mean NLL on ``batch(step)``; returns (loss, grad_norm)."""
    dims = model.dims
    full = batch(step, model.vocab_size)
    denom = float(full["mask"].sum())
    per = B // dims.dp
    local = {k: v[dims.dp_rank * per : (dims.dp_rank + 1) * per] for k, v in full.items()}

    def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        loss = -(lp * mb["mask"]).sum() / denom
        return loss, {"loss": loss.detach()}

    stats, gnorm = train_step(model, local, loss_fn, micro_batch_size=MBS, lr=lr)
    return stats["loss"], gnorm
