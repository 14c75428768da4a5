"""Sequence parallelism (``parallel.sequence_parallel``): what megarl adds to megatron's.

megatron does the splitting: the embedding scatters its (s, b, h) output over the TP ranks
(each keeps s/TP positions), the TP-split linears all-gather the sequence before and
reduce-scatter it after, the output layer all-gathers it back, so the logits reach the loss
whole, (b, s, v/TP). megarl adds three things:

* a norm for the local spec that allows it (megatron's ``WrappedTorchNorm`` asserts no SP):
  :class:`SequenceParallelNorm`, torch's RMSNorm whose weight carries megatron's
  ``sequence_parallel`` flag, so ``finalize_model_grads`` sums its gradient over TP (each rank
  normalised different positions); the block's final norm is one too (:func:`block_spec`);
* padding: the sequence dimension a rank splits must divide by TP, so a micro-batch of width
  (packed: token count) ``s`` runs right-padded to :func:`padded_length` and its output is cut
  back to ``s`` columns (:func:`forward_padded`, every forward of megarl's schedule runner).
  Causal attention makes the padding invisible to every real position; packed, the padding is
  a sequence of its own (one more ``cu_seqlens`` segment);
* the value head gathers the sequence itself (``megarl.model.value_head``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megarl.model.packing import Packing


class SequenceParallelNorm(torch.nn.RMSNorm):
    """megatron's local-spec RMSNorm (``WrappedTorchNorm``'s, same parameters and state-dict
    names) that runs under sequence parallelism: its weight is marked ``sequence_parallel``
    so its gradient is summed over the TP group after the backward."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelNorm is an RMSNorm; config.normalization={config.normalization}")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def layer_spec_for(spec: Any) -> Any:
    """The local layer spec with :class:`SequenceParallelNorm` for its per-token norms (before
    attention and before the MLP; q/k norms run after the gather, on whole sequences, and
    megatron already sums their gradients over TP, but they are torch norms too: swapped
    alike, their flag is harmless)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub, attn = spec.submodules, spec.submodules.self_attention.submodules
    for holder, name in (
        (sub, "input_layernorm"),
        (sub, "pre_mlp_layernorm"),
        (attn, "q_layernorm"),
        (attn, "k_layernorm"),
    ):
        if getattr(holder, name) is WrappedTorchNorm:
            setattr(holder, name, SequenceParallelNorm)
    return spec


def block_spec(config: Any, layer: Any, pp_rank: int) -> Any:
    """This PP stage's block of ``layer`` specs with :class:`SequenceParallelNorm` as its final
    norm (a bare layer spec gets megatron's ``WrappedTorchNorm`` there)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    n = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SequenceParallelNorm)


def padded_length(s: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that is >= ``s``."""
    return -(-s // tp) * tp


def pad_columns(x: torch.Tensor, tp: int, value: int = 0) -> torch.Tensor:
    """(b, s) -> (b, padded_length(s, tp)), the new columns filled with ``value``."""
    extra = padded_length(x.shape[1], tp) - x.shape[1]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra), value=value)


def cut_columns(out: torch.Tensor, s: int) -> torch.Tensor:
    """The model's (b, s', ...) output back to its first ``s`` columns."""
    return out if out.shape[1] == s else out[:, :s].contiguous()  # (megatron's cross entropy views it)


def forward_padded(module: torch.nn.Module, tokens: torch.Tensor, packing: Packing | None, sp: int) -> torch.Tensor:
    """One micro-batch through this rank's stage: (b, s) tokens, or one packed (1, T) row; the
    last stage's output cut back to s (packed: T) columns. ``sp`` (TP under sequence
    parallelism, else 1): the columns run right-padded to a multiple of it (``megarl.model.seqpar``;
    packed, the padding is a sequence of its own)."""
    if packing is not None:
        row = packing.pack(tokens)
        pad = padded_length(row.shape[1], sp) - row.shape[1]
        params = packing.seq_params(tokens.device, pad)
        positions = pad_columns(packing.positions.to(tokens.device), sp)
        out = module(pad_columns(row, sp), positions, None, packed_seq_params=params)
        width = row.shape[1]
    else:
        width = tokens.shape[1]
        positions = torch.arange(padded_length(width, sp), device=tokens.device).expand(tokens.shape[0], -1)
        out = module(pad_columns(tokens, sp), positions, None)
    post_process = getattr(_unwrap(module), "post_process", True)
    return cut_columns(out, width) if post_process and sp > 1 else out


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module  # type: ignore[assignment]
    return module
