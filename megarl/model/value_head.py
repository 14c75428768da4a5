"""Scalar value head for the critic: replaces the GPTModel's LM head.

The final hidden state is replicated across TP ranks, so the head is a plain replicated
``Linear(hidden, 1)``: every TP rank computes the same output and the same, full gradient
w.r.t. the hidden state, which is what megatron expects downstream of a row-parallel layer.
Its parameters carry no ``tensor_model_parallel`` flag, so megatron counts them once in grad
norms. Under sequence parallelism each TP rank holds only its slice of the sequence: the head
all-gathers it first (as the LM head's ColumnParallelLinear does), and as every rank then
computes the same values, the backward hands each rank its slice of the (same) gradient
rather than summing the ranks' copies (megatron's ``tensor_parallel_output_grad=False``).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.distributed import ParallelDims


class ValueHead(torch.nn.Module):
    """``output_layer.weight`` (1, H) and ``output_layer.bias`` (1): the names megatron's
    ``LanguageModule.sharded_state_dict`` expects of an output layer (checkpointable)."""

    is_value_head = True

    def __init__(self, hidden_size: int, dtype: torch.dtype, sp_group: Any = None) -> None:
        """``sp_group``: the TP group whose ranks each hold a slice of the sequence (None: no
        sequence parallelism)."""
        super().__init__()
        self.sp_group = sp_group
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        # Same call/return convention as megatron's ColumnParallelLinear output layer.
        if self.sp_group is not None:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.sp_group
            )
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def attach_value_head(gpt: torch.nn.Module, tcfg: Any, dims: ParallelDims) -> None:
    """Swap the last stage's output layer for a value head (other stages are unchanged)."""
    if dims.is_last_stage:
        sp_group = dims.tp_group if tcfg.sequence_parallel else None
        gpt.output_layer = ValueHead(tcfg.hidden_size, tcfg.params_dtype, sp_group)
