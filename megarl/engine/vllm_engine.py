"""The vLLM side of an engine server: one ``LLM`` on token ids (``skip_tokenizer_init``; the
trainer owns the tokenizer), its generation in KV-cache-sized waves, prompt log-probs for the
integrity check, and sleep/wake for colocation. The staged weight updates of every transport
are ``megarl.engine.updates`` (its invariant: the engine never serves a half-updated model).

Invariant: every generation, log-prob pass, update commit and sleep/wake holds ``lock``, so
they never interleave; an engine whose vLLM holds requests it could not abort says so
(``failed``) and answers generation and ``/health`` with 503 until the fleet restarts it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from megarl.engine.cpu_sampler import CPU_SAMPLER_ENV, use_cpu_sampler
from megarl.engine.staging import MANIFEST, Staged
from megarl.engine.stepper import Call, EngineLock, Stepper
from megarl.engine.updates import WeightUpdates
from megarl.engine.wire import encode_generation
from megarl.engine.worker_ext import CPU_GEMM_ENV, EXTENSION, cpu_gemm_mode, use_plain_cpu_gemm
from megarl.errors import EngineError, EngineUnhealthy

log = logging.getLogger("megarl.engine")

TIME_MODEL_ENV = "MEGARL_ENGINE_TIME_MODEL"
"""``1``: every ``/generate`` reply also carries ``model_s``, the model's forward seconds."""


CPU_PREFILL_TOKENS = 16384
"""Scheduler budget (``max_num_batched_tokens``) of a CPU engine: a wave of seeded requests
must prefill in one step (see :func:`waves`); vLLM's CPU default is 4096 per TP rank."""

CPU_MAX_SEQS = 1024
"""Sequences a CPU engine runs at once (``max_num_seqs``; vLLM's CPU default is 256, a
serving latency choice): a GRPO round of 512 (the demo's 32 × 16) is one wave of seeded
requests, not two — per demo step 4 ms less model time (one forward over 512 rows, not two
over 256) and 3 ms less of vLLM's per-step work (docs/LOG.md, session 24). verl's rollout
default is 1024 as well."""


def kv_need(prompt_len: int, n: int, max_tokens: int, block_size: int) -> int:
    """KV-cache tokens ``n`` samples of a prompt may take: each to ``max_tokens``, in whole blocks."""
    return n * -(-(prompt_len + max_tokens) // block_size) * block_size


def waves(
    prompt_lens: list[int],
    n: int,
    max_tokens: int,
    block_size: int,
    kv_tokens: int,
    prefill: tuple[int, int] | None = None,
) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) prompt ranges that vLLM runs without preempting or chunking.

    vLLM preempts and recomputes sequences when the KV cache runs out, and splits a prompt's
    prefill over scheduler steps when the step's token budget runs out. Either way it then
    rewinds the request's random generator, which the CPU build cannot do for seeded
    requests ("CPU Generator does not use offset"), and a recompute is wasted work anyway.
    Every wave fits the KV cache (worst case: every sample runs to ``max_tokens``); with
    ``prefill = (max_num_batched_tokens, max_num_seqs)`` (seeded requests on CPU) each wave's
    ``n`` × prompt tokens also fit one step's budget and its sequences one step's batch, so
    all of them are prefilled in the first step. Per-request seeds keep the samples identical
    to one big call.
    """
    out: list[tuple[int, int]] = []
    lo, used, tokens = 0, 0, 0
    for i, plen in enumerate(prompt_lens):
        need = kv_need(plen, n, max_tokens, block_size)
        if need > kv_tokens:
            raise EngineError(
                f"prompt {i}: {n} samples × {plen + max_tokens} tokens need {need} KV tokens, the engine has"
                f" {kv_tokens}; raise rollout.kv_cache_gb or lower samples_per_prompt / max_response_len"
            )
        full = used + need > kv_tokens
        if prefill is not None:
            budget, max_seqs = prefill
            if n * plen > budget or n > max_seqs:
                raise EngineError(
                    f"prompt {i}: {n} seeded samples × {plen} prompt tokens cannot be prefilled in one step of"
                    f" the CPU engine ({budget} tokens, {max_seqs} sequences); lower samples_per_prompt /"
                    " max_prompt_len or set rollout.seeded=false"
                )
            full = full or tokens + n * plen > budget or (i - lo + 1) * n > max_seqs
        if full:
            out.append((lo, i))
            lo, used, tokens = i, 0, 0
        used += need
        tokens += n * plen
    if lo < len(prompt_lens):
        out.append((lo, len(prompt_lens)))
    return out


def token_lists(field: str, seqs: Any, vocab: int) -> list[list[int]]:
    """``seqs`` as non-empty lists of token ids in [0, ``vocab``), or EngineError naming the
    first bad one: vLLM indexes its embedding with them, and an id out of range fails inside
    its step loop, not at admission."""
    if not isinstance(seqs, list) or not seqs:
        raise EngineError(f"{field} must be a non-empty list of token-id lists, got {type(seqs).__name__}")
    for i, s in enumerate(seqs):
        if not isinstance(s, list) or not s:
            raise EngineError(f"{field}[{i}] must be a non-empty list of token ids")
        if not all(type(t) is int for t in s) or min(s) < 0 or (vocab > 0 and max(s) >= vocab):
            bad = next(t for t in s if type(t) is not int or t < 0 or (vocab > 0 and t >= vocab))
            raise EngineError(f"{field}[{i}] holds {bad!r}, not a token id in [0, {vocab})")
    return seqs


def sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token. ``FlatLogprobs`` with one entry per position (what
    ``logprobs=0`` gives: the sampled token only) is read as its flat list; anything else
    (a position with top-k entries, vLLM's list of dicts) is looked up position by position."""
    one_each = list(range(1, len(tokens) + 1))  # FlatLogprobs' position ends when each has one entry
    if getattr(logprobs, "end_indices", None) == one_each and logprobs.token_ids == tokens:
        return [float(x) for x in logprobs.logprobs]
    return [float(d[t].logprob) for d, t in zip(logprobs or [], tokens) if d is not None]


