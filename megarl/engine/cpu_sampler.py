"""Seeded sampling on a CPU engine without a Python call into each request's generator.

vLLM's CPU sampler (``TopKTopPSampler.forward_cpu``) draws one 31-bit seed per row and
decode step, and ``fused_gumbel_argmax`` turns (seed, token id) into independent Gumbel
noise with SplitMix64. A row with its own seed gets that seed from its ``torch.Generator``:
``torch.randint(generator=g).item()`` plus a tensor item write, ~3.5 us per row, so ~0.9 ms
of every decode step at 256 seeded rows (~10 ms of a demo generation, docs/LOG.md).

``batched`` derives the same kind of seed from what identifies a draw, without touching the
generator's state: the request's seed (``Generator.initial_seed()``, 0.03 us) and how many
draws this request has made, hashed with SplitMix64 over all rows at once in numpy. What stays
true: a seeded request's tokens depend only on its seed and the logits it sees, not on which
other requests share its batch or engine; every (request, step) draw has its own stream. What
changes: the tokens are not those stock vLLM draws for the same seed (another stream).

The draw count lives in a weak map keyed by the generator vLLM keeps for the request's whole
life (its ``CachedRequestState``), so it survives the request leaving the batch (preemption)
and goes away with the request.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CPU_SAMPLER_ENV = "MEGARL_CPU_SAMPLER"
"""``batched``: this process's vLLM draws seeded rows' noise seeds with :func:`draw_seeds`
(set by the engine for its worker processes, which import this module before they sample)."""

CPU_SAMPLERS = ("batched", "vllm")
"""The values of ``rollout.cpu_sampler`` / ``--cpu-sampler``."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``x + golden`` (uint64 arithmetic wraps mod 2**64)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def draw_seeds(seeds: list[int], draws: list[int]) -> torch.Tensor:
    """The 31-bit noise seed of each (request seed, draw index) pair, as int64 (the range of
    vLLM's own per-step seeds: ``fused_gumbel_argmax`` hashes them again with the token id)."""
    s = np.asarray(seeds, dtype=np.uint64)
    d = np.asarray(draws, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = splitmix64(splitmix64(s) ^ d)
    return torch.from_numpy((mixed >> np.uint64(33)).astype(np.int64))


_mode = "vllm"


def use_cpu_sampler(mode: str) -> bool:
    """From here on vLLM's CPU samplers built in this process seed their seeded rows with
    :func:`draw_seeds` (``batched``) or vLLM's per-row generator draws (``vllm``). Call it
    before vLLM builds its model runner (the sampler binds its method then). Returns whether
    ``batched`` is in effect: False where this vLLM has no fused CPU sampler."""
    global _mode
    if mode not in CPU_SAMPLERS:
        raise ValueError(f"cpu_sampler {mode!r} unknown ({', '.join(CPU_SAMPLERS)})")
    _mode = mode
    return mode == "batched" and _install()


def _install() -> bool:
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C, the fused sampler among them)
        from vllm.v1.sample.ops import topk_topp_sampler as tts
    except ImportError:  # pragma: no cover - vLLM is a dependency
        return False
    cls = getattr(tts, "TopKTopPSampler", None)
    stock = getattr(cls, "forward_cpu", None)
    if cls is None or stock is None or not hasattr(torch.ops._C, "fused_gumbel_argmax"):
        log.warning("vLLM has no fused CPU sampler here: seeded rows keep vLLM's per-row draws")
        return False
    if getattr(stock, "megarl_batched", False):
        return True
    counts: weakref.WeakKeyDictionary[torch.Generator, int] = weakref.WeakKeyDictionary()

    def forward_cpu(
        self: Any,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _mode != "batched" or not generators or self.use_fp64_gumbel:
            return stock(self, logits, generators, k, p)
        logits = tts.apply_top_k_top_p(logits, k, p)
        logits_to_return = None
        if self.logprobs_mode == "processed_logits":
            logits_to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
        batch = logits.shape[0]
        rows = list(generators)
        req_seeds, draws = [], []
        for gen in generators.values():
            n = counts.get(gen, 0)
            counts[gen] = n + 1
            req_seeds.append(gen.initial_seed())
            draws.append(n)
        mine = draw_seeds(req_seeds, draws)
        if len(rows) == batch and rows == list(range(batch)):
            seeds = mine
        else:  # unseeded rows draw from the global generator, as vLLM does
            seeds = torch.randint(0, 2**31, (batch,), dtype=torch.long)
            seeds[torch.tensor(rows, dtype=torch.long)] = mine
        return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), seeds), logits_to_return

    forward_cpu.megarl_batched = True  # type: ignore[attr-defined]
    cls.forward_cpu = forward_cpu
    return True
