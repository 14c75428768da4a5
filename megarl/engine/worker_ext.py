"""How weights enter a vLLM worker: a worker extension (``LLM(worker_extension_cls=...)``).

vLLM mixes this class into its worker, so ``llm.collective_rpc("megarl_...")`` runs these
methods on every worker of one engine (all TP ranks). Every update is ONE call with HF
names, so fused targets (q/k/v, gate/up) stay together, written by
``megarl.engine.loading.apply_update``: ``model.load_weights`` in place (``--cpu-gemm plain``)
or vLLM's layer-wise reload, routed experts in their kernel layout (never through either),
and a coverage record returned to the engine (every parameter written, every tensor used).

Sources, by transport:
  in-process tensors  ``megarl_apply``          engine server and worker share a process (TP=1)
  files / bytes       ``megarl_apply_sources``  shm (safetensors files) and http (safetensors
                                                bytes) with multiprocess workers (TP>1)
  NCCL broadcast      ``megarl_nccl_init`` + ``megarl_nccl_receive`` (staged here until commit)
  CUDA IPC            ``megarl_ipc_receive`` (views of the trainer's buffer, staged until commit)
Staged NCCL/IPC tensors are applied by ``megarl_apply_staged`` (commit) or dropped by
``megarl_drop_staged`` (abort); nothing touches the model before commit.

Method names carry a ``megarl_`` prefix: vLLM refuses an extension that shadows a worker
attribute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from megarl.engine import wire
from megarl.engine.cpu_sampler import CPU_SAMPLER_ENV, CPU_SAMPLERS, use_cpu_sampler
from megarl.engine.loading import apply_update
from megarl.engine.staging import all_finite
from megarl.errors import EngineError

CPU_GEMMS = ("auto", "packed", "plain")
"""The values of ``rollout.cpu_gemm`` / ``--cpu-gemm`` (see :func:`cpu_gemm_mode`)."""

PLAIN_GEMM_MAX_HIDDEN = 256
"""``cpu_gemm=auto`` keeps a CPU engine's weights plain up to this hidden size: there a packed
oneDNN GEMM decodes no faster than ``F.linear`` (0.4-1.05x its time at 128-256 wide layers, 8-256
rows) and every update would pay vLLM's layer-wise reload; from 512 wide packing is 1.1-1.5x
faster (docs/LOG.md, 2026-12-05)."""


def cpu_gemm_mode(requested: str, hidden_size: int, on_cpu: bool) -> str:
    """The GEMM a CPU engine's linear layers use: ``packed`` (vLLM's oneDNN/SGL kernels, its
    default) or ``plain`` (``F.linear`` on the parameters, updated by a copy in place);
    ``auto`` picks plain up to :data:`PLAIN_GEMM_MAX_HIDDEN`. A GPU engine: ``packed`` (the
    choice does not exist there; weights are always its parameters)."""
    if requested not in CPU_GEMMS:
        raise EngineError(f"cpu_gemm {requested!r} unknown ({', '.join(CPU_GEMMS)})")
    if not on_cpu:
        return "packed"
    if requested == "auto":
        return "plain" if hidden_size <= PLAIN_GEMM_MAX_HIDDEN else "packed"
    return requested


EXTENSION = "megarl.engine.worker_ext.MegarlWorkerExtension"

CPU_GEMM_ENV = "MEGARL_CPU_GEMM"
"""``plain``: this process's vLLM keeps CPU linear weights as tensors (set by the engine for
its worker processes, which import this module before they build the model)."""


def use_plain_cpu_gemm() -> None:
    """From here on vLLM's CPU linear layers (and the LM head) compute ``F.linear`` on their
    own weight instead of packing it into a oneDNN/SGL kernel and dropping it.

    vLLM picks a CPU GEMM per layer after loading (``dispatch_cpu_unquantized_gemm``, imported
    by the layers at that moment, so replacing the module attribute reaches them). Packed, an
    update must go through the layer-wise reload (6.9 ms for the demo model against 0.6 ms
    for a copy); plain, decoding is as fast for layers up to ~256 wide and slower for wider ones
    (:data:`PLAIN_GEMM_MAX_HIDDEN`). Idempotent; call it before the model is built."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "megarl_plain", False):
        return
    packed = utils.dispatch_cpu_unquantized_gemm

    def plain(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.ndim != 2 or weight.is_meta:
            packed(layer, remove_weight)  # not a dense 2-D weight (conv, MoE experts): vLLM's way
            return
        layer.cpu_linear = torch.nn.functional.linear

    plain.megarl_plain = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = plain


if os.environ.get(CPU_GEMM_ENV) == "plain":  # a worker process of a TP > 1 CPU engine
    use_plain_cpu_gemm()
if os.environ.get(CPU_SAMPLER_ENV) in CPU_SAMPLERS:  # likewise, for its sampler
    use_cpu_sampler(os.environ[CPU_SAMPLER_ENV])


def _non_finite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    return [n for n, t in named if not all_finite(t)]


class MegarlWorkerExtension:
    _megarl_group: Any = None
    _megarl_staged: list[tuple[str, torch.Tensor]] | None = None
    _megarl_buffers: list[torch.Tensor] | None = None
    _megarl_clock: dict[str, Any] | None = None

    # -- CPU sources ------------------------------------------------------------------
    def megarl_apply(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
        """Apply tensors handed over in this process; the coverage record (``megarl.engine.loading``)."""
        return apply_update(self, named)

    def megarl_apply_sources(self, files: list[str], blobs: list[bytes], names: list[str]) -> dict[str, list[str]]:
        """Read safetensors files and byte buffers again in this worker process (TP>1)."""
        from safetensors import safe_open
        from safetensors.torch import load

        wanted = set(names)

        def it() -> Iterator[tuple[str, torch.Tensor]]:
            for f in files:
                with safe_open(f, framework="pt") as fh:
                    for k in fh.keys():
                        if k in wanted:
                            yield k, fh.get_tensor(k)
            for b in blobs:
                yield from ((k, t) for k, t in load(b).items() if k in wanted)

        return apply_update(self, it())

    # -- GPU sources (staged in the worker until commit) --------------------------------
    def megarl_nccl_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> int:
        """Join the trainer's broadcast group (trainer = rank 0); blocks until all ranks join."""
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank + rank_offset
        self._megarl_group = nccl_group(master_address, master_port, rank, world_size, self.device)  # type: ignore[attr-defined]
        return rank

    def megarl_nccl_receive(self, records: list[dict[str, Any]], nbytes: int) -> list[str]:
        """Receive one bucket's flat buffer from rank 0; stage its views; return non-finite names."""
        if self._megarl_group is None:
            raise RuntimeError("NCCL weight group not initialised (POST /weights/nccl_init first)")
        buf = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)  # type: ignore[attr-defined]
        self._megarl_group.broadcast(buf, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        return self._megarl_stage(buf, records)

    def megarl_ipc_receive(self, handle: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
        """Open the trainer's shared CUDA buffer (no copy); stage its views; return non-finite names."""
        return self._megarl_stage(wire.open_cuda(handle), records)

    def _megarl_stage(self, buf: torch.Tensor, records: list[dict[str, Any]]) -> list[str]:
        named = wire.unflatten(buf, records)
        if self._megarl_staged is None or self._megarl_buffers is None:
            self._megarl_staged, self._megarl_buffers = [], []
        self._megarl_buffers.append(buf)
        self._megarl_staged.extend(named)
        return _non_finite(named)

    def megarl_apply_staged(self) -> dict[str, list[str]]:
        try:
            return apply_update(self, self._megarl_staged or [])
        finally:
            torch.cuda.synchronize()  # the trainer may reuse its IPC buffers once commit returns
            self.megarl_drop_staged()

    def megarl_drop_staged(self) -> None:
        self._megarl_staged, self._megarl_buffers = None, None

    # -- diagnostics --------------------------------------------------------------------
    def megarl_model_seconds(self) -> float:
        """Seconds spent in the model's forward since the last call (the first call installs
        the two forward hooks and returns 0). ``MEGARL_ENGINE_TIME_MODEL=1`` only: the
        benchmarks split a generation into model compute and everything around it. Wall
        time, so exact on CPU; on CUDA the forward is asynchronous and this undercounts."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        clock = self._megarl_clock
        if clock is None:
            clock = self._megarl_clock = {"total": 0.0, "starts": []}
            model.register_forward_pre_hook(lambda m, a: clock["starts"].append(time.perf_counter()))

            def done(m: Any, a: Any, out: Any) -> None:
                clock["total"] += time.perf_counter() - clock["starts"].pop()

            model.register_forward_hook(done)
        total, clock["total"] = clock["total"], 0.0
        return float(total)


def nccl_group(master_address: str, master_port: int, rank: int, world_size: int, device: Any) -> Any:
    """vLLM's recipe for a trainer↔engine group: StatelessProcessGroup + PyNcclCommunicator.

    Used on both sides (the trainer is rank 0 and hosts the rendezvous store). vLLM pins some
    NCCL_* variables for its own groups; both sides join without them when vLLM offers that.
    """
    import contextlib

    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    try:
        from vllm.utils.nccl import unpinned_nccl_env

        env: Any = unpinned_nccl_env()
    except ImportError:
        env = contextlib.nullcontext()
    pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    with env:
        return PyNcclCommunicator(pg, device=device)
