"""Run megatron-core 0.16.x on a CPU-only torch build (gloo backend).

This is the ONLY place where megarl changes third-party behaviour. Everything here is
inert when CUDA is available: :func:`install` returns immediately.

megatron-core assumes CUDA in a handful of places (see ../shared/FACTS.md):

1. ``device="cuda"`` / integer device literals / ``tensor.cuda()`` in schedules, the
   optimizer, grad clipping, tensor-parallel mappings and dist_checkpointing.
   -> :class:`CudaToCpuMode`, a ``TorchFunctionMode`` that rewrites those devices to CPU.
2. ``torch.cuda.current_device()`` / ``torch.cuda.synchronize()`` (RoPE, mappings, p2p).
   -> replaced by CPU-safe functions while installed; the device is ``torch.device("cpu")``,
   which also holds in backward passes, where the mode of patch 1 is not active.
3. ``assert grad.type() == 'torch.cuda.FloatTensor'`` in grad clipping / optimizers.
   -> the mode reports fp32 CPU tensors with their CUDA type name.
4. The CUDA RNG tracker (``torch.cuda.get_rng_state``).
   -> :class:`CpuRNGStatesTracker`, a tracker over the CPU generator.
5. Not a CUDA assumption but a CPU cost: megatron's unfused RoPE (what runs without
   Transformer Engine) computes cos/sin, ``torch.cat``s a rotated copy and ``cat``s again
   with an empty pass-through part for every query and key of every layer, and autograd
   keeps each intermediate. -> :class:`RotateHalfRoPE`, the same rotation as one autograd
   function with no concatenation (forward + backward ~2.4× faster on a 50M model's
   q/k); interleaved and MLA layouts keep megatron's code.
6. Also a CPU cost, of glibc: every freed block over its mmap threshold (at most 32 MiB) goes
   back to the kernel, so each large activation or gradient that a step allocates faults its
   pages in again (~9k faults for one 16×268×2048 fp32 tensor). -> :func:`keep_freed_memory`
   (``parallel.cpu_keep_freed_memory``), glibc's ``mallopt`` told to serve every block from
   the heap and keep what is freed; the process then holds its peak, as a GPU caching
   allocator does.

7. CUDA streams and events in megatron's MoE alltoall token dispatcher (it copies the token
   counts to the host on a side stream, then waits on an event). -> ``torch.cuda.Stream`` /
   ``current_stream`` / ``stream`` replaced by :class:`CpuStream`, whose waits and events are
   no-ops: CPU work is already ordered.
8. The same dispatcher hands ``all_to_all_single`` its split sizes as host numpy arrays, made by
   ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` — which leaves a tensor already on the CPU
   as a tensor, and the gloo binding refuses a tensor there. -> :func:`_host_copy`, the same
   function returning the numpy array for CPU tensors too.

Each patch has its own test in ``tests/compat/test_cpu_compat.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
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
    """Redirect CUDA device requests to the CPU (patches 1 and 3 above).

    Not active inside backward passes: torch 2.13 dispatches ``torch.autograd.backward`` itself
    through the mode, and a mode is off while it handles a call, so the whole pass runs
    without it (re-entering it there only dispatches the call again). What megatron's autograd
    functions allocate in their backward uses ``torch.cuda.current_device()``: patch 2."""

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


class RotateHalfRoPE(torch.autograd.Function):
    """``t·cos + rotate_half(t)·sin`` with ``rotate_half(t) = [-t₂, t₁]``, in place of two
    ``cat``s: out₁ = t₁c₁ − t₂s₁, out₂ = t₂c₂ + t₁s₂. The map is linear in t, so the
    backward is its transpose: g_in₁ = g₁c₁ + g₂s₂, g_in₂ = g₂c₂ − g₁s₁."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = t.shape[-1] // 2
        out = t * cos
        out[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(t[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        grad = g * cos
        grad[..., :h].addcmul_(g[..., h:], sin[..., h:])
        grad[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1)
        return grad, None, None


def _rope_bshd(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> torch.Tensor:
    """Drop-in for megatron's ``_apply_rotary_pos_emb_bshd`` (patch 5)."""
    rot_dim = freqs.shape[-1]
    if rotary_interleaved or multi_latent_attention or rot_dim % 2:
        return _installed["rope_bshd"](t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    if rot_dim == t.shape[-1]:
        return RotateHalfRoPE.apply(t, cos, sin)
    rotated = RotateHalfRoPE.apply(t[..., :rot_dim], cos, sin)
    return torch.cat((rotated, t[..., rot_dim:]), dim=-1)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc malloc.h
_INT_MAX = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Patch 6: no mmap'd blocks and no trimming, so freed tensor memory is reused without page
    faults. Returns False (and changes nothing) where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt as a no-op)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def _current_device() -> torch.device:
    """The CPU itself, not CUDA device 0: an ``int`` device means ``cuda:<n>``, and megatron's
    backward passes (the MoE all-to-all, sequence parallelism's gathers) allocate with
    ``device=torch.cuda.current_device()`` where :class:`CudaToCpuMode` is not active."""
    return _CPU


class CpuEvent:
    """``torch.cuda.Event`` stand-in: CPU work is done when the call returns (patch 7)."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuStream:
    """``torch.cuda.Stream`` stand-in (patch 7): one ordered CPU stream, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = CpuStream()


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Patch 8: megatron's ``maybe_move_tensor_to_cpu`` for tensors that are on the CPU already."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _current_stream(device: Any = None) -> CpuStream:
    return _CPU_STREAM


def _stream_context(stream: Any) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def _synchronize(device: Any = None) -> None:
    return None


_CUDA_FUNCTIONS: dict[str, Any] = {
    "current_device": _current_device,  # patch 2
    "synchronize": _synchronize,
    "Stream": CpuStream,  # patch 7
    "Event": CpuEvent,
    "current_stream": _current_stream,
    "stream": _stream_context,
}
"""``torch.cuda`` attributes replaced while installed."""


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
    from megatron.core.models.common.embeddings import rope_utils

    for name, replacement in _CUDA_FUNCTIONS.items():
        _installed[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, replacement)
    _installed["rope_bshd"] = rope_utils._apply_rotary_pos_emb_bshd
    rope_utils._apply_rotary_pos_emb_bshd = _rope_bshd
    from megatron.core.transformer.moe import token_dispatcher

    _installed["host_copy"] = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    mode = CudaToCpuMode()
    mode.__enter__()
    _installed["mode"] = mode
    return True


def uninstall() -> None:
    """Undo :func:`install` (used by tests)."""
    if not _installed:
        return
    _installed["mode"].__exit__(None, None, None)
    for name in _CUDA_FUNCTIONS:
        setattr(torch.cuda, name, _installed[name])
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_bshd = _installed["rope_bshd"]
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _installed["host_copy"]
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


def model_parallel_cpu_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
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
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
