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
  of the noise estimate (``source="microbatch"``), B/mbs parts instead of DP. With
  ``microbatches_per_part`` = k > 1 a part is k consecutive micro-batches (the buffer is read
  at every k-th boundary only): the planner joins micro-batches that split GRPO groups into
  runs holding whole groups, since a split group's parts are not independent.

Preconditioned (``coordinator.noise_kind: adam``): with ``weights`` — Adam's element-wise
preconditioner P = 1/(√v̂+ε) per grad buffer (:func:`megarl.model.adam_state.adam_preconditioner`,
read before the step: v̂ of the steps so far) — every norm above is |P·g|² instead of
|g|², and |P·G|² is read from the reduced buffer after the DP reduction (:meth:`after_reduce`)
over the same counted ranges (the optimizer's grad norm is unpreconditioned).

Expert parallelism (EP > 1; ``megarl.coordinator.noise`` has the derivation): the routed
experts' grad buffers (megatron's ``expert_parallel_buffers``) are read as their own class. A
rank's dense buffer holds its own rows' gradient, but its local experts' buffer holds the
gradient of every token the all-to-all brought them: the rows of the same micro-batch on every
rank of its EP group. So each norm above comes in two columns, dense and expert, and the expert
column is summed over the EP group (the experts are disjoint there, so the sum is the squared
norm of the group's part's whole expert gradient, each expert once): per micro-batch run that
is the part "the union over the EP group of that run", identical on the group's ranks
(:meth:`GradProbe.gather_experts` keeps one copy per group). The reduced gradient's
class norms (:meth:`after_reduce`) come from the reduced buffers: dense summed over the
model-parallel group, experts over it and the EP group (the optimizer's expert grad norm sums
over the same ranks), both over DP with the distributed optimizer (each rank then holds its
shard of each bucket, dense sharded over DP and experts over the expert-DP ranks, which with
the EP group make up DP). At EP = 1 there is one class, all parameters, read as before.

