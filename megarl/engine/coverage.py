"""The coverage check of a weight update, for every model: every engine parameter was written
and every sent tensor was read by some loader. vLLM's loaders skip tensors silently (a name
its expert mapping does not know, an ignored suffix, an aliased tied head) and leave a
parameter with the dummy weights it started from when no name reaches it; either would make
the engine serve another model than the trainer's.

Two records per vLLM worker, joined by :func:`coverage_problem` over an engine's workers:

* **written**: the vLLM parameter names ``model.load_weights`` reports loaded (the set vLLM
  itself checks after a first load) plus the expert parameters ``megarl.engine.experts``
  wrote; a parameter in ``model.named_parameters()`` outside it was not written.
* **used**: the sent tensors a loader copied from. :class:`SourceTracker` watches
  ``Tensor.copy_`` / ``__setitem__`` while the loaders run and marks the sent tensor whose
  memory holds the source (loaders copy from views of it: TP slices, expert rows). A tensor
  is unused only if no worker of the engine used it (with vLLM's own expert parallelism a
  worker legitimately skips the experts it does not hold).

Granularity: one parameter, not one element: a q/k/v or gate/up part missing from a fused
parameter is not seen here (the manifest names every part, ``megarl.engine.staging``); a
missing expert is (``megarl.engine.experts.plan_experts``).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_SOURCE_ARG = {"copy_": 1, "__setitem__": 2}
"""The argument holding the source of each copying call (``dst.copy_(src)``, ``dst[i] = src``)."""


class SourceTracker(TorchFunctionMode):
    """Marks which of the tracked tensors were the source of a copy while the mode is on."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in named if t.numel() > 0
        )
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self.used: set[str] = set()

    def _mark(self, src: Any) -> None:
        if not isinstance(src, torch.Tensor) or src.numel() == 0 or src.device.type == "meta":
            return
        ptr = src.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._spans[i][1]:
            self.used.add(self._spans[i][2])

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        i = _SOURCE_ARG.get(getattr(func, "__name__", ""), -1)
        if 0 <= i < len(args):
            self._mark(args[i])
        return func(*args, **(kwargs or {}))


def coverage_report(
    params: list[str], written: set[str], sent: list[str], used: set[str], missing: list[str] | None = None
) -> dict[str, list[str]]:
    """One worker's record: the parameters it did not write, the sent tensors it did not use,
    and the expert tensors it lacked (then it wrote nothing)."""
    return {"unwritten": sorted(set(params) - written), "unused": sorted(set(sent) - used), "missing": missing or []}


def refusal(reports: list[dict[str, list[str]]], version: int) -> str:
    """'' unless a worker refused the update before writing anything (expert tensors missing).
    A refusal is a record, not an exception: with TP > 1, vLLM's multiprocess executor answers
    the next call with a worker's stale error after one worker raised (seen on vLLM 0.32)."""
    missing = sorted({n for r in reports for n in r.get("missing", [])})
    if not missing:
        return ""
    return (
        f"update {version} lacks {len(missing)} expert tensors of the engine's MoE layers, e.g. {missing[:4]}:"
        " nothing was written"
    )


def coverage_problem(reports: list[dict[str, list[str]]], version: int) -> str:
    """'' if every worker wrote every parameter and every sent tensor was used by some worker;
    else one message naming them (the first few of each)."""
    unwritten = sorted({n for r in reports for n in r["unwritten"]})
    unused = sorted(set.intersection(*(set(r["unused"]) for r in reports))) if reports else []
    parts = []
    if unwritten:
        parts.append(f"{len(unwritten)} engine parameters were not written: {unwritten[:6]}")
    if unused:
        parts.append(f"{len(unused)} sent tensors matched no engine parameter: {unused[:6]}")
    if not parts:
        return ""
    return (
        f"update {version} does not cover the engine's model ({'; '.join(parts)}); the trainer's HF names"
        " (megarl.checkpoint.hf_adapter) and the engine's model disagree"
    )
