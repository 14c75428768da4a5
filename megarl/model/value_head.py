"""Scalar value head for the critic: replaces the GPTModel's LM head.

The final hidden state is replicated across TP ranks (no sequence parallel on this path),
so the head is a plain replicated ``Linear(hidden, 1)``: every TP rank computes the same
output and the same, full gradient w.r.t. the hidden state, which is what megatron expects
downstream of a row-parallel layer. Its parameters carry no ``tensor_model_parallel`` flag,
so megatron counts them once in grad norms.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.distributed import ParallelDims


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, bias=True, dtype=dtype)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        # Same call/return convention as megatron's ColumnParallelLinear output layer.
        return self.linear(hidden), None


def attach_value_head(gpt: torch.nn.Module, tcfg: Any, dims: ParallelDims) -> None:
    """Swap the last stage's output layer for a value head (other stages are unchanged)."""
    if dims.is_last_stage:
        gpt.output_layer = ValueHead(tcfg.hidden_size, tcfg.params_dtype)
