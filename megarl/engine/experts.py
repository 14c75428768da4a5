"""Routed-expert weights into a vLLM engine's fused-MoE layers, never through vLLM's reload.

vLLM 0.32 keeps one layer's routed experts as two 3-D parameters of its ``RoutedExperts``
module (``model.layers.{L}.mlp.experts.routed_experts``; Mixtral's
``model.layers.{L}.block_sparse_moe.experts.routed_experts``): ``w13_weight`` [E_local, 2 I, H]
(expert e's gate rows, then its up rows; I = this worker's TP shard of one expert's width) and
``w2_weight`` [E_local, H, I] (down). The HF names of the three per-expert tensors are the
layer's own ``ckpt_*_proj_name`` (Qwen3-MoE ``gate_proj/up_proj/down_proj``, Mixtral
``w1/w3/w2``), under ``{layer prefix}.{e}.``. After loading,
the layer's kernel rewrites both into its own layout: on CPU the intermediate dimension is
zero-padded to a multiple of 32 and the tensors are pre-packed for the grouped GEMM
(``cpu_prepack_moe_weight``); GPU backends may shuffle them
(``convert_to_unquantized_kernel_format``).

Why not vLLM's paths: on an update (``moe_kernel`` already built)
``UnquantizedFusedMoEMethod._setup_kernel`` copies the converted tensors into the old storage
but skips the experts kernel's own ``process_weights_after_loading`` — the CPU pre-pack — so
the CPU kernel reads plain rows as packed ones: ``reload_weights`` of *identical* tensors moves
the engine's log-probs by up to 0.55 (FACTS; pinned by tests/weight_sync/moe_engine_script.py).
``model.load_weights`` in place writes plain rows into packed storage, wrong the same way.

What :func:`write_experts` does instead, per layer: assemble the loaded layout in fresh
tensors with the layer's own ``weight_loader`` (its TP slicing and global → local expert map),
run the conversion a first load runs (the backend's conversion, then the experts kernel's
``process_weights_after_loading`` on a stand-in module), and copy the result into the live
parameters (their storage stays: CUDA graphs keep their addresses). Invariants: nothing is
written unless every local expert's gate, up and down projection of every layer is in the
update (:func:`plan_experts` checks first); every tensor under an expert layer's name is
handled here, never by ``load_weights``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.errors import EngineError

_PER_EXPERT = re.compile(r"^(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")

SHARDS = ("w1", "w3", "w2")
"""vLLM's shard ids: w1 = gate (first half of w13), w3 = up (second half), w2 = down."""


