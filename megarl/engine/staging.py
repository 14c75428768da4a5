"""What an engine checks and holds while a weight update is assembled (between begin and
commit): the update manifest (every HF tensor name and shape the engine's model has), the
per-tensor checks (name known, shape and dtype as the manifest says, all finite) and the
:class:`Staged` record. Nothing here touches the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megarl.engine.wire import FLOAT_DTYPES
from megarl.errors import EngineError

MANIFEST = "weights_manifest.json"
"""HF name -> shape of every weight the engine expects, written beside config.json."""


@dataclass
class Staged:
    """One update being assembled (between begin and commit); nothing here touches the model."""

    version: int
    names: set[str] = field(default_factory=set)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Validated tensors, applied as they are when the workers share this process (TP=1)."""
    files: list[str] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    """Sources re-read by multiprocess workers (TP>1): tensors given to collective_rpc arrive
    corrupted there, files and safetensors bytes do not."""
    in_workers: bool = False
    """Staged inside the vLLM workers (NCCL / CUDA IPC) rather than in this process."""


def check_meta(manifest: dict[str, list[int]], name: str, shape: list[int], dtype: str, where: str = "") -> None:
    """Name, shape and dtype of one incoming tensor against the engine's manifest."""
    if name not in manifest:
        raise EngineError(f"tensor '{name}'{where} is not a weight of this model")
    if list(shape) != manifest[name]:
        raise EngineError(f"tensor '{name}' has shape {list(shape)}, engine expects {manifest[name]}")
    if dtype not in FLOAT_DTYPES:
        raise EngineError(f"tensor '{name}' has dtype {dtype}, expected float")


def check_tensor(manifest: dict[str, list[int]], name: str, t: torch.Tensor, where: str = "") -> None:
    check_meta(manifest, name, list(t.shape), str(t.dtype).removeprefix("torch."), where)
    if not all_finite(t):
        raise EngineError(f"tensor '{name}' contains NaN/Inf")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: its sum in float64 is finite exactly then (NaN and Inf propagate,
    Inf - Inf is NaN, and no float32/16 values can overflow a float64 sum). One reduction with
    no mask tensor: 0.13 ms against 0.71 for ``isfinite().all()`` over the demo model's 21."""
    return math.isfinite(float(t.sum(dtype=torch.float64)))
