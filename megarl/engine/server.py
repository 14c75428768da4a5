"""One vLLM engine behind a small HTTP/JSON control protocol (stdlib only, no pickle).

Run as ``python -m megarl.engine.server --model DIR --port P``. The engine works on
token ids (``skip_tokenizer_init``): the trainer owns the tokenizer.

Endpoints (JSON in, JSON out, except the weight bytes and the generation frame; every one but
/hello needs the run's credential, see ``megarl.engine.http`` for the route table, limits and lifeline):
  GET  /hello?nonce=N                -> {"port", "proof"}   (no credential: the engine proves it holds it)
  GET  /health                       -> {"ok", "version"}   (liveness + weight version only)
  GET  /info                         -> {"ok", "version", "pid", "tp", "asleep", "lease_s"}
  POST /generate   {"prompts": [[ids]], "n", "max_tokens", "temperature", "top_p",
                    "stop_token_ids", "seeds", "min_tokens", "ignore_eos", "logprobs", "join"?}
                   -> one binary frame: version, ids, log-probs, finish reasons, engine seconds
                   (``megarl.engine.wire``); ``join``: run in the continuous batch
                   (``megarl.engine.stepper``), returning when this call's requests end
  POST /logprobs   {"sequences": [[ids]]}       -> {"version", "logprobs": [[float]]}
  POST /heartbeat  {}                           (keeps the lease; the fleet sends it)
  POST /weights/begin  {"version"}
  POST /weights/load   {"version", "files": [safetensors paths inside --staging-dir],
                        "begin"?, "commit"?}  shm (begin / commit: that too, in the same request)
  POST /weights/load_bytes?version=V   body: safetensors bytes        http transport
                   (Content-Type: application/octet-stream)
  POST /weights/check  {"tensors": [{"name", "shape", "dtype"}]}     before NCCL / IPC data
  POST /weights/nccl_init {"master_address", "master_port", "rank_offset", "world_size"}
  POST /weights/nccl_load {"version", "tensors": [records], "nbytes"} nccl transport
  POST /weights/ipc_load  {"version", "tensors": [records], "handle"} cuda_ipc transport
  POST /weights/commit {"version"}   (applies all staged tensors at once, resets prefix cache)
  POST /weights/abort  {}
  POST /sleep      {"level"}         (``--sleep-mode`` only: vLLM sleep mode, CUDA)
  POST /wake_up    {"tags": ["weights"] | ["kv_cache"]}
  POST /shutdown   {}
(records: ``megarl.engine.wire``; workers: ``megarl.engine.worker_ext``.)

The engine itself (generation, sleep) is ``megarl.engine.vllm_engine``, its weight updates
(staging, commit) ``megarl.engine.updates``; this module parses the command line, checks the
credential and staging folder, and serves.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megarl.compat.startup import startup
from megarl.engine.connections import EngineHTTPServer
from megarl.engine.cpu_sampler import CPU_SAMPLERS
from megarl.engine.credentials import STAGING_ENV, TOKEN_ENV, env_token, private_dir_problem
from megarl.engine.http import Lifeline, Limits, make_handler
from megarl.engine.staging import MANIFEST
from megarl.engine.vllm_engine import VllmEngine
from megarl.engine.worker_ext import CPU_GEMMS
from megarl.errors import CredentialError

__all__ = ["MANIFEST", "main"]

log = logging.getLogger("megarl.engine")


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def _wait_for(path: Path, stop: threading.Event, timeout_s: float) -> bool:
    """True once ``path`` exists (the trainer renames it into place whole), False after
    ``timeout_s`` or when ``stop`` is set (the trainer is gone)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if stop.wait(0.05) or time.monotonic() > deadline:
            return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The engine's command line (see the module docstring for what it serves)."""
    ap = argparse.ArgumentParser(description="megarl vLLM engine server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--sleep-mode", action="store_true", help="vLLM sleep mode for colocation (CUDA only)")
    ap.add_argument(
        "--return-routes",
        action="store_true",
        help="MoE: return each sample's routed experts (algo.router_replay: rollout; vLLM's V2 runner, GPU only)",
    )
    ap.add_argument(
        "--cpu-gemm",
        choices=CPU_GEMMS,
        default="auto",
        help="CPU engines: vLLM's packed oneDNN GEMMs, or plain F.linear (updates are a copy in place); "
        "auto: plain up to hidden size 256",
    )
    ap.add_argument(
        "--cpu-sampler",
        choices=CPU_SAMPLERS,
        default="batched",
        help="CPU engines: seeded rows' noise seeds hashed from (seed, draw) for all rows at once, "
        "or vLLM's per-row generator draws (stock tokens)",
    )
    ap.add_argument(
        "--staging-dir",
        default=os.environ.get(STAGING_ENV, ""),
        help=f"the only folder /weights/load reads (default ${STAGING_ENV}; unset: /weights/load is off)",
    )
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the trainer) is gone")
    ap.add_argument("--lease-s", type=float, default=0.0, help="exit after this long without a request (0: off)")
    ap.add_argument("--max-json-mb", type=float, default=64.0, help="largest JSON request body, MiB")
    ap.add_argument(
        "--wait-for-model",
        type=float,
        default=0.0,
        help="seconds to wait for --model's weights_manifest.json (written last by the trainer), "
        "importing vLLM meanwhile (0: it must exist now; inf: while --parent-pid lives)",
    )
    return ap.parse_args(argv)