def expert_layers(model: torch.nn.Module) -> dict[str, Any]:
    """HF prefix of each MoE layer's experts (``model.layers.{L}.mlp.experts``, Mixtral
    ``model.layers.{L}.block_sparse_moe.experts``) -> its vLLM ``RoutedExperts`` module. Empty for
    a dense model."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return {
        name.removesuffix(".routed_experts"): m for name, m in model.named_modules() if isinstance(m, RoutedExperts)
    }


@dataclass
class ExpertPlan:
    """The expert tensors of one update, split from the rest and checked complete."""

    layers: dict[str, Any]
    """HF prefix -> vLLM ``RoutedExperts`` (:func:`expert_layers`)."""
    items: dict[str, list[tuple[str, int, str, torch.Tensor]]] = field(default_factory=dict)
    """HF prefix -> (HF name, global expert id, vLLM shard id, tensor) of its experts."""


def _shard_ids(layer: Any) -> dict[str, str]:
    return {layer.ckpt_gate_proj_name: "w1", layer.ckpt_up_proj_name: "w3", layer.ckpt_down_proj_name: "w2"}


def _local_experts(layer: Any) -> list[int]:
    return [g for g in range(layer.global_num_experts) if layer._map_global_expert_id_to_local_expert_id(g) != -1]


def plan_experts(
    layers: dict[str, Any], named: list[tuple[str, torch.Tensor]]
) -> tuple[ExpertPlan, list[tuple[str, torch.Tensor]], list[str]]:
    """Split ``named`` into the expert plan and the rest (for ``load_weights``), and name the
    expert tensors of this worker's layers that the update lacks (then nothing may be
    written). A name under an expert layer that is not one expert's gate/up/down weight goes
    to neither: no loader uses it, and the coverage check names it."""
    plan, rest = ExpertPlan(layers), []
    for name, t in named:
        prefix, _, tail = name.rpartition(".experts.")
        prefix = f"{prefix}.experts"
        if not tail or prefix not in layers:
            rest.append((name, t))
            continue
        layer, m = layers[prefix], _PER_EXPERT.match(tail)
        shard = _shard_ids(layer).get(m["proj"]) if m else None
        if m is None or shard is None or not 0 <= int(m["e"]) < layer.global_num_experts:
            continue  # e.g. transformers 5's fused in-memory experts.gate_up_proj: used by nothing
        plan.items.setdefault(prefix, []).append((name, int(m["e"]), shard, t))
    missing = []
    for prefix, layer in layers.items():
        have = {(e, s) for _, e, s, _ in plan.items.get(prefix, [])}
        proj_of = {s: p for p, s in _shard_ids(layer).items()}
        missing += [
            f"{prefix}.{e}.{proj_of[s]}.weight" for e in _local_experts(layer) for s in SHARDS if (e, s) not in have
        ]
    return plan, rest, missing


def write_experts(plan: ExpertPlan) -> tuple[list[torch.Tensor], set[str]]:
    """Write every planned layer. Returns (the parameters written, HF names of the tensors
    used: a tensor of an expert another worker holds is not used here)."""
    written: list[torch.Tensor] = []
    used: set[str] = set()
    for prefix, items in plan.items.items():
        layer = plan.layers[prefix]
        w13, w2, took = _loaded_layout(layer, items)
        w13, w2 = kernel_layout(layer, w13, w2)
        for pname, new in (("w13_weight", w13), ("w2_weight", w2)):
            live = getattr(layer, pname)
            if live.shape != new.shape or live.dtype != new.dtype:
                raise EngineError(
                    f"{prefix}: converted {pname} is {list(new.shape)} {new.dtype}, the engine holds"
                    f" {list(live.shape)} {live.dtype}"
                )
            live.data.copy_(new)
            written.append(live)
        used |= took
    return written, used


def _loaded_layout(layer: Any, items: list[tuple[str, int, str, torch.Tensor]]) -> tuple[Any, Any, set[str]]:
    """w13 / w2 as a first load leaves them (before the kernel's conversion), filled by the
    layer's own ``weight_loader`` (TP slice, global -> local expert id)."""
    inter, hidden = layer.intermediate_size_per_partition, layer.hidden_size
    up = 2 * inter if layer.moe_config.is_act_and_mul else inter
    dtype, device, n = layer.params_dtype, layer.w13_weight.device, layer.local_num_experts
    w13 = torch.nn.Parameter(torch.zeros(n, up, hidden, dtype=dtype, device=device), requires_grad=False)
    w2 = torch.nn.Parameter(torch.zeros(n, hidden, inter, dtype=dtype, device=device), requires_grad=False)
    took = set()
    for name, e, shard, t in items:
        param, pname = (w2, "w2_weight") if shard == "w2" else (w13, "w13_weight")
        if layer.weight_loader(
            param=param, loaded_weight=t, weight_name=pname, shard_id=shard, expert_id=e, return_success=True
        ):
            took.add(name)
    return w13, w2, took


def kernel_layout(layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conversion ``UnquantizedFusedMoEMethod.process_weights_after_loading`` runs on a
    first load, including the step an update skips in vLLM 0.32 (the experts kernel's own
    ``process_weights_after_loading``: the CPU pad + pre-pack), applied to a stand-in module
    so the layer's live parameters are only ever copied into."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        convert_to_unquantized_kernel_format,
    )
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = layer.quant_method
    if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
        raise EngineError(f"{type(method).__name__} experts cannot be synced (only unquantized MoE layers)")
    backend = method.unquantized_backend
    supported = (
        UnquantizedMoeBackend.CPU,
        UnquantizedMoeBackend.TRITON,
        UnquantizedMoeBackend.BATCHED_TRITON,
        UnquantizedMoeBackend.FLASHINFER_CUTLASS,
        UnquantizedMoeBackend.FLASHINFER_TRTLLM,
        UnquantizedMoeBackend.AITER,
    )
    if backend not in supported:
        raise EngineError(
            f"MoE backend {backend.value} cannot be synced in place (supported: CPU, Triton, FlashInfer, AITER)"
        )
    w13, w2 = convert_to_unquantized_kernel_format(
        backend, moe_config=layer.moe_config, w13_weight=w13, w2_weight=w2, layer=layer
    )
    stand_in = torch.nn.Module()
    stand_in.register_parameter("w13_weight", torch.nn.Parameter(w13, requires_grad=False))
    stand_in.register_parameter("w2_weight", torch.nn.Parameter(w2, requires_grad=False))
    stand_in.moe_config = layer.moe_config  # read by the kernel's checks (zentorch, padding)
    stand_in.activation = layer.activation
    method.moe_kernel.fused_experts.process_weights_after_loading(stand_in)
    new13, new2 = stand_in.get_parameter("w13_weight"), stand_in.get_parameter("w2_weight")
    return new13.data, new2.data
