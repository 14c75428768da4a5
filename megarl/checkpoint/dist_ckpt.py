"""Resumable training checkpoints: megatron ``dist_checkpointing`` for weights and optimizer
state, plus the loop's own state and per-rank RNG states.

Layout of one checkpoint ``<root>/<name>/`` (and of ``<root>/latest``)::

    COMPLETE          written last (rank 0) once every rank finished writing; JSON
    MANIFEST.json     size and CRC-32 of every other file, written just before COMPLETE
    meta.json         format version, parallel layout, each model's ModelConfig fields
    state.json        the loop's ``extra`` dict (step, sampler, coordinator, ...)
    <model>/          one megatron dist_checkpointing dir per model: {"model", "optimizer"}
    rng/rank<r>.pt    torch (and megatron tracker) RNG states of global rank r
    <files>           optional copies (tokenizer.model, hf_config.json, ...)
    ../latest         text file: the name of the newest complete checkpoint

Invariants:

* A checkpoint is written into ``<root>/<name>.tmp/`` and only renamed to ``<name>/`` after
  rank 0 wrote ``COMPLETE``; ``latest`` is replaced atomically afterwards. ``latest`` therefore
  never names a partial checkpoint, and a ``*.tmp`` left by a crash is ignored (and removed
  by the next save).
* ``MANIFEST.json`` records what was written, so a file truncated or emptied later (a full
  disk, a copy cut short) is found before a resume trusts it (:mod:`.integrity`).
* Weights and optimizer state are stored in model space (one global tensor per parameter and
  per Adam moment), so a checkpoint saved at one TP/PP/DP layout loads into another. The
  distributed optimizer uses megatron's ``fully_reshardable`` format for that reason. Each
  model's sharded state dict is built on its own layout's groups (``model.dims``: the critic
  may have its own TP/PP/DP), which fix its shards' offsets and replica ids.
* Resuming is exact (bitwise for fp32 on the same layout): fp32 main params, both Adam
  moments, Adam's step count and the param-group hyper-parameters (lr, ...) are restored,
  and each rank's RNG states when the layout is unchanged. See :func:`_fix_adam_steps`
  for the bug that otherwise makes a resumed distributed-optimizer run drift.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.checkpoint.integrity import (  # noqa: F401 (re-exported)
    LATEST,
    MARKER,
    TMP_SUFFIX,
    CheckpointError,
    complete_checkpoints,
    digest_all,
    latest_checkpoint,
    read_marker,
    recorded_files,
    resolve_checkpoint,
    write_manifest,
)
from megarl.checkpoint.meta import (  # noqa: F401 (re-exported)
    DTYPE_FIELD,
    FORMAT_VERSION,
    check_expert_optimizer,
    check_model_config,
    checkpoint_model_config,
    fsync_dir,
    has_value_head,
    layout_of,
    meta_of,
    model_config_dict,
    prune,
    read_json,
    read_meta,
    rng_state,
    set_rng_state,
    uses_distopt,
    write_text,
)
from megarl.checkpoint.optim_state import (  # noqa: F401 (re-exported)
    DIST_OPT_SHARDING,
    _ensure_adam_state,
    _load_optimizer_state,
)
from megarl.model.builder import Model

logger = logging.getLogger(__name__)

FAULT_ENV = "MEGARL_CKPT_FAULT"
"""Fault injection for tests: ``before_commit`` makes every rank ``os._exit(1)`` after all
files of a checkpoint are written but before ``COMPLETE`` (a crash mid-save)."""

"""Model-space optimizer state for the distributed optimizer: reshardable over TP/PP/DP.
(megatron's default, ``fully_sharded_model_space``, needs flattened ranges that the local
layer spec does not provide: it raises ``flattened_range is not supported``.)"""


def save_checkpoint(
    ckpt_dir: str | Path,
    models: dict[str, Model],
    extra: dict[str, Any],
    *,
    keep_last: int,
    name: str | None = None,
    files: Mapping[str, str | Path] | None = None,
    asynchronous: bool = False,
) -> Any:
    """Save ``models`` (weights + optimizer state) and ``extra`` as ``<ckpt_dir>/<name>/``.

    ``asynchronous=True``: the tensors are staged (copied) now and written by a background
    thread over a separate gloo group; the call returns a :class:`PendingSave` whose
    ``finalize()`` (collective; call it at a later step boundary) waits for the writes and
    commits. Until then ``latest`` still names the previous checkpoint.

    Collective over all trainer ranks. ``extra`` must be JSON-serialisable and identical on
    every rank (rank 0 writes it). ``name`` defaults to ``step_<extra["step"]:08d>``.
    ``files`` ({name in the checkpoint: source path}) are copied in before it is committed
    (tokenizer, HF config). Keeps the ``keep_last`` newest complete checkpoints (the previous
    ones of this root, whatever their names). Returns the checkpoint path.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    if not models:
        raise ValueError("save_checkpoint needs at least one model")
    text = json.dumps(extra, indent=1, sort_keys=True)  # every rank: fail before any collective
    if name is None:
        if "step" not in extra:
            raise ValueError("save_checkpoint: pass name= or put 'step' in extra")
        name = f"step_{int(extra['step']):08d}"
    if "/" in name or name.endswith(TMP_SUFFIX) or name == LATEST:
        raise ValueError(f"invalid checkpoint name {name!r}")
    root = Path(ckpt_dir)
    final, tmp = root / name, root / (name + TMP_SUFFIX)
    rank = dist.get_rank()

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*" + TMP_SUFFIX):  # leftovers of crashed saves
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
        for mname in models:
            (tmp / mname).mkdir()
    dist.barrier()

    t1 = time.perf_counter()
    strategy = _save_strategy(_async_group() if asynchronous else None)
    for mname, model in models.items():
        dist_checkpointing.save(_sharded_state_dict(model, is_loading=False), str(tmp / mname), strategy)
    t2 = time.perf_counter()

    torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
    meta = meta_of(models)  # every rank (collective)
    if rank == 0:
        for dest, src in (files or {}).items():
            shutil.copyfile(src, tmp / dest)
        write_text(tmp / "state.json", text)
        write_text(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
    dist.barrier()

    if asynchronous:
        pending = PendingSave(root, name, keep_last, list(strategy.futures), time.perf_counter() - t0)
        logger.info("checkpoint %s staged in %.2fs; writing in the background", final, pending.blocked_s)
        return pending
    _commit(root, name, keep_last)
    logger.info("saved checkpoint %s in %.2fs (weights + optimizer %.2fs)", final, time.perf_counter() - t0, t2 - t1)
    return final


class PendingSave:
    """An asynchronous save whose files are still being written."""

    def __init__(self, root: Path, name: str, keep_last: int, futures: list[Any], blocked_s: float) -> None:
        self.root, self.name, self.keep_last, self.futures = root, name, keep_last, futures
        self.blocked_s = blocked_s
        self.t_start = time.perf_counter()

    def finalize(self) -> Path:
        """Collective: wait for this rank's writes, then commit on rank 0 (marker, latest)."""
        t0 = time.perf_counter()
        for f in self.futures:
            f.result()
        waited = time.perf_counter() - t0
        _commit(self.root, self.name, self.keep_last)
        logger.info(
            "checkpoint %s committed (%.2fs after staging; waited %.2fs)",
            self.root / self.name,
            time.perf_counter() - self.t_start,
            waited,
        )
        return self.root / self.name


_ASYNC_GROUP: list[Any] = []
_POOL: list[Any] = []


def _writer_pool() -> Any:
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-ckpt"))
    return _POOL[0]


def _async_group() -> Any:
    """A gloo group only the background writers use (collectives of the training loop run
    on other groups concurrently). Created once, collectively, on the first async save."""
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


def _commit(root: Path, name: str, keep_last: int) -> None:
    """Collective: the manifest, then rank 0 writes the marker, renames ``<name>.tmp`` and
    moves ``latest``."""
    rank = dist.get_rank()
    final, tmp = root / name, root / (name + TMP_SUFFIX)
    dist.barrier()
    if os.environ.get(FAULT_ENV) == "before_commit":
        os._exit(1)

    t0 = time.perf_counter()
    files = _digest_shared(tmp)
    if rank == 0:
        write_manifest(tmp, files)
        logger.info(
            "checkpoint %s: manifest of %d files, %.1f MB, in %.2fs",
            final,
            len(files),
            sum(f["size"] for f in files.values()) / 1e6,
            time.perf_counter() - t0,
        )
        order = 1 + max((read_marker(p).get("order", 0) for p in complete_checkpoints(root)), default=0)
        write_text(tmp / MARKER, json.dumps({"name": name, "order": order, "time": time.time()}))
        old = root / (name + ".replaced" + TMP_SUFFIX)
        if final.exists():  # same name saved again: set the old copy aside, drop it once replaced
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        write_text(root / (LATEST + TMP_SUFFIX), name)
        os.replace(root / (LATEST + TMP_SUFFIX), root / LATEST)
        fsync_dir(root)
        prune(root, keep_last)
    dist.barrier()


def _digest_shared(tmp: Path) -> dict[str, dict[str, int]]:
    """Collective: size and CRC-32 of every file of ``tmp``, each rank hashing a share (rank 0's
    listing, so all ranks agree on it); the result is complete on rank 0 only."""
    listing: list[Any] = [recorded_files(tmp) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    mine = digest_all(tmp, listing[0][dist.get_rank() :: dist.get_world_size()])
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0)
    return {rel: d for part in parts for rel, d in part.items()}


def load_checkpoint(
    ckpt_dir: str | Path,
    models: dict[str, Model],
    *,
    load_optimizer: bool = True,
) -> dict[str, Any]:
    """Load ``models`` from a checkpoint; returns the ``extra`` dict saved with it.

    ``ckpt_dir`` is a checkpoint root (its ``latest`` one is loaded) or one checkpoint dir.
    Collective over all trainer ranks. The parallel layout may differ from the saving one;
    RNG states are restored only when it is the same.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    path = resolve_checkpoint(ckpt_dir)
    meta = read_meta(path)
    saved_models: dict[str, Any] = meta["models"]
    for mname, model in models.items():
        if mname not in saved_models:
            raise CheckpointError(
                f"checkpoint {path} has no model '{mname}' (it holds: {', '.join(sorted(saved_models)) or 'none'})"
            )
        check_model_config(path, mname, saved_models[mname]["model_config"], model_config_dict(model))
        if load_optimizer and model.optimizer is not None and not saved_models[mname]["has_optimizer"]:
            raise CheckpointError(
                f"checkpoint {path} model '{mname}' was saved without optimizer state; "
                "load it with load_optimizer=False"
            )
        if load_optimizer and model.optimizer is not None:
            check_expert_optimizer(path, mname, saved_models[mname], model.dims)
        saved_distopt = saved_models[mname]["distributed_optimizer"]
        if load_optimizer and model.optimizer is not None and saved_distopt != uses_distopt(model):
            raise CheckpointError(
                f"checkpoint {path} model '{mname}': use_distributed_optimizer={saved_distopt} in the "
                f"checkpoint but {uses_distopt(model)} now; optimizer state only loads into the same kind"
            )

    t1 = time.perf_counter()
    for mname, model in models.items():
        with_opt = load_optimizer and model.optimizer is not None
        sharded = _sharded_state_dict(model, is_loading=True, with_optimizer=with_opt)
        try:
            state = dist_checkpointing.load(sharded, str(path / mname))
        except Exception as e:  # e.g. torch's CheckpointException on a torn file: name the checkpoint
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {path} model '{mname}' could not be read ({type(e).__name__}: {first})"
            ) from e
        model.core.load_state_dict(state["model"], strict=True)
        if with_opt:
            _load_optimizer_state(model.optimizer, state["optimizer"])
        elif model.optimizer is not None:
            model.optimizer.reload_model_params()  # fp32 main params follow the new weights
    t2 = time.perf_counter()

    dims = next(iter(models.values())).dims
    if meta["layout"] == layout_of(dims):
        set_rng_state(torch.load(path / "rng" / f"rank{dims.rank}.pt", weights_only=True))
    else:
        logger.info("checkpoint layout %s != current %s: RNG states not restored", meta["layout"], layout_of(dims))
    extra: dict[str, Any] = read_json(path, "state.json")
    dist.barrier()
    logger.info("loaded checkpoint %s in %.2fs (weights + optimizer %.2fs)", path, time.perf_counter() - t0, t2 - t1)
    return extra


def _sharded_state_dict(model: Model, *, is_loading: bool, with_optimizer: bool = True) -> dict[str, Any]:
    core: Any = model.core
    # replica ids over this model's DP group (megatron's default is the global one)
    model_sd = core.sharded_state_dict(metadata={"dp_cp_group": model.dims.pgs.dp_cp})
    out: dict[str, Any] = {"model": model_sd}
    if with_optimizer and model.optimizer is not None:
        metadata = dict(DIST_OPT_SHARDING) if uses_distopt(model) else None
        _ensure_adam_state(model.optimizer)
        out["optimizer"] = model.optimizer.sharded_state_dict(model_sd, is_loading, metadata=metadata)
    return out


def _save_strategy(async_group: Any = None) -> Any:
    """megatron's ``torch_dist`` format, written synchronously by this process.

    megatron's own writer (``TorchDistSaveShardedStrategy``, also in its synchronous mode)
    hands the files to forked writer processes and collects their results through a
    ``spawn`` multiprocessing Manager: ~1-5 s of process start-up on the first save, a
    re-import of ``__main__`` (entry scripts without a ``__main__`` guard hang), and a
    ``psutil`` dependency. torch's plain ``FileSystemWriter`` writes the same format
    (``.metadata`` + ``__<rank>_0.distcp``) that megatron's loader reads.
    """
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    class InProcessTorchDistSave(SaveShardedStrategy):
        futures: list[Any] = []

        def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
            from megatron.core.dist_checkpointing.strategies.torch import (
                MCoreSavePlanner,
                _replace_state_dict_keys_with_sharded_keys,
                mcore_to_pyt_state_dict,
            )
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint import save as dcp_save

            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            writer = FileSystemWriter(str(checkpoint_dir), thread_count=1)
            planner = MCoreSavePlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False)
            if async_group is None:
                dcp_save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)
                return
            # Stage: private copies of every tensor (training may change the originals from the
            # next step on), then write from a background thread over the dedicated group.
            import copy

            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            for key, sh in list(flat.items()):
                if isinstance(sh, ShardedTensor):
                    sh.data = sh.data.detach().clone()
                else:
                    flat[key] = copy.deepcopy(sh)
            staged = mcore_to_pyt_state_dict(flat, False)
            self.futures.append(
                _writer_pool().submit(
                    dcp_save, staged, storage_writer=writer, planner=planner, process_group=async_group
                )
            )

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

    strategy = InProcessTorchDistSave("torch_dist", 1)
    strategy.futures = []
    return strategy


# model-config fields added after checkpoints were first written, and the value they had then