Scaling: megarl losses are divided by the GLOBAL denominator D (tokens or responses, see
``megarl.algo.aggregation``), so a part with n of the D units holds (n/D)·ḡ_part; the
probe rescales each part to its own mean gradient, |ḡ_part|² = |g_part|²·(D/n)².
Cost: one all-reduce of a few scalars over the model-parallel group and one DP all-gather per
measured step; the norms are float64 dots over cache-sized chunks of the counted ranges, and the
micro-batch path keeps one copy of the grad buffer for the measured step, differenced in place.
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
    microbatches_per_part: int = 1
    """Consecutive micro-batches that make one part (whole GRPO groups); the rank's micro-batch
    count must be a multiple of it (the config keeps it so)."""
    split: bool = False
    """Also read each part's halves (a part is one GRPO group in an even number of micro-batches:
    the first half of them holds half its responses): the squared norm of their difference,
    ``split_sq``, for the between/within-prompt split (``megarl.coordinator.noise_split``)."""
    active: bool = False
    local_sq: float = 0.0
    mb_sq: list[float] = field(default_factory=list)
    split_sq: list[float] = field(default_factory=list)
    """With ``split``: per part, |Δ_1 - Δ_2|² of its halves' sum-scaled gradients (order of mb_sq)."""
    _half: list[torch.Tensor] | None = None
    _split_pending: list[torch.Tensor] = field(default_factory=list)
    _segments: list[list[tuple[int, int]]] | None = None
    _prev: list[torch.Tensor] | None = None
    _pending: list[torch.Tensor] = field(default_factory=list)
    _boundaries: int = 0
    weights: list[torch.Tensor] | None = None
    """Per grad buffer, Adam's preconditioner laid out like the buffer (noise_kind adam), else None."""
    global_sq: float | None = None
    """|P·G|² of the reduced gradient (with ``weights``; the plain |G|² is the optimizer's), or at
    EP > 1 its dense parameters' |G|² (|P·G|² with ``weights``)."""
    expert_local_sq: float = 0.0
    """EP > 1: Σ over the EP group of the local experts' |g|², the group's part (the union of its
    ranks' rows)."""
    expert_mb_sq: list[float] = field(default_factory=list)
    """EP > 1: per part (run of micro-batches), the same sum over the union of the EP group's runs."""
    expert_global_sq: float | None = None
    """EP > 1: the experts' |G|² (|P·G|² with ``weights``) of the reduced gradient, each expert once."""

    def __post_init__(self) -> None:
        if self.microbatch and self.dims.pp > 1:
            # pipeline schedules interleave micro-batches' forwards and backwards (1F1B): the
            # buffer's change between two forwards is not one micro-batch's gradient
            raise ValueError("micro-batch gradient norms need pipeline_parallel = 1")
        if self.split and (not self.microbatch or self.microbatches_per_part % 2 or self.dims.ep > 1):
            raise ValueError(
                f"the noise split needs micro-batch parts of an even number of micro-batches at EP = 1, got "
                f"microbatch={self.microbatch}, microbatches_per_part={self.microbatches_per_part}, EP={self.dims.ep}"
            )

    @staticmethod
    def _all_buffers(ddp: Any) -> list[Any]:
        return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))

    def _buffers(self, ddp: Any) -> list[torch.Tensor]:
        return [b.grad_data for b in self._all_buffers(ddp)]

    def _counted(self, ddp: Any) -> list[list[tuple[int, int]]]:
        """Per grad buffer: the [start, end) element ranges counted on this rank (TP duplicates
        only on TP rank 0), adjacent ranges merged (one range per buffer when nothing is skipped)."""
        if self._segments is None:
            from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

            out = []
            for buf in self._all_buffers(ddp):
                ranges = sorted(
                    (start, end)
                    for p, (start, end, _) in buf.param_index_map.items()
                    if param_is_not_tensor_parallel_duplicate(p, self.dims.tp_group)
                )
                merged: list[tuple[int, int]] = []
                for start, end in ranges:
                    if merged and merged[-1][1] == start:
                        merged[-1] = (merged[-1][0], end)
                    else:
                        merged.append((start, end))
                out.append(merged)
            self._segments = out
        return self._segments

    @property
    def classes(self) -> int:
        """Parameter classes read apart: 2 at EP > 1 (dense, routed experts), else 1 (all)."""
        return 2 if self.dims.ep > 1 else 1

    def _class_of(self, ddp: Any) -> list[int]:
        """Per grad buffer, its column: the expert-parallel buffers are column 1 at EP > 1."""
        dense = len(ddp.buffers)
        return [0 if i < dense or self.classes == 1 else 1 for i in range(len(self._all_buffers(ddp)))]

    def _reduced_ranges(self, ddp: Any) -> list[list[tuple[int, int]]]:
        """Per grad buffer, the counted ranges that hold the REDUCED gradient on this rank: all of
        them, or with the distributed optimizer this rank's shard of each bucket (megatron
        reduce-scatters ``bucket.grad_data`` in equal shards over the buffer's DP group)."""
        counted = self._counted(ddp)
        if not ddp.ddp_config.use_distributed_optimizer:
            return counted
        out = []
        for buf, ranges in zip(self._all_buffers(ddp), counted, strict=True):
            size, rank = buf.data_parallel_world_size, buf.data_parallel_group.rank()
            shards = [
                (b.offset + rank * (b.grad_data.numel() // size), b.offset + (rank + 1) * (b.grad_data.numel() // size))
                for b in buf.buckets
            ]
            out.append([(max(s, a), min(e, z)) for a, z in shards for s, e in ranges if max(s, a) < min(e, z)])
        return out

    def _local_sq(
        self, ddp: Any, grads: list[torch.Tensor], ranges: list[list[tuple[int, int]]] | None = None
    ) -> torch.Tensor:
        """This rank's counted Σg² per class, a (classes,) float64 device tensor (no collective,
        no host sync); ``ranges``: per buffer, what to read (default all counted ranges).

        Each counted range is read in chunks cast to float64 and dotted (a cache-sized
        temporary on CPU; the old ``(g.double() ** 2 * mask).sum()`` made three full-size float64
        temporaries per call). A plain fp32 dot over the whole buffer is off by ~2e-5 relative
        at the demo's size, which the parity test's 1e-5 refuses."""
        device = grads[0].device if grads else self.dims.device
        chunk = 1 << 22 if device.type == "cuda" else 1 << 16
        total = torch.zeros(self.classes, dtype=torch.float64, device=device)
        weights: list[torch.Tensor | None] = list(self.weights) if self.weights else [None] * len(grads)
        read = self._counted(ddp) if ranges is None else ranges
        for g, w, col, buf_ranges in zip(grads, weights, self._class_of(ddp), read, strict=True):
            for start, end in buf_ranges:
                for i in range(start, end, chunk):
                    j = min(i + chunk, end)
                    v = g[i:j].double() if w is None else g[i:j].double() * w[i:j]
                    total[col] += torch.dot(v, v)
        return total

    seconds: float = 0.0
    """Wall time spent in the probe during the last measured step (its whole cost)."""

    def start(self, weights: list[torch.Tensor] | None = None) -> None:
        """Measure the next update; ``weights``: Adam's preconditioner per grad buffer (or None)."""
        self.active, self.local_sq, self.mb_sq, self._prev, self.seconds = True, 0.0, [], None, 0.0
        self._pending, self.weights, self.global_sq, self._boundaries = [], weights, None, 0
        self.split_sq, self._split_pending, self._half = [], [], None

    def microbatch_boundary(self, ddp: Any, last: bool = False) -> None:
        """Called before each micro-batch's forward (k > 0) and before the DP reduce (``last``).

        The part's own gradient is the change of the accumulated buffer since the last recorded
        boundary (every ``microbatches_per_part``-th, and the last); it is formed in place in a
        copy kept for the step (|prev - cur|² = |cur - prev|²), which then takes the current
        values: no allocation after the first boundary."""
        if not (self.active and self.microbatch):
            return
        self._boundaries += 1
        if self.split and not last and self._boundaries % self.microbatches_per_part == self.microbatches_per_part // 2:
            self._read_half(ddp)
            return
        if not last and self._boundaries % self.microbatches_per_part:
            return  # inside a part: its micro-batches are read together
        if self._boundaries % self.microbatches_per_part:
            raise RuntimeError(
                f"grad probe: {self._boundaries} micro-batches are not whole parts of {self.microbatches_per_part}"
            )
        t0 = time.perf_counter()
        cur = self._buffers(ddp)
        if self._prev is None:
            self._pending.append(self._local_sq(ddp, cur))
            self._read_difference(ddp, cur, -1.0)
            self._prev = [c.clone() for c in cur]
        else:
            for p, c in zip(self._prev, cur, strict=True):
                p.sub_(c)
            self._pending.append(self._local_sq(ddp, self._prev))
            self._read_difference(ddp, self._prev, 1.0)  # prev - cur = -(Δ_1 + Δ_2)
            for p, c in zip(self._prev, cur, strict=True):
                p.copy_(c)
        self.seconds += time.perf_counter() - t0

    def _read_half(self, ddp: Any) -> None:
        """The middle of a part (``split``): keep its first half's gradient Δ_1 = cur - prev in a
        second buffer copy (the probe's only other memory, for the measured update)."""
        t0 = time.perf_counter()
        cur = self._buffers(ddp)
        if self._half is None:
            self._half = [c.clone() for c in cur]
        else:
            for h, c in zip(self._half, cur, strict=True):
                h.copy_(c)
        if self._prev is not None:  # (the first part starts from the zeroed buffer)
            for h, p in zip(self._half, self._prev, strict=True):
                h.sub_(p)
        self.seconds += time.perf_counter() - t0

    def _read_difference(self, ddp: Any, whole: list[torch.Tensor], sign: float) -> None:
        """The end of a part (``split``): with ``sign``·``whole`` = -(Δ_1 + Δ_2), the halves'
        difference Δ_1 - Δ_2 = 2·Δ_1 - (Δ_1 + Δ_2), formed in the half copy, and its norm."""
        if not self.split:
            return
        assert self._half is not None, "grad probe: a part ended before its middle was read"
        for h, w in zip(self._half, whole, strict=True):
            h.mul_(2.0).add_(w, alpha=sign)
        self._split_pending.append(self._local_sq(ddp, self._half))

    def before_reduce(self, ddp: Any) -> None:
        """The step's last boundary, then every norm summed over the model-parallel group in one
        all-reduce (TP shards and PP stages; a collective per micro-batch before), and at EP > 1
        the expert column over the EP group in one more."""
        if not self.active:
            return
        self.microbatch_boundary(ddp, last=True)
        t0 = time.perf_counter()
        k = len(self._pending)  # (parts + split parts + 1, classes)
        sums = torch.stack([*self._pending, *self._split_pending, self._local_sq(ddp, self._buffers(ddp))])
        if self.dims.tp * self.dims.pp > 1:
            dist.all_reduce(sums, group=self.dims.mp_group)
        if self.classes > 1:  # disjoint experts: the sum is the EP group's part, each expert once
            experts = sums[:, 1].contiguous()
            dist.all_reduce(experts, group=self.dims.ep_group)
            values = [float(x) for x in experts.cpu()]
            self.expert_mb_sq, self.expert_local_sq = values[:-1], values[-1]
        values = [float(x) for x in sums[:, 0].cpu()]
        self.mb_sq, self.split_sq, self.local_sq = values[:k], values[k:-1], values[-1]
        self._pending, self._prev, self._split_pending, self._half = (
            [],
            None,
            [],
            None,
        )  # copies: the measured step only
        self.seconds += time.perf_counter() - t0

    def after_reduce(self, ddp: Any) -> None:
        """The reduced gradient's |P·G|² (preconditioned probes) or, at EP > 1, its per-class
        |G|² (|P·G|²), summed over the model-parallel group. Without the distributed optimizer
        every DP rank holds the whole reduced dense buffer and every expert-DP rank its experts'
        whole reduced buffer: the experts are summed over the EP group, nothing over DP. With it
        each rank holds its shard (:meth:`_reduced_ranges`), and both columns are summed over DP
        (dense shards over DP; expert shards over expert-DP × the EP group, which is DP)."""
        if not (self.active and (self.weights is not None or self.classes > 1)):
            return
        t0 = time.perf_counter()
        total = self._local_sq(ddp, self._buffers(ddp), self._reduced_ranges(ddp))
        if self.dims.tp * self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.mp_group)
        if ddp.ddp_config.use_distributed_optimizer:
            dist.all_reduce(total, group=self.dims.dp_group)
        elif self.classes > 1:
            experts = total[1:].contiguous()
            dist.all_reduce(experts, group=self.dims.ep_group)
            total[1:] = experts
        self.global_sq = float(total[0])
        self.expert_global_sq = float(total[1]) if self.classes > 1 else None
        self.seconds += time.perf_counter() - t0

    def _gather(self, values: list[float]) -> list[list[float]]:
        """Every DP rank's ``values``, by DP rank (ranks may hold different counts)."""
        t0 = time.perf_counter()
        dev = self.dims.device
        n = torch.tensor([len(values)], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(n) for _ in range(self.dims.dp)]
        dist.all_gather(counts, n, group=self.dims.dp_group)
        width = max(int(c) for c in counts)
        mine = torch.zeros(width, dtype=torch.float64, device=dev)
        mine[: len(values)] = torch.tensor(values, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(self.dims.dp)]
        dist.all_gather(parts, mine, group=self.dims.dp_group)
        self.seconds += time.perf_counter() - t0
        return [[float(x) for x in p[: int(c)]] for p, c in zip(parts, counts, strict=True)]

    def gather_microbatches(self) -> list[float]:
        """Every DP rank's micro-batch norms, rank-major (ranks may hold different counts)."""
        return [x for rank in self._gather(self.mb_sq) for x in rank]

    def gather_split(self) -> list[float]:
        """Every DP rank's ``split_sq``, rank-major (the order of :meth:`gather_microbatches`)."""
        return [x for rank in self._gather(self.split_sq) for x in rank]

    def gather_experts(self) -> list[list[float]]:
        """EP > 1: per EP group (consecutive DP ranks, megatron's order), its expert parts — one
        per run of micro-batches, or one (the group's whole rows) without micro-batch parts;
        every rank of a group holds the same values, the group's first rank is kept."""
        mine = self.expert_mb_sq if self.microbatch else [self.expert_local_sq]
        return self._gather(mine)[:: self.dims.ep]

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
