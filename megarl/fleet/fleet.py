"""The generation fleet: N vLLM engine servers (local subprocesses or remote addresses).

The trainer's rank 0 owns the fleet. Prompts are dispatched to balance outstanding tokens
across engines (not round-robin); each engine's share is sent concurrently. If an engine
dies mid-generation, its prompts are re-issued to the surviving engines (or to the engine
after it is restarted and given the current weights), so a step always completes with the
planned number of samples; the event is logged and counted in ``fleet.restarts``.

Engines can die at any other moment too. One found dead before a generation or an update
(``recover``: process exited, or silent on /health when it has not answered for ``fresh_s``)
is restarted first. During an update (begin / load / commit) a connection-level failure
(``EngineDead``) does not fail the update: the engine is marked down, the others carry on,
and when the update commits the dead ones are restarted and replay *that* version (or, if
the update was rejected, the previous one); then every engine must report the same version.
A rejection (engine alive, says no) still aborts everywhere and raises ``WeightSyncError``.
Remote engines (no launch command) cannot be restarted: their death is an error naming the
engine and its address.

Weight updates go to every engine as begin → load (all engines) → commit (all engines);
a load rejected by any engine aborts the update everywhere, so the whole fleet keeps
serving the previous version. From safetensors files (shm) the load request also opens the
update, and with one engine it commits too: one round trip instead of three. The primitives
(``begin_update``, ``load_files``, ``load_bytes``, ``post_all``, ``commit_update``,
``abort_update``) are driven by a weight-sync transport (``megarl.weight_sync.transports``);
``update_weights`` is the whole sequence from safetensors files. A restarted engine is brought
to the current weights by the replay the last transport registered (``set_replay``).

Every request carries the run's credential (``megarl.engine.credentials``); engines started
here get it through their environment, a private staging folder for shm weight files, the
trainer's pid (they exit when it is gone) and a lease kept alive by a heartbeat thread.

Colocated runs (``rollout.colocate``) put the engines to sleep while the trainer uses the
GPUs and wake them in two steps around a sync (``sleep`` / ``wake_up``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.engine import routes
from megarl.engine.credentials import STAGING_ENV, TOKEN_ENV, env_token, make_staging_dir, new_token
from megarl.errors import EngineDead, RolloutError
from megarl.fleet import faults
from megarl.fleet.client import EngineClient, free_port
from megarl.fleet.restarts import Restarts
from megarl.fleet.updates import WeightUpdates, concurrently

log = logging.getLogger("megarl.fleet")


class Fleet(Restarts, WeightUpdates):
    def __init__(self, engines: list[EngineClient], request_timeout_s: float, start_timeout_s: float) -> None:
        self.engines = engines
        self.timeout = request_timeout_s
        self.start_timeout = start_timeout_s
        self._init_restarts()
        self.reissued_prompts = 0
        self._replay: Callable[[list[EngineClient]], None] | None = None
        self.version = -1
        """The last weight version committed by any engine (-1: none yet)."""
        self.down: set[str] = set()
        """Engines that failed at the connection level during the current update."""
        self._starting = False  # spawned by start_local(wait=False), not yet known healthy
        self.staging_dir: Path | None = None
        """Private folder the engines read shm weight files from (None: http only)."""
        self._own_staging = False  # made by start_local: removed at shutdown
        self._beating = threading.Event()  # set: the heartbeat thread stops
        self.timings: dict[str, float] = {}
        """Seconds of the generations since :meth:`pop_timings` (see there)."""
        self.fresh_s = 5.0
        """Seconds an engine's last answer vouches for it (:meth:`recover` skips its /health)."""

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start_local(
        cls,
        model_dir: str | Path,
        num_engines: int,
        engine_tp: int,
        kv_cache_gb: float,
        log_dir: str | Path,
        seed: int,
        request_timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        sleep_mode: bool = False,
        wait: bool = True,
        token: str = "",
        lease_s: float = 120.0,
        threads: int = 0,
        wait_for_model_s: float = 0.0,
        heartbeat_s: float = 5.0,
        cpu_gemm: str = "auto",
        cpu_sampler: str = "batched",
    ) -> Fleet:
        """Spawn ``num_engines`` local engine servers. ``wait=False`` returns right after the
        spawn so the caller can build its models meanwhile; :meth:`ready` then waits.
        ``token``: the run's credential (default: a fresh one); ``lease_s``: engines exit after
        this long without a request or heartbeat from this process (0: off), which sends one
        every ``heartbeat_s`` (a lease should span >= 3 of them); ``threads``: each
        engine's OMP_NUM_THREADS (0: inherited); ``wait_for_model_s``: how long the engines wait
        for ``model_dir``'s manifest (0: it must exist now) — the caller may write the folder
        after the spawn, while the engines import vLLM; ``cpu_gemm``, ``cpu_sampler``: the engines'
        ``--cpu-gemm`` and ``--cpu-sampler``."""
        engines = []
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        token = token or new_token()
        staging = make_staging_dir()
        for i in range(num_engines):
            port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "megarl.engine.server",
                "--model",
                str(model_dir),
                "--port",
                str(port),
                "--tp",
                str(engine_tp),
                "--kv-cache-gb",
                str(kv_cache_gb),
                "--seed",
                str(seed + i),
                "--staging-dir",
                str(staging),
                "--parent-pid",
                str(os.getpid()),
                "--lease-s",
                str(lease_s),
                "--cpu-gemm",
                cpu_gemm,
                "--cpu-sampler",
                cpu_sampler,
            ] + (["--sleep-mode"] if sleep_mode else [])
            cmd += ["--wait-for-model", str(wait_for_model_s)] if wait_for_model_s > 0 else []
            # the KV budget is --kv-cache-gb (kv_cache_memory_bytes); VLLM_CPU_KVCACHE_SPACE would override it
            # the credential travels in the environment: a command line is visible to every user
            env = {"TORCHDYNAMO_DISABLE": "1", TOKEN_ENV: token}
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            log_path = Path(log_dir) / f"engine{i}.log"
            engines.append(
                EngineClient(f"engine{i}", f"127.0.0.1:{port}", launch=cmd, env=env, log_path=log_path, token=token)
            )
        fleet = cls(engines, request_timeout_s, start_timeout_s)
        fleet.staging_dir, fleet._own_staging = staging, True
        for e in engines:
            fleet._spawn(e)
        fleet._starting = True
        fleet._start_heartbeat(heartbeat_s)
        if wait:
            fleet.ready()
        return fleet

    def ready(self) -> float:
        """Wait until freshly spawned engines are healthy (no-op afterwards); seconds waited."""
        if not self._starting:
            return 0.0
        t0 = time.monotonic()
        for attempt in range(3):
            try:
                self.wait_healthy()
                break
            except RolloutError:
                # a port picked by free_port() can be taken by another process before the
                # engine binds it: restart just those engines on new ports (bounded)
                taken = [e for e in self.engines if not e.alive() and "Address already in use" in e.log_tail(40)]
                if not taken or attempt == 2:
                    self.shutdown()
                    raise
                for e in taken:
                    port = free_port()
                    e.address = f"127.0.0.1:{port}"
                    e.launch[e.launch.index("--port") + 1] = str(port)
                    log.warning("%s: port in use, restarting on %s", e.name, e.address)
                    self._spawn(e)
        self._starting = False
        return time.monotonic() - t0

    @classmethod
    def attach(cls, addresses: list[str], request_timeout_s: float, start_timeout_s: float, token: str = "") -> Fleet:
        """Engines started elsewhere (srun, by hand). ``token`` defaults to the environment's
        (MEGARL_ENGINE_TOKEN_FILE); a shared staging folder comes from MEGARL_STAGING_DIR."""
        token = token or env_token()
        if not token:
            raise RolloutError(
                f"attaching to engines {addresses} needs the run's credential: set MEGARL_ENGINE_TOKEN_FILE"
                " to the file the engines read (see README 'Security')"
            )
        engines = [EngineClient(f"engine{i}", a, token=token) for i, a in enumerate(addresses)]
        fleet = cls(engines, request_timeout_s, start_timeout_s)
        fleet.staging_dir = Path(os.environ[STAGING_ENV]) if os.environ.get(STAGING_ENV) else None
        fleet.wait_healthy()
        fleet._start_heartbeat()
        return fleet

    def _start_heartbeat(self, every_s: float = 5.0) -> None:
        """Keep the engines' lease (``--lease-s``) while this process lives."""

        def beat() -> None:
            while not self._beating.wait(every_s):
                for e in list(self.engines):
                    try:
                        e.post(routes.HEARTBEAT, {}, timeout=every_s)
                    except RolloutError:
                        pass  # a dead engine is the fleet's business (restart / error), not the heartbeat's

        threading.Thread(target=beat, name="fleet-heartbeat", daemon=True).start()

    def wait_healthy(self, engines: list[EngineClient] | None = None) -> None:
        """Wait for every engine's /health. A local engine that exits fails at once; an address
        that answers but is not a megarl engine (or a host that does not resolve) fails at once;
        one that refuses connections is waited for (a remote engine may still be loading), and
        said so every 30 s."""
        pending = list(engines or self.engines)
        t0 = time.monotonic()
        deadline, next_note = t0 + self.start_timeout, t0 + 30.0
        why: dict[str, str] = {}
        while pending:
            for e in list(pending):
                if not e.alive():
                    assert e.proc is not None
                    last = next((ln for ln in reversed(e.log_tail(40).splitlines()) if ln.strip()), "")
                    said = f"last line: {last.strip()}" if last else "this process wrote nothing to it"
                    raise RolloutError(
                        f"engine {e.name} exited with code {e.proc.returncode} during start; log {e.log_path}, {said}"
                    )
                health, reason, answered = e.check_health()
                if health is not None:
                    pending.remove(e)
                elif answered and not e.launch:
                    raise RolloutError(f"rollout.engine_addresses: {e.address} is not a megarl engine: {reason}")
                else:
                    why[e.name] = reason
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{e.name} ({e.address}: {why.get(e.name, '?')})" for e in pending)
                raise RolloutError(
                    f"engines not healthy after rollout.engine_start_timeout_s={self.start_timeout:.0f}s: {names}"
                )
            if pending and time.monotonic() > next_note and any(not e.launch for e in pending):
                next_note += 30.0
                log.info(
                    "waiting for %s (%.0fs of rollout.engine_start_timeout_s=%.0f)",
                    ", ".join(f"{e.name} at {e.address}: {why.get(e.name, '?')}" for e in pending),
                    time.monotonic() - t0,
                    self.start_timeout,
                )
            if pending:
                time.sleep(0.5)

    def shutdown(self) -> None:
        """Ask every engine this fleet started to stop, then wait for each (killed after 10 s)."""
        self._beating.set()
        self.stop_restarts()
        stopping = []
        for e in self.engines:
            if e.proc is not None and e.proc.poll() is None:
                try:
                    e.post(routes.SHUTDOWN, {}, timeout=5)
                    stopping.append(e)
                except RolloutError:
                    e.proc.kill()
        for e in stopping:
            assert e.proc is not None
            try:
                e.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                e.proc.kill()
        for e in self.engines:
            e.close()
        if self._own_staging and self.staging_dir is not None:
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        seeds: list[int | None] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        logprobs: bool = True,
    ) -> tuple[list[list[dict[str, Any]]], int]:
        """Sample ``n`` responses per prompt. Returns (outputs per prompt, min policy version);
        each sample's ``"logprobs"`` are the sampled tokens' (empty when ``logprobs`` is False)."""
        seeds = seeds or [None] * len(prompts)  # None: the engine's own RNG
        t0 = time.perf_counter()
        self.recover()  # an engine that died while idle is restarted before it is given prompts
        results: list[list[dict[str, Any]] | None] = [None] * len(prompts)
        versions: list[int] = []
        todo = list(range(len(prompts)))
        while todo:
            live = [e for e in self.serving() if e.alive()]
            if not live:
                self.recover()
                live = [e for e in self.serving() if e.alive()]
            if not live:
                raise RolloutError("no live engine in the fleet")
            shares = [(e, i) for e, i in self._balance(todo, prompts, n, max_tokens, live) if i]
            faults.inject("generate", self.version, [e for e, _ in shares])
            failed: list[int] = []

            def run(engine: EngineClient, idx: list[int]) -> tuple[EngineClient, list[int], Any]:
                body = {
                    "prompts": [prompts[i] for i in idx],
                    "n": n,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "stop_token_ids": stop_token_ids,
                    "seeds": [seeds[i] for i in idx],
                    "ignore_eos": ignore_eos,
                    "min_tokens": min_tokens,
                    "logprobs": logprobs,
                }
                try:
                    return engine, idx, engine.generate(body, self.timeout)
                except EngineDead as err:
                    return engine, idx, err

            dead = []
            for engine, idx, out in concurrently(lambda kv: run(*kv), shares):
                if isinstance(out, Exception):
                    log.warning("%s died mid-generation (%s); re-issuing %d prompts", engine.name, out, len(idx))
                    self.reissued_prompts += len(idx)
                    failed.extend(idx)
                    dead.append(engine)
                    continue
                version, groups, timings = out
                self._count("engine_s", timings.get("engine_s", 0.0), engine.name)
                self._count("model_s", timings.get("model_s", 0.0), engine.name)
                versions.append(version)
                for i, group in zip(idx, groups):
                    results[i] = group
            self.lost(dead)  # the same seeds on another engine: the same samples
            todo = sorted(failed)
        self.timings["generate_s"] = self.timings.get("generate_s", 0.0) + time.perf_counter() - t0
        return [r for r in results if r is not None], min(versions) if versions else -1

    def _count(self, key: str, seconds: float, engine: str) -> None:
        self.timings[f"{key}/{engine}"] = self.timings.get(f"{key}/{engine}", 0.0) + seconds

    def pop_timings(self) -> dict[str, float]:
        """Metrics of the generations since the last call, then reset: ``fleet/generate_s`` (the
        fleet's wall time, requests included), ``fleet/engine_s`` (inside vLLM's generate, the
        slowest engine) and ``fleet/model_s`` (its model forward; engines started with
        MEGARL_ENGINE_TIME_MODEL=1, else 0)."""
        t, self.timings = self.timings, {}
        out = {"fleet/generate_s": t.get("generate_s", 0.0)}
        for key in ("engine_s", "model_s"):
            out[f"fleet/{key}"] = max([v for k, v in t.items() if k.startswith(key + "/")], default=0.0)
        return out

    @staticmethod
    def _balance(
        todo: list[int], prompts: list[list[int]], n: int, max_tokens: int, engines: list[EngineClient]
    ) -> list[tuple[EngineClient, list[int]]]:
        """Greedy longest-first assignment by outstanding tokens (prompt + n × max response)."""
        load = {e.name: 0 for e in engines}
        shares: dict[str, list[int]] = {e.name: [] for e in engines}
        for i in sorted(todo, key=lambda j: -len(prompts[j])):
            target = min(engines, key=lambda e: load[e.name])
            shares[target.name].append(i)
            load[target.name] += len(prompts[i]) + n * max_tokens
        return [(e, sorted(shares[e.name])) for e in engines]

    def logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """Prompt log-probs of each sequence on every engine (integrity check); an engine
        that died is restarted at the current version and asked again (bounded)."""
        faults.inject("integrity", self.version, self.serving())
        body = {"sequences": sequences, "temperature": temperature}
        out = []
        for e in self.serving():
            for attempt in range(3):
                try:
                    out.append(e.post(routes.LOGPROBS, body, self.timeout)["logprobs"])
                    break
                except EngineDead as err:
                    if attempt == 2:
                        raise
                    log.warning("%s died before the integrity check (%s); restarting it", e.name, err)
                    self.lost([e])
                    if e.name in self.restarting:
                        break  # checked at the first sync after it serves again
        return out

    # ------------------------------------------------------------------ colocation

    def sleep(self, level: int = 1) -> None:
        """Free the engines' GPU memory for the trainer (vLLM sleep mode, level 1)."""
        self._post_each(routes.SLEEP, {"level": level})

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocate ``weights`` (before a sync) or ``kv_cache`` (after it)."""
        self._post_each(routes.WAKE_UP, {"tags": tags})

    def _post_each(self, path: str, body: dict[str, Any]) -> None:
        concurrently(lambda e: e.post(path, body, self.timeout), self.members())

    def versions(self) -> list[int]:
        return [int((e.health() or {}).get("version", -2)) for e in self.engines]
