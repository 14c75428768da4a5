"""The fleet's engine processes: start (local subprocesses) or attach (remote addresses), wait
until healthy, keep their lease, shut down. The base of :class:`megarl.fleet.fleet.Fleet`.

Every request carries the run's credential (``megarl.engine.credentials``); engines started
here get it through their environment (a command line is visible to every user), a private
staging folder for shm weight files, the trainer's pid (they exit when it is gone) and a
lease kept alive by a heartbeat thread. Restarting a dead engine is
``megarl.fleet.restarts``'s business (built on :meth:`EngineProcesses._spawn` and
:meth:`EngineProcesses.wait_healthy`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from megarl.engine import routes
from megarl.engine.credentials import STAGING_ENV, TOKEN_ENV, env_token, make_staging_dir, new_token
from megarl.errors import RolloutError
from megarl.fleet.client import EngineClient, free_port

log = logging.getLogger("megarl.fleet")


@dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """What every engine of a local fleet is started with (``start_local``'s arguments)."""

    model_dir: str
    tp: int
    kv_cache_gb: float
    seed: int
    """Engine i samples with seed + i."""
    staging_dir: Path
    lease_s: float
    cpu_gemm: str
    cpu_sampler: str
    sleep_mode: bool
    return_routes: bool
    """MoE routing replay from the engines (``algo.router_replay: rollout``): ``--return-routes``."""
    wait_for_model_s: float
    token: str
    threads: int
    """Each engine's OMP_NUM_THREADS (0: inherited)."""
    log_dir: Path

    def engine(self, i: int) -> EngineClient:
        """Engine ``i`` on a free port: its server command, environment and log."""
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "megarl.engine.server",
            "--model",
            self.model_dir,
            "--port",
            str(port),
            "--tp",
            str(self.tp),
            "--kv-cache-gb",
            str(self.kv_cache_gb),
            "--seed",
            str(self.seed + i),
            "--staging-dir",
            str(self.staging_dir),
            "--parent-pid",
            str(os.getpid()),
            "--lease-s",
            str(self.lease_s),
            "--cpu-gemm",
            self.cpu_gemm,
            "--cpu-sampler",
            self.cpu_sampler,
        ] + (["--sleep-mode"] if self.sleep_mode else [])
        cmd += ["--return-routes"] if self.return_routes else []
        cmd += ["--wait-for-model", str(self.wait_for_model_s)] if self.wait_for_model_s > 0 else []
        # the KV budget is --kv-cache-gb (kv_cache_memory_bytes); VLLM_CPU_KVCACHE_SPACE would override it
        # the credential travels in the environment: a command line is visible to every user
        env = {"TORCHDYNAMO_DISABLE": "1", TOKEN_ENV: self.token}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        log_path = self.log_dir / f"engine{i}.log"
        return EngineClient(f"engine{i}", f"127.0.0.1:{port}", launch=cmd, env=env, log_path=log_path, token=self.token)


class EngineProcesses:
    """The engines as processes (or addresses): the lowest base of ``Fleet``."""

    def __init__(self, engines: list[EngineClient], request_timeout_s: float, start_timeout_s: float) -> None:
        self.engines = engines
        self.timeout = request_timeout_s
        self.start_timeout = start_timeout_s
        self._starting = False  # spawned by start_local(wait=False), not yet known healthy
        self.staging_dir: Path | None = None
        """Private folder the engines read shm weight files from (None: http only)."""
        self._own_staging = False  # made by start_local: removed at shutdown
        self._beating = threading.Event()  # set: the heartbeat thread stops

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
        return_routes: bool = False,
    ) -> Self:
        """Spawn ``num_engines`` local engine servers. ``wait=False`` returns right after the
        spawn so the caller can build its models meanwhile; :meth:`ready` then waits.
        ``token``: the run's credential (default: a fresh one); ``lease_s``: engines exit after
        this long without a request or heartbeat from this process (0: off), which sends one
        every ``heartbeat_s`` (a lease should span >= 3 of them); ``threads``: each
        engine's OMP_NUM_THREADS (0: inherited); ``wait_for_model_s``: how long the engines wait
        for ``model_dir``'s manifest (0: it must exist now) — the caller may write the folder
        after the spawn, while the engines import vLLM; ``cpu_gemm``, ``cpu_sampler``: the engines'
        ``--cpu-gemm`` and ``--cpu-sampler``; ``return_routes``: ``--return-routes``."""
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        staging = make_staging_dir()
        launch = EngineLaunch(
            model_dir=str(model_dir),
            tp=engine_tp,
            kv_cache_gb=kv_cache_gb,
            seed=seed,
            staging_dir=staging,
            lease_s=lease_s,
            cpu_gemm=cpu_gemm,
            cpu_sampler=cpu_sampler,
            sleep_mode=sleep_mode,
            return_routes=return_routes,
            wait_for_model_s=wait_for_model_s,
            token=token or new_token(),
            threads=threads,
            log_dir=Path(log_dir),
        )
        engines = [launch.engine(i) for i in range(num_engines)]
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
    def attach(cls, addresses: list[str], request_timeout_s: float, start_timeout_s: float, token: str = "") -> Self:
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

    def _spawn(self, e: EngineClient) -> None:
        e.close()  # connections kept to an earlier process of this engine
        env = dict(os.environ)
        env.update(e.env)
        assert e.log_path is not None
        e.log_start = e.log_path.stat().st_size if e.log_path.exists() else 0
        fh = open(e.log_path, "ab")  # noqa: SIM115 (handed to the child)
        e.proc = subprocess.Popen(e.launch, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
