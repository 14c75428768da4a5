"""Gradient statistics for the coordinator's noise-scale estimate (McCandlish et al. 2018).

Per optimizer step (the first mini-batch of each rollout) the probe records:

* **local** |g_r|² — each DP rank's gradient *before* the DP all-reduce, read from megatron's
  grad buffers in the finalize hook. TP-sharded parameters are summed over the TP group,
  TP-duplicated ones (norms, value head) counted once, and the sum runs over PP stages
  (one all-reduce of a scalar over the model-parallel group), then all-gathered over DP.
* **global** |G|² — the optimizer's own (pre-clip) grad norm of the reduced gradient, which
  is correct for TP/PP/DP and the distributed optimizer alike.
* **micro-batch** |g_k|² (only with PP = 1) — each micro-batch's own gradient, as the
  difference of the accumulated buffer between micro-batch boundaries, gathered over DP
  (:meth:`GradProbe.gather_microbatches`): every micro-batch of every DP rank is then a part
  of the noise estimate (``source="microbatch"``), B/mbs parts instead of DP.

Scaling: megarl losses are divided by the GLOBAL denominator D (tokens or responses, see
``megarl.algo.aggregation``), so a part with n of the D units holds (n/D)·ḡ_part; the
probe rescales each part to its own mean gradient, |ḡ_part|² = |g_part|²·(D/n)².
Cost: one scalar all-reduce over the model-parallel group and one DP all-gather per
measured step (plus, for the micro-batch path, a copy of the grad buffer per micro-batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megarl.distributed import ParallelDims


@dataclass
class GradProbe:
    dims: ParallelDims
    microbatch: bool = False
    """Also record per-micro-batch norms (PP = 1 only)."""
    active: bool = False
    local_sq: float = 0.0
    mb_sq: list[float] = field(default_factory=list)
    _weights: list[torch.Tensor] | None = None
    _prev: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.microbatch and self.dims.pp > 1:
            # pipeline schedules interleave stages' forwards: the per-micro-batch all-reduce
            # over the model-parallel group would pair up different micro-batches (deadlock)
            raise ValueError("micro-batch gradient norms need pipeline_parallel = 1")

    def _buffers(self, ddp: Any) -> list[torch.Tensor]:
        return [b.grad_data for b in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))]

    def _count_weights(self, ddp: Any) -> list[torch.Tensor]:
        """1 where a grad element is counted on this rank (TP duplicates only on TP rank 0)."""
        if self._weights is None:
            from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

            ws = []
            for buf in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
                w = torch.zeros_like(buf.grad_data, dtype=torch.float32)
                for p, (start, end, _) in buf.param_index_map.items():
                    if param_is_not_tensor_parallel_duplicate(p, self.dims.tp_group):
                        w[start:end] = 1.0
                ws.append(w)
            self._weights = ws
        return self._weights

    def _sq(self, ddp: Any, grads: list[torch.Tensor]) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.dims.device)  # NCCL refuses CPU tensors
        for g, w in zip(grads, self._count_weights(ddp), strict=True):
            total += (g.double() ** 2 * w).sum()
        if self.dims.tp * self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.mp_group)
        return float(total)

    seconds: float = 0.0
    """Wall time spent in the probe during the last measured step (its whole cost)."""

    def start(self) -> None:
        self.active, self.local_sq, self.mb_sq, self._prev, self.seconds = True, 0.0, [], None, 0.0

    def microbatch_boundary(self, ddp: Any) -> None:
        """Called before each micro-batch's forward (k > 0) and before the DP reduce."""
        if not (self.active and self.microbatch):
            return
        t0 = time.perf_counter()
        cur = self._buffers(ddp)
        if self._prev is None:
            self.mb_sq.append(self._sq(ddp, cur))
        else:
            self.mb_sq.append(self._sq(ddp, [c - p for c, p in zip(cur, self._prev, strict=True)]))
        self._prev = [c.clone() for c in cur]
        self.seconds += time.perf_counter() - t0

    def before_reduce(self, ddp: Any) -> None:
        if not self.active:
            return
        self.microbatch_boundary(ddp)
        t0 = time.perf_counter()
        self.local_sq = self._sq(ddp, self._buffers(ddp))
        self.seconds += time.perf_counter() - t0

    def gather_microbatches(self) -> list[float]:
        """Every DP rank's micro-batch norms, rank-major (ranks may hold different counts)."""
        t0 = time.perf_counter()
        dev = self.dims.device
        n = torch.tensor([len(self.mb_sq)], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(n) for _ in range(self.dims.dp)]
        dist.all_gather(counts, n, group=self.dims.dp_group)
        width = max(int(c) for c in counts)
        mine = torch.zeros(width, dtype=torch.float64, device=dev)
        mine[: len(self.mb_sq)] = torch.tensor(self.mb_sq, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(self.dims.dp)]
        dist.all_gather(parts, mine, group=self.dims.dp_group)
        self.seconds += time.perf_counter() - t0
        return [float(x) for p, c in zip(parts, counts, strict=True) for x in p[: int(c)]]

    def gather_local(self) -> list[float]:
        t0 = time.perf_counter()
        t = torch.tensor([self.local_sq], dtype=torch.float64, device=self.dims.device)
        parts = [torch.zeros_like(t) for _ in range(self.dims.dp)]
        dist.all_gather(parts, t, group=self.dims.dp_group)
        self.seconds += time.perf_counter() - t0
        return [float(x) for x in parts]


def rescale(sq: float, part_units: float, global_units: float) -> float:
    """|ḡ_part|² from the sum-scaled part gradient: × (D / n)²."""
    return sq * (global_units / part_units) ** 2 if part_units > 0 else 0.0
