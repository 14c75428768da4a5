"""Run megatron-core 0.16.x on a CPU-only torch build (gloo backend).

This is the ONLY place where megarl changes third-party behaviour. Everything here is
inert when CUDA is available: :func:`install` returns immediately.

megatron-core assumes CUDA in a handful of places (see ../shared/FACTS.md):

1. ``device="cuda"`` / integer device literals / ``tensor.cuda()`` in schedules, the
   optimizer, grad clipping, tensor-parallel mappings and dist_checkpointing.
   -> :class:`CudaToCpuMode`, a ``TorchFunctionMode`` that rewrites those devices to CPU.
2. ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()`` (RoPE, mappings, p2p).
   -> replaced by CPU-safe functions while installed.
3. ``assert grad.type() == 'torch.cuda.FloatTensor'`` in grad clipping / optimizers.
   -> the mode reports fp32 CPU tensors with their CUDA type name.
4. The CUDA RNG tracker (``torch.cuda.get_rng_state``).
   -> :class:`CpuRNGStatesTracker`, a tracker over the CPU generator.

Each patch has its own test in ``tests/compat/test_cpu_compat.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON = ("0.16.",)

_CPU = torch.device("cpu")
_installed: dict[str, Any] = {}


def _map_device(device: Any) -> Any:
    """Map any CUDA device spelling to the CPU; leave everything else as it is."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA device requests to the CPU (patches 1 and 3 above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _map_device(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def _current_device() -> int:
    return 0


def _synchronize(device: Any = None) -> None:
    return None


def install() -> bool:
    """Activate the CPU compatibility layer once per process. Returns True if active."""
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    import megatron.core

    version = getattr(megatron.core, "__version__", "")
    if not version.startswith(SUPPORTED_MEGATRON):
        raise RuntimeError(
            f"megarl.compat.cpu supports megatron-core {SUPPORTED_MEGATRON}, found {version}; "
            "re-verify each patch before widening the pin"
        )
    _installed["current_device"] = torch.cuda.current_device
    _installed["synchronize"] = torch.cuda.synchronize
    torch.cuda.current_device = _current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _synchronize  # type: ignore[assignment]
    mode = CudaToCpuMode()
    mode.__enter__()
    _installed["mode"] = mode
    return True


def uninstall() -> None:
    """Undo :func:`install` (used by tests)."""
    if not _installed:
        return
    _installed["mode"].__exit__(None, None, None)
    torch.cuda.current_device = _installed["current_device"]
    torch.cuda.synchronize = _installed["synchronize"]
    _installed.clear()


def is_installed() -> bool:
    return bool(_installed)


class CpuRNGStatesTracker:
    """Megatron's RNG tracker API (add / fork / get_states / set_states) on the CPU generator.

    Megatron forks a tensor-parallel RNG stream for dropout and weight init inside TP
    regions; on a CPU build the only generator is the default CPU one, so forking swaps its
    state in and out.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def model_parallel_cpu_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0) -> None:
    """CPU twin of ``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``.

    Same stream names and seed offsets as megatron, so runs are comparable across builds.
    """
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank)