def _routes_of(c: Any) -> Any:
    if c.routed_experts is None:
        raise EngineError("vLLM returned no routed experts (enable_return_routed_experts)")
    return c.routed_experts


class VllmEngine(WeightUpdates):
    """One vLLM ``LLM`` on token ids: generation, prompt log-probs, staged weight updates, sleep."""

    def __init__(
        self,
        model_dir: str,
        tp: int,
        kv_cache_gb: float,
        seed: int,
        max_len: int,
        sleep_mode: bool = False,
        staging_dir: str = "",
        cpu_gemm: str = "auto",
        cpu_sampler: str = "batched",
        return_routes: bool = False,
    ) -> None:
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.staging_dir = Path(staging_dir) if staging_dir else None
        """The only folder ``/weights/load`` reads from (the run's private staging folder)."""
        manifest = json.loads((self.model_dir / MANIFEST).read_text())
        self.manifest: dict[str, list[int]] = manifest
        self.tp = tp
        on_cpu = not torch.cuda.is_available()
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        hidden = int(hf_config.get("hidden_size", 0))
        self.vocab = int(hf_config.get("vocab_size", 0))
        """Token ids a request may hold: [0, vocab) (vLLM indexes its embedding with them)."""
        self.failed = ""
        """Why a generation left vLLM with requests it could not abort: /health then answers 503
        and the fleet restarts the engine (it would otherwise loop on them, holding every request)."""
        self._before_vllm(on_cpu, hidden, cpu_gemm, cpu_sampler, return_routes)
        self.llm = LLM(
            model=str(self.model_dir),
            skip_tokenizer_init=True,
            load_format="dummy",
            enforce_eager=True,
            tensor_parallel_size=tp,
            distributed_executor_backend="uni" if tp == 1 else "mp",
            dtype="float32",
            seed=seed,
            max_model_len=max_len or None,
            kv_cache_memory_bytes=int(kv_cache_gb * (1 << 30)),
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,
            enable_sleep_mode=sleep_mode,
            max_num_batched_tokens=max(CPU_PREFILL_TOKENS, max_len) if on_cpu else None,
            max_num_seqs=CPU_MAX_SEQS if on_cpu else None,
            enable_return_routed_experts=return_routes,
        )
        # One worker in this very process: staged tensors are handed over without a copy.
        self.in_process = tp == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.sleep_mode = sleep_mode
        self.asleep: set[str] = set()
        self.version = -1
        self.lock = EngineLock()
        self.stepper = Stepper(self)
        """Joined calls (``"join": true``): continuous batching (``megarl.engine.stepper``)."""
        self.staged: Staged | None = None
        self.block_size, self.kv_tokens = self._kv_capacity(kv_cache_gb, tp)
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.cpu_prefill = (int(sched.max_num_batched_tokens), int(sched.max_num_seqs)) if on_cpu else None
        """Seeded requests on CPU must not be chunked or preempted: :func:`waves` sizes them."""
        self.time_model = os.environ.get(TIME_MODEL_ENV) == "1"
        """Report the model's forward seconds with each generation (benchmarks; adds an RPC)."""
        if self.time_model:
            self.llm.collective_rpc("megarl_model_seconds")  # installs the hooks
        threads = torch.get_num_threads()
        log.info(
            "KV cache: %d tokens (block size %d); torch threads %d; CPU GEMM %s; CPU sampler %s",
            self.kv_tokens,
            self.block_size,
            threads,
            self.cpu_gemm if on_cpu else "n/a",
            self.cpu_sampler,
        )

    def _before_vllm(self, on_cpu: bool, hidden: int, cpu_gemm: str, cpu_sampler: str, return_routes: bool) -> None:
        """What vLLM reads as it builds the model and its sampler, here and in its worker processes."""
        self.cpu_gemm = cpu_gemm_mode(cpu_gemm, hidden, on_cpu)
        if self.cpu_gemm == "plain":
            os.environ[CPU_GEMM_ENV] = "plain"
            use_plain_cpu_gemm()
        self.cpu_sampler = "n/a"
        if on_cpu:
            os.environ[CPU_SAMPLER_ENV] = cpu_sampler
            self.cpu_sampler = "batched" if use_cpu_sampler(cpu_sampler) else "vllm"
        self.return_routes = return_routes  # MoE routing replay from the engines: routes per sample
        if return_routes:  # vLLM returns routes from its V2 model runner only (Triton: GPU)
            if on_cpu:
                raise EngineError("--return-routes (algo.router_replay: rollout) needs vLLM's V2 runner: GPU only")
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"

    def _kv_capacity(self, kv_cache_gb: float, tp: int) -> tuple[int, int]:
        """(block size, KV-cache tokens) of this engine, as vLLM sized it."""
        cfg = self.llm.llm_engine.vllm_config
        bs = int(cfg.cache_config.block_size or 16)
        blocks = cfg.cache_config.num_gpu_blocks  # set by the in-process engine core
        if blocks:
            return bs, int(blocks) * bs
        hf = cfg.model_config.hf_config  # multi-process engine core: from the budget and the shapes
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * max(1, hf.num_key_value_heads // tp) * head_dim * 4
        return bs, int(kv_cache_gb * (1 << 30)) // per_token // bs * bs

    # -- generation ----------------------------------------------------------------
    def generate(self, req: dict[str, Any]) -> bytes:
        """Sample ``n`` responses per prompt; the reply is one binary frame (``wire.encode_generation``).
        ``"join": true`` runs the call in the engine's continuous batch (``megarl.engine.stepper``):
        it joins the requests already running and returns when its own end."""
        from vllm.inputs import TokensPrompt

        prompts = token_lists("prompts", req.get("prompts"), self.vocab)
        seeds = req.get("seeds") or [None] * len(prompts)
        want_logprobs = bool(req.get("logprobs", True))  # False: the samples' "logprobs" are []
        params = [self._sampling(req, s, want_logprobs) for s in seeds]
        n, max_tokens = int(req.get("n", 1)), int(req["max_tokens"])
        seeded = any(s is not None for s in seeds)
        parts = waves(  # (also refuses, naming it, a prompt no engine step could take)
            [len(p) for p in prompts],
            n,
            max_tokens,
            self.block_size,
            self.kv_tokens,
            prefill=self.cpu_prefill if seeded else None,
        )
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        if req.get("join"):  # (the stepper refuses it if the engine has failed)
            from vllm.sampling_params import RequestOutputKind

            for p in params:
                p.output_kind = RequestOutputKind.FINAL_ONLY  # (what LLM.generate asks for)
            need = [kv_need(len(p), n, max_tokens, self.block_size) for p in prompts]
            call = self.stepper.run(Call(inputs, params, need, [n * len(p) for p in prompts], n))
            return self._encode(call.version, call.outputs, {"engine_s": call.engine_s}, want_logprobs)
        if len(parts) > 1:
            log.info(
                "%d prompts × %d samples exceed the KV cache or step budget: %d waves", len(prompts), n, len(parts)
            )
        with self.lock:
            version = self.version
            if self.time_model:  # forwards since the last generation (integrity checks) do not count
                self.llm.collective_rpc("megarl_model_seconds")
            t0 = time.perf_counter()
            results = []
            for lo, hi in parts:
                results += self._run(inputs[lo:hi], params[lo:hi])
            timings = {"engine_s": time.perf_counter() - t0}
            if self.time_model:  # the model's forward only (the rest is vLLM's scheduling and sampling)
                timings["model_s"] = max(self.llm.collective_rpc("megarl_model_seconds"))
        return self._encode(version, results, timings, want_logprobs)

    @staticmethod
    def _sampling(req: dict[str, Any], seed: int | None, want_logprobs: bool) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=int(req.get("n", 1)),
            max_tokens=int(req["max_tokens"]),
            temperature=float(req.get("temperature", 1.0)),
            top_p=float(req.get("top_p", 1.0)),
            stop_token_ids=list(req.get("stop_token_ids", [])),
            logprobs=0 if want_logprobs else None,
            flat_logprobs=True,  # one list per request, not a dict + Logprob object per token
            seed=seed,
            ignore_eos=bool(req.get("ignore_eos", False)),
            min_tokens=int(req.get("min_tokens", 0)),
            detokenize=False,
        )

    def _encode(self, version: int, results: list[Any], timings: dict[str, float], want_logprobs: bool) -> bytes:
        outputs = []
        for r in results:
            group = []
            for c in r.outputs:
                tokens = list(c.token_ids)
                lp = sampled_logprobs(c.logprobs, tokens) if want_logprobs else []
                group.append({"token_ids": tokens, "logprobs": lp, "finish_reason": c.finish_reason})
                if self.return_routes:  # (prompt + response - 1, layers, top-k): every token the model was fed
                    group[-1]["routes"] = _routes_of(c)
            outputs.append(group)
        return encode_generation(version, outputs, timings)

    def logprobs(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            max_tokens=1, prompt_logprobs=0, temperature=float(req.get("temperature", 1.0)), detokenize=False
        )
        sequences = token_lists("sequences", req.get("sequences"), self.vocab)
        with self.lock:
            res = self._run([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], sp)
            version = self.version
        out = []
        for seq, r in zip(sequences, res):
            pl = r.prompt_logprobs or []
            out.append([float(d[t].logprob) for d, t in zip(pl[1:], seq[1:]) if d is not None])
        return {"version": version, "logprobs": out}

    def _run(self, prompts: list[Any], params: Any) -> list[Any]:
        """``LLM.generate`` (under the lock). A failure inside vLLM's step loop leaves its
        requests in the scheduler, and the next call would step them again: they are aborted,
        and an engine that still holds some is marked failed (503 until restarted)."""
        unhealthy = self.unhealthy()
        if unhealthy is not None:
            raise unhealthy
        try:
            return list(self.llm.generate(prompts, params, use_tqdm=False))
        except Exception as error:
            self.abort_all(error)
            raise

    def unhealthy(self) -> EngineUnhealthy | None:
        """The error every request gets once the engine has failed (503: the fleet restarts it)."""
        return EngineUnhealthy(f"engine failed ({self.failed}); it must be restarted") if self.failed else None

    def abort_all(self, error: BaseException) -> None:
        """After ``error`` inside vLLM's step loop: abort every request it holds (the next call
        would step them again); an engine that still holds some is marked failed."""
        engine, cause = self.llm.llm_engine, error
        try:
            if engine.has_unfinished_requests():
                engine.abort_request(list(getattr(engine.output_processor, "request_states", {})))
            stuck = engine.has_unfinished_requests()
        except Exception as abort_error:  # any failure here means: restart
            stuck, cause = True, abort_error
        if stuck:
            self.failed = f"{type(cause).__name__}: {cause}"
            log.error("vLLM holds requests it cannot abort after %s: reporting unhealthy", self.failed)

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Stop vLLM's processes: a TP > 1 engine runs its engine core and workers as child
        processes. An in-process engine (TP = 1) holds nothing its process's exit does not
        release, and its teardown (a full garbage collection) takes seconds: nothing to do."""
        if not self.in_process:
            self.llm.llm_engine.engine_core.shutdown()

    # -- colocation (vLLM sleep mode, CUDA only) --------------------------------------
    def sleep(self, req: dict[str, Any]) -> dict[str, Any]:
        """Offload weights to host memory and free the KV cache (level 1) while the trainer runs."""
        self._need_sleep_mode()
        with self.lock:
            if not self.asleep:
                self.llm.sleep(level=int(req.get("level", 1)))
                self.asleep = {"weights", "kv_cache"}
        return {"ok": True, "asleep": sorted(self.asleep)}

    def wake_up(self, req: dict[str, Any]) -> dict[str, Any]:
        """Re-allocate the given memory (``weights`` before a sync, ``kv_cache`` after it)."""
        self._need_sleep_mode()
        tags = [str(t) for t in req.get("tags") or ["weights", "kv_cache"]]
        unknown = sorted(set(tags) - {"weights", "kv_cache"})
        if unknown:
            raise EngineError(f"wake_up tags {unknown} unknown (valid: weights, kv_cache)")
        with self.lock:
            todo = [t for t in tags if t in self.asleep]
            if todo:
                self.llm.wake_up(tags=todo)
                self.asleep -= set(todo)
        return {"ok": True, "asleep": sorted(self.asleep)}

    def _need_sleep_mode(self) -> None:
        if not self.sleep_mode:
            raise EngineError("engine was started without --sleep-mode (needed for rollout.colocate)")
