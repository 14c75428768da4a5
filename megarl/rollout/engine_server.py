"""One vLLM engine behind a small HTTP/JSON control protocol (stdlib only, no pickle).

Run as ``python -m megarl.rollout.engine_server --model DIR --port P``. The engine works on
token ids (``skip_tokenizer_init``): the trainer owns the tokenizer.

Endpoints (JSON in, JSON out):
  GET  /health                       -> {"ok", "version"}
  POST /generate   {"prompts": [[ids]], "n", "max_tokens", "temperature", "top_p",
                    "stop_token_ids", "seeds", "min_tokens"}  -> {"version", "outputs"}
  POST /logprobs   {"sequences": [[ids]]}       -> {"version", "logprobs": [[float]]}
  POST /weights/begin  {"version"}
  POST /weights/load   {"version", "files": [safetensors paths]}  (staged + validated)
  POST /weights/commit {"version"}   (applies all staged tensors at once, resets prefix cache)
  POST /weights/abort  {}
  POST /shutdown   {}

Invariant: the engine never serves a half-updated model. Tensors are staged and checked
(name known, shape and dtype as the manifest says, all finite) before anything touches the
model; commit applies the whole update in one ``reload_weights`` call while the request
lock is held, so no generation interleaves. A rejected update leaves the old version.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MANIFEST = "weights_manifest.json"
"""HF name -> shape of every weight the engine expects, written beside config.json."""

log = logging.getLogger("megarl.engine")


class EngineError(RuntimeError):
    pass


def _apply_weights(worker: Any, files: list[str], names: list[str]) -> int:
    """Runs inside each vLLM worker: load the named tensors from safetensors files."""
    from safetensors import safe_open

    wanted = set(names)

    def it():  # type: ignore[no-untyped-def]
        for f in files:
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    if k in wanted:
                        yield k, fh.get_tensor(k)

    worker.model_runner.reload_weights(weights_iterator=it(), is_checkpoint_format=True)
    return len(wanted)


def kv_waves(prompt_lens: list[int], n: int, max_tokens: int, block_size: int, kv_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) prompt ranges whose worst-case KV use fits the cache.

    vLLM preempts and recomputes sequences when the cache runs out; the CPU build then
    fails on seeded requests ("CPU Generator does not use offset"), and a recompute is
    wasted work anyway. Generating in waves that fit never preempts, and per-request
    seeds keep the samples identical to one big call.
    """
    waves: list[tuple[int, int]] = []
    lo, used = 0, 0
    for i, plen in enumerate(prompt_lens):
        need = n * -(-(plen + max_tokens) // block_size) * block_size
        if need > kv_tokens:
            raise EngineError(
                f"prompt {i}: {n} samples × {plen + max_tokens} tokens need {need} KV tokens, the engine has"
                f" {kv_tokens}; raise rollout.kv_cache_gb or lower samples_per_prompt / max_response_len"
            )
        if used + need > kv_tokens:
            waves.append((lo, i))
            lo, used = i, 0
        used += need
    if lo < len(prompt_lens):
        waves.append((lo, len(prompt_lens)))
    return waves


class Engine:
    def __init__(self, model_dir: str, tp: int, kv_cache_gb: float, seed: int, max_len: int) -> None:
        from vllm import LLM

        self.model_dir = Path(model_dir)
        manifest = json.loads((self.model_dir / MANIFEST).read_text())
        self.manifest: dict[str, list[int]] = manifest
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
        )
        self.version = -1
        self.lock = threading.Lock()
        self.staged_version: int | None = None
        self.staged: dict[str, str] = {}  # name -> file
        self.block_size, self.kv_tokens = self._kv_capacity(kv_cache_gb, tp)
        log.info("KV cache: %d tokens (block size %d)", self.kv_tokens, self.block_size)

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
    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = req["prompts"]
        seeds = req.get("seeds") or [None] * len(prompts)
        params = [
            SamplingParams(
                n=int(req.get("n", 1)),
                max_tokens=int(req["max_tokens"]),
                temperature=float(req.get("temperature", 1.0)),
                top_p=float(req.get("top_p", 1.0)),
                stop_token_ids=list(req.get("stop_token_ids", [])),
                logprobs=0,
                seed=s,
                ignore_eos=bool(req.get("ignore_eos", False)),
                min_tokens=int(req.get("min_tokens", 0)),
                detokenize=False,
            )
            for s in seeds
        ]
        n, max_tokens = int(req.get("n", 1)), int(req["max_tokens"])
        waves = kv_waves([len(p) for p in prompts], n, max_tokens, self.block_size, self.kv_tokens)
        if len(waves) > 1:
            log.info("%d prompts × %d samples exceed the KV cache: %d waves", len(prompts), n, len(waves))
        with self.lock:
            version = self.version
            results = []
            for lo, hi in waves:
                results += self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p)) for p in prompts[lo:hi]], params[lo:hi], use_tqdm=False
                )
        outputs = []
        for r in results:
            group = []
            for c in r.outputs:
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], c.token_ids) if d is not None]
                group.append({"token_ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason})
            outputs.append(group)
        return {"version": version, "outputs": outputs}

    def logprobs(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            max_tokens=1, prompt_logprobs=0, temperature=float(req.get("temperature", 1.0)), detokenize=False
        )
        with self.lock:
            res = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(s)) for s in req["sequences"]], sp, use_tqdm=False
            )
            version = self.version
        out = []
        for seq, r in zip(req["sequences"], res):
            pl = r.prompt_logprobs or []
            out.append([float(d[t].logprob) for d, t in zip(pl[1:], seq[1:]) if d is not None])
        return {"version": version, "logprobs": out}

    # -- weights -------------------------------------------------------------------
    def begin(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.staged_version = int(req["version"])
            self.staged = {}
        return {"ok": True}

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        from safetensors import safe_open

        version = int(req["version"])
        if self.staged_version != version:
            raise EngineError(f"load for version {version} without begin (staged: {self.staged_version})")
        staged: dict[str, str] = {}
        for f in req["files"]:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    if name not in self.manifest:
                        raise EngineError(f"tensor '{name}' in {f} is not a weight of this model")
                    t = fh.get_tensor(name)
                    want = self.manifest[name]
                    if list(t.shape) != want:
                        raise EngineError(f"tensor '{name}' has shape {list(t.shape)}, engine expects {want}")
                    if not t.is_floating_point():
                        raise EngineError(f"tensor '{name}' has dtype {t.dtype}, expected float")
                    if not bool(t.isfinite().all()):
                        raise EngineError(f"tensor '{name}' contains NaN/Inf")
                    staged[name] = f
        with self.lock:
            self.staged.update(staged)
        return {"ok": True, "staged": len(self.staged)}

    def commit(self, req: dict[str, Any]) -> dict[str, Any]:
        version = int(req["version"])
        with self.lock:
            if self.staged_version != version:
                raise EngineError(f"commit for version {version}, staged {self.staged_version}")
            missing = sorted(set(self.manifest) - set(self.staged))
            if missing:
                raise EngineError(f"update {version} incomplete: missing {missing[:5]} ({len(missing)} tensors)")
            files = sorted(set(self.staged.values()))
            t0 = time.perf_counter()
            self.llm.collective_rpc(_apply_weights, args=(files, sorted(self.staged)))
            self.llm.reset_prefix_cache()
            self.version = version
            self.staged, self.staged_version = {}, None
        return {"ok": True, "version": version, "apply_s": time.perf_counter() - t0}

    def abort(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.staged, self.staged_version = {}, None
        return {"ok": True, "version": self.version}


def make_handler(engine: Engine, stop: threading.Event) -> type[BaseHTTPRequestHandler]:
    routes = {
        "/generate": engine.generate,
        "/logprobs": engine.logprobs,
        "/weights/begin": engine.begin,
        "/weights/load": engine.load,
        "/weights/commit": engine.commit,
        "/weights/abort": engine.abort,
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet access log
            log.debug(fmt, *args)

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                self._send(200, {"ok": True, "version": engine.version, "pid": os.getpid()})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", "0"))
            try:
                req = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as e:
                self._send(400, {"error": f"bad JSON: {e}"})
                return
            if self.path == "/shutdown":
                self._send(200, {"ok": True})
                stop.set()
                return
            fn = routes.get(self.path)
            if fn is None:
                self._send(404, {"error": f"no route {self.path}"})
                return
            try:
                self._send(200, fn(req))
            except EngineError as e:
                self._send(409, {"error": str(e)})
            except Exception as e:  # engine-side failure: report it, keep serving if alive
                log.exception("request %s failed", self.path)
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="megarl vLLM engine server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[engine:%(process)d] %(message)s")
    # SLURM signals every process of a step (e.g. --signal=USR1 before the time limit) so
    # the trainer can checkpoint; the engine must keep serving while it finishes the step.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if args.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = Engine(args.model, args.tp, args.kv_cache_gb, args.seed, args.max_model_len)
    stop = threading.Event()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, stop))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log.info("engine ready on %s:%d", args.host, args.port)
    sys.stdout.flush()
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
