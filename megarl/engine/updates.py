"""An engine's weight updates, for every transport: begin, stage (shm files, http bytes, NCCL
broadcast, CUDA IPC), check, commit, abort.

Invariant: the engine never serves a half-updated model. Every transport stages and checks
tensors (``megarl.engine.staging``) before anything touches the model; commit applies the
whole update in one call per worker (``megarl.engine.loading``) while the request lock is held,
so no generation interleaves. A rejected update leaves the old version; an applied one that did
not cover the model (a parameter not written, a sent tensor used by no loader) is refused
after the fact and marks the engine failed, so the fleet restarts it. Staged CPU tensors are
kept in memory, so commit does not read the sources a second time (with TP>1 the worker
processes re-read files/bytes: tensors cannot be handed to them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megarl.engine.coverage import coverage_problem, refusal
from megarl.engine.credentials import inside
from megarl.engine.staging import Staged, check_meta, check_tensor
from megarl.engine.stepper import EngineLock
from megarl.errors import EngineError


class WeightUpdates:
    """The update half of ``megarl.engine.vllm_engine.VllmEngine``, which sets the fields below."""

    llm: Any
    """vLLM's ``LLM``: its workers stage, apply and drop tensors (``megarl.engine.worker_ext``)."""
    manifest: dict[str, list[int]]
    """HF name -> shape of every tensor an update must hold (``megarl.engine.staging.MANIFEST``)."""
    staging_dir: Path | None
    """The only folder ``/weights/load`` reads from (the run's private staging folder)."""
    in_process: bool
    """One worker in this very process: staged tensors are handed over without a copy."""
    lock: EngineLock
    """Held by every request that touches vLLM (generation included)."""
    staged: Staged | None
    """The update between begin and commit (None: none open)."""
    version: int
    """The weight version the engine serves (-1: the dummy weights it started with)."""
    failed: str
    """Why the engine must be restarted ('' if it need not): set when an applied update did not
    cover its model (the weights are then neither the old version nor the new one)."""

    def begin(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self._drop()
            self.staged = Staged(int(req["version"]))
        return {"ok": True}

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        """Stage safetensors files (shm transport): read once, validate, keep in memory.

        ``"begin": true`` opens the update first and ``"commit": true`` applies it after (the
        reply is then commit's); the fleet always asks for the first, and for the second when
        it has one engine (``Fleet.load_files``). A rejected file leaves the update staged but
        uncommitted, as a plain load does."""
        from safetensors import safe_open

        if self.staging_dir is None:
            raise EngineError("/weights/load is off: the engine was started without --staging-dir (use http)")
        try:
            files = [str(inside(f, self.staging_dir)) for f in req["files"]]
        except ValueError as e:
            raise EngineError(f"/weights/load refused: {e}") from e
        version = int(req["version"])
        if req.get("begin"):
            self.begin({"version": version})
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    check_tensor(self.manifest, name, t, f" in {f}")
                    named.append((name, t))
        staged = self._stage(version, named, files=files)
        if req.get("commit"):
            return {**staged, **self.commit({"version": version})}
        return staged

    def load_bytes(self, version: int, data: bytes) -> dict[str, Any]:
        """Stage one bucket sent as safetensors bytes in the request body (http transport)."""
        from safetensors.torch import load

        try:
            tensors = load(data)
        except Exception as e:  # safetensors raises its own SafetensorError on a bad header
            raise EngineError(f"request body ({len(data)} bytes) is not a safetensors buffer: {e}") from e
        for name, t in tensors.items():
            check_tensor(self.manifest, name, t, " in the request body")
        return self._stage(version, list(tensors.items()), blobs=[data])

    def _stage(
        self,
        version: int,
        named: list[tuple[str, torch.Tensor]],
        files: list[str] | None = None,
        blobs: list[bytes] | None = None,
    ) -> dict[str, Any]:
        with self.lock:
            st = self._expect(version, "load", in_workers=False)
            st.names.update(n for n, _ in named)
            if self.in_process:
                st.tensors.update(named)
            else:
                st.files.extend(files or [])
                st.blobs.extend(blobs or [])
            return {"ok": True, "staged": len(st.names)}

    def _expect(self, version: int, what: str, in_workers: bool) -> Staged:
        st = self.staged
        if st is None or st.version != version:
            raise EngineError(f"{what} for version {version} without begin (staged: {st.version if st else None})")
        if st.names and st.in_workers != in_workers:
            raise EngineError(f"update {version} mixes tensors staged in the workers and in the server")
        st.in_workers = in_workers
        return st

    def check(self, req: dict[str, Any]) -> dict[str, Any]:
        """Validate names/shapes/dtypes of tensors about to arrive by NCCL or CUDA IPC."""
        for rec in req["tensors"]:
            check_meta(self.manifest, rec["name"], rec["shape"], rec["dtype"])
        return {"ok": True}

    def nccl_init(self, req: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's NCCL group; blocks until the trainer (rank 0) and all workers join."""
        args = (str(req["master_address"]), int(req["master_port"]), int(req["rank_offset"]), int(req["world_size"]))
        with self.lock:
            ranks = self.llm.collective_rpc("megarl_nccl_init", args=args)
        return {"ok": True, "ranks": ranks}

    def nccl_load(self, req: dict[str, Any]) -> dict[str, Any]:
        """Receive one bucket by NCCL broadcast (the trainer broadcasts while this runs)."""
        return self._stage_in_workers(req, "megarl_nccl_receive", (req["tensors"], int(req["nbytes"])))

    def ipc_load(self, req: dict[str, Any]) -> dict[str, Any]:
        """Stage one bucket shared by the trainer through CUDA IPC (JSON handle, no pickle)."""
        return self._stage_in_workers(req, "megarl_ipc_receive", (req["handle"], req["tensors"]))

    def _stage_in_workers(self, req: dict[str, Any], method: str, args: tuple[Any, ...]) -> dict[str, Any]:
        version = int(req["version"])
        self.check(req)
        with self.lock:
            st = self._expect(version, "load", in_workers=True)
            st.names.update(rec["name"] for rec in req["tensors"])
            bad = sorted({n for per_worker in self.llm.collective_rpc(method, args=args) for n in per_worker})
            if bad:
                raise EngineError(f"tensor '{bad[0]}' contains NaN/Inf ({len(bad)} such tensors)")
            return {"ok": True, "staged": len(st.names)}

    def commit(self, req: dict[str, Any]) -> dict[str, Any]:
        version = int(req["version"])
        with self.lock:
            st = self.staged
            if st is None or st.version != version:
                raise EngineError(f"commit for version {version}, staged {st.version if st else None}")
            missing = sorted(set(self.manifest) - st.names)
            if missing:
                raise EngineError(f"update {version} incomplete: missing {missing[:5]} ({len(missing)} tensors)")
            t0 = time.perf_counter()
            self.staged = None
            try:
                reports = self._apply(st)
            except Exception as err:  # half-written, or workers out of step: restart the engine
                self.failed = f"update {version} failed while it was applied: {err}"
                raise
            finally:
                self.llm.reset_prefix_cache()
            refused = refusal(reports, version)
            if refused:  # nothing was written: the old version still serves
                raise EngineError(refused)
            problem = coverage_problem(reports, version)
            if problem:  # the model is no longer version's predecessor either: restart it
                self.failed = problem
                raise EngineError(problem)
            self.version = version
        return {"ok": True, "version": version, "apply_s": time.perf_counter() - t0}

    def _apply(self, st: Staged) -> list[dict[str, list[str]]]:
        """Every worker writes the whole update; their coverage records (``megarl.engine.coverage``)."""
        if st.in_workers:
            return list(self.llm.collective_rpc("megarl_apply_staged"))
        if self.in_process:
            return list(self.llm.collective_rpc("megarl_apply", args=(list(st.tensors.items()),)))
        return list(self.llm.collective_rpc("megarl_apply_sources", args=(st.files, st.blobs, sorted(st.names))))

    def abort(self, req: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self._drop()
        return {"ok": True, "version": self.version}

    def _drop(self) -> None:
        if self.staged is not None and self.staged.in_workers:
            self.llm.collective_rpc("megarl_drop_staged")
        self.staged = None