def _credential() -> str:
    """The run's credential, taken out of the environment ('' after logging why there is none)."""
    try:
        token = env_token()
    except CredentialError as e:
        log.error("%s", e)
        return ""
    if not token:
        log.error(
            "no credential: set MEGARL_ENGINE_TOKEN_FILE (a 0600 file) or MEGARL_ENGINE_TOKEN; see README 'Security'"
        )
        return ""
    os.environ.pop(TOKEN_ENV, None)  # vLLM's worker processes need not inherit it
    return token


def _staging_ok(args: argparse.Namespace) -> bool:
    """False (logged) for a staging folder that is not private; one this node does not see
    turns ``/weights/load`` off (``args.staging_dir`` = '')."""
    if args.staging_dir:
        problem = private_dir_problem(Path(args.staging_dir))
        if problem and not Path(args.staging_dir).exists():  # e.g. MEGARL_STAGING_DIR of another node
            log.warning("%s: /weights/load is off (weights come over http)", problem)
            args.staging_dir = ""
        elif problem:
            log.error("%s", problem)
            return False
    return True


def _start_engine(args: argparse.Namespace, stop: threading.Event) -> VllmEngine | int:
    """Import vLLM, wait for the model folder if asked, build the engine; or the exit code
    (3: the trainer went away meanwhile, 2: the folder never came)."""
    with startup():  # vLLM's heap, frozen: collections while the engine is built skip it
        import vllm  # noqa: F401  (seconds of imports, done while the trainer writes the folder)
    if args.wait_for_model > 0 and not _wait_for(Path(args.model) / MANIFEST, stop, args.wait_for_model):
        if not stop.is_set():
            log.error(
                "no %s after %.0f s: the trainer writes it as it starts (did it start? does this "
                "node see the trainer's run folder, a shared filesystem?)",
                Path(args.model) / MANIFEST,
                args.wait_for_model,
            )
        return 3 if stop.is_set() else 2
    return VllmEngine(
        args.model,
        args.tp,
        args.kv_cache_gb,
        args.seed,
        args.max_model_len,
        args.sleep_mode,
        args.staging_dir,
        args.cpu_gemm,
        args.cpu_sampler,
        args.return_routes,
    )


def _serve(
    args: argparse.Namespace, engine: VllmEngine, token: str, lifeline: Lifeline, stop: threading.Event, lost: list[str]
) -> int:
    """Serve until ``/shutdown`` or the lifeline stops it; the exit code (3: the trainer is gone)."""
    limits = Limits.for_manifest(engine.manifest, int(args.max_json_mb * (1 << 20)))
    server = EngineHTTPServer((args.host, args.port), make_handler(engine, stop, token, limits, lifeline))
    # a short poll: shutdown() waits up to one interval (the default 0.5 s, at every run's end)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    log.info("engine ready on %s:%d", args.host, args.port)
    sys.stdout.flush()
    stop.wait()
    server.shutdown()
    if lost:  # the trainer is gone: if vLLM's teardown hangs, do not linger
        threading.Thread(target=_exit_after, args=(30.0, 3), daemon=True).start()
    engine.close()
    return 3 if lost else 0


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 shut down, 2 refused to start (credential, staging folder, no model),
    3 the trainer went away."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[engine:%(process)d] %(message)s")
    token = _credential()
    if not token or not _staging_ok(args):
        return 2
    # SLURM signals every process of a step (e.g. --signal=USR1 before the time limit) so
    # the trainer can checkpoint; the engine must keep serving while it finishes the step.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if args.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    lifeline = Lifeline(args.parent_pid, args.lease_s)
    stop, lost = threading.Event(), list[str]()
    lifeline.watch(stop, lost)  # from here on: a trainer that dies during the load ends the engine too
    engine = _start_engine(args, stop)
    if isinstance(engine, int):
        return engine
    if stop.is_set():
        return 3
    return _serve(args, engine, token, lifeline, stop, lost)


if __name__ == "__main__":
    from megarl.compat.exit import exit_now

    exit_now(main())  # vLLM's finalizers and a full GC at exit take seconds (compat/exit.py)
