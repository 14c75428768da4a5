"""Mixture-of-experts names and layouts between megatron and HF (Qwen3-MoE, Mixtral), and the
expert parallel (EP) index arithmetic the adapter and :mod:`megarl.checkpoint.hf_io` share.

Megatron names one layer's experts in one of two forms, depending on the expert module:

* ``mlp.experts.local_experts.{i}.linear_fc1.weight`` — ``SequentialMLP`` (the local spec: what
  megatron-core 0.16 builds on CPU, and TE's spec without grouped GEMM);
* ``mlp.experts.linear_fc1.weight{i}`` — ``TEGroupedMLP`` (TE's spec with grouped GEMM, GPU).

In both, ``i`` is the LOCAL index of the expert on its EP rank: with E experts over EP ranks each
rank holds L = E / EP of them, and local expert i of EP rank r is global expert g = r × L + i
(megatron's own ``local_expert_indices``). :func:`to_global` / :func:`to_local` rewrite a
parameter's name between the two, so the adapter only ever sees global indices, which are HF's
expert indices. Within an expert, ``linear_fc1`` is [gate; up] per TP shard (expert TP
= TP) exactly as a dense SwiGLU MLP; ``linear_fc2`` is split along its input dimension.
The router ``mlp.router.weight`` [E, hidden] is whole on every rank.

HF names differ by family (:data:`HF_EXPERT_NAMES`), as checkpoints on disk hold them (what
``save_pretrained`` writes and vLLM loads; transformers 5 fuses both families' experts into
``mlp.experts.gate_up_proj`` / ``down_proj`` in memory only):

* Qwen3-MoE: router ``mlp.gate.weight``, expert g ``mlp.experts.{g}.gate_proj/up_proj/down_proj.weight``;
* Mixtral: router ``block_sparse_moe.gate.weight``, expert g
  ``block_sparse_moe.experts.{g}.w1/w3/w2.weight`` (w1 = gate, w3 = up, w2 = down).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EXPERT = re.compile(
    r"^(?P<head>(?:decoder\.layers\.\d+\.)?mlp\.experts\.)"
    r"(?:local_experts\.(?P<seq>\d+)\.linear_fc(?P<seq_fc>[12])\.weight|linear_fc(?P<grp_fc>[12])\.weight(?P<grp>\d+))$"
)


def is_expert(name: str) -> bool:
    """A weight of one expert (split over EP ranks, not replicated over them)."""
    return _EXPERT.match(name) is not None


def _renumber(name: str, shift: int) -> str:
    m = _EXPERT.match(name)
    if m is None:
        return name
    if m["seq"] is not None:
        return f"{m['head']}local_experts.{int(m['seq']) + shift}.linear_fc{m['seq_fc']}.weight"
    return f"{m['head']}linear_fc{m['grp_fc']}.weight{int(m['grp']) + shift}"


def to_global(name: str, ep_rank: int, local_experts: int) -> str:
    """``name`` of this EP rank's local expert under its global index (other names unchanged)."""
    return _renumber(name, ep_rank * local_experts)


def to_local(name: str, ep_rank: int, local_experts: int) -> str:
    """Inverse of :func:`to_global` on the EP rank that holds the expert."""
    return _renumber(name, -ep_rank * local_experts)


@dataclass(frozen=True)
class HFExpertNames:
    """One MoE family's HF names of a layer's router and experts (per-layer suffixes)."""

    block: str
    """The layer's MoE module: ``mlp`` (Qwen3-MoE) or ``block_sparse_moe`` (Mixtral)."""
    gate: str
    """An expert's gate projection (the SiLU-ed half of SwiGLU)."""
    up: str
    """An expert's up projection."""
    down: str
    """An expert's down projection."""

    @property
    def router(self) -> str:
        return f"{self.block}.gate.weight"

    def expert(self, g: int, proj: str) -> str:
        """Suffix of global expert ``g``'s projection ``proj`` (one of gate, up, down's names)."""
        return f"{self.block}.experts.{g}.{proj}.weight"


HF_EXPERT_NAMES = {
    "qwen3_moe": HFExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": HFExpertNames("block_sparse_moe", "w1", "w3", "w2"),
}
"""model.arch -> its HF expert names, for each MoE family megarl builds."""


def expert_target(suffix: str, names: HFExpertNames) -> tuple[str, int | None] | None:
    """(HF per-layer suffix, or ``@efc1.{g}`` for the fused gate/up of expert g; TP split dim) of
    a per-layer megatron suffix under its global expert index; None for anything else."""
    if suffix == "mlp.router.weight":
        return names.router, None
    m = _EXPERT.match(suffix)
    if m is None or m["head"] != "mlp.experts.":
        return None
    g, fc = (m["seq"], m["seq_fc"]) if m["seq"] is not None else (m["grp"], m["grp_fc"])
    if fc == "1":
        return f"@efc1.{int(g)}", 0
    return names.expert(int(g), names.down), 1


def hf_expert_shapes(prefix: str, names: HFExpertNames, experts: int, hidden: int, ffn: int) -> dict[str, list[int]]:
    """HF tensors of one MoE layer's experts and router (``prefix`` = ``model.layers.{l}.``)."""
    shapes = {prefix + names.router: [experts, hidden]}
    for g in range(experts):
        shapes.update(
            {
                prefix + names.expert(g, names.gate): [ffn, hidden],
                prefix + names.expert(g, names.up): [ffn, hidden],
                prefix + names.expert(g, names.down): [hidden, ffn],
            }
        )
    return shapes
