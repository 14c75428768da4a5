"""Set-up: everything one run needs, built once and whole into a typed :class:`Components` bundle.

Order matters and is kept here only: process groups (actor, and the critic's own layout) →
data → tokenizer → model config (from the HF folder of ``model.init_from``) → the engines
start (rank 0; they load while the trainer builds) → actor → planner (attaches grad probes),
rollout collector, weight sync, publisher and the rollout source → the start: the checkpoint
to resume from, or the warm start → the frozen reference and the critic (after the warm start,
so the reference is the warm-started policy; a resume overwrites both) → the updater.

Nothing here runs a step; the phases (``megarl.rollout``, ``megarl.update``,
``megarl.weight_sync.publisher``) take what they need from the bundle and ``loop.py`` wires
them. :meth:`Components.stateful` is the mapping a checkpoint saves and restores;
:meth:`Components.close` stops what :func:`build` started.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from megarl.checkpoint import state
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.checkpoint.hf_config import check_hf_tensors, export_dtype
from megarl.checkpoint.hf_io import copy_weights, hf_state_dict, load_hf_tensors, read_hf_folder, save_hf_folder
from megarl.checkpoint.state import Stateful
from megarl.compat import cpu as cpu_compat
from megarl.config import ConfigError, RunConfig
from megarl.data.hf_tokenizer import open_tokenizer
from megarl.data.prompts import load_prompts
from megarl.data.tokenizer import PromptTokenizer, export_tokenizer_files
from megarl.distributed import ParallelDims, init_distributed, init_layout
from megarl.engine.credentials import run_token
from megarl.engine.staging import MANIFEST
from megarl.fleet.cpu_threads import cpu_engine_threads
from megarl.fleet.fleet import Fleet
from megarl.model.builder import Model, build_gpt
from megarl.planning import Planner, PlanSettings
from megarl.rewards.env_pool import Envs, start_envs
from megarl.rewards.runner import RewardRunner
from megarl.rollout.collector import RolloutCollector
from megarl.rollout.demonstrations import can_demonstrate, demonstrated, tokenizer_texts
from megarl.rollout.pipeline import RolloutPipeline
from megarl.rollout.sampling import CollectSettings, integrity_sequence
from megarl.rollout.source import OnPolicy, RolloutSource
from megarl.update import AdvantageEstimator, PolicyUpdater, UpdateSettings
from megarl.warm_start import Example, WarmStartSettings, warm_start
from megarl.weight_sync.publisher import PolicyPublisher
from megarl.weight_sync.sync import WeightSync

log = logging.getLogger("megarl")


@dataclass
class Start:
    """How the run starts: from a checkpoint (``resume_from``), or fresh after the warm start."""

    resume_from: Path | None
    """The checkpoint the run resumes from (``train.resume``), None for a fresh run."""
    warm_start_nll: float | None = None
    """A fresh run's warm start (None: none): its last supervised NLL, its last step's share of
    examples reproduced exactly, its steps (fewer than ``warm_start.steps`` when ``stop_at_exact``
    stopped it) and its seconds (``megarl.warm_start``)."""
    warm_start_exact: float | None = None
    warm_start_steps: int | None = None
    warm_start_s: float | None = None


@dataclass
class Components:
    cfg: RunConfig
    dims: ParallelDims
    """The actor's (and reference's) layout."""
    critic_dims: ParallelDims
    """The critic's own layout (``critic.parallel``); ``dims`` when it shares the actor's."""
    run_dir: Path
    tok: PromptTokenizer
    adapter: LlamaQwen2Adapter
    fleet: Fleet | None
    """Rank 0 only."""
    rewards: RewardRunner | None
    """Rank 0 only (the reward workers)."""
    envs: Envs | None
    """Rank 0 only, with ``env.fn``: the episodes' environments (the environment workers)."""
    actor: Model
    ref: Model | None
    """The frozen reference (``algo.kl_coef`` > 0): the warm-started policy."""
    critic: Model | None
    """PPO's critic, on its own layout."""
    planner: Planner
    collector: RolloutCollector
    """Generation, scoring and validation over the fleet."""
    rollouts: RolloutSource
    """Where each step's batch comes from: on-policy, or generated ahead (``rollout.max_staleness``)."""
    advantages: AdvantageEstimator
    updater: PolicyUpdater
    publisher: PolicyPublisher
    start: Start

    def models(self) -> dict[str, Model]:
        """The checkpointed models by name."""
        out = {"actor": self.actor}
        if self.ref is not None:
            out["ref"] = self.ref
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    def stateful(self) -> dict[str, Stateful]:
        """The loop state a checkpoint carries besides the models, by name."""
        return {
            "rollouts": self.rollouts,  # the sampler's position (+ the batches generated ahead)
            "planner": self.planner,
            "advantages": self.advantages,
            "publisher": self.publisher,
        }

    def export_hf(self, path: Path) -> None:
        """The actor as an HF folder (collective; rank 0 writes) with the run's tokenizer files
        (an HF tokenizer's files and generation config copied unchanged from its folder), in the
        source model's dtype (:func:`export_dtype`)."""
        sd = hf_state_dict(self.actor, self.adapter)
        if self.dims.is_rank0:
            dtype = export_dtype(self.cfg.model)
            sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
            hf_cfg = self.adapter.hf_config(*self.tok.config_ids, dtype=dtype)
            save_hf_folder(path, sd, hf_cfg)
            export_tokenizer_files(self.tok.files(), path)

    def close(self) -> None:
        """Stop what :func:`build` started: the rollout worker, the engines, the reward and
        environment workers, the weight-sync staging."""
        _close(self.rollouts, self.fleet, self.rewards, self.envs, self.publisher.sync if self.dims.is_rank0 else None)


def _close(
    rollouts: Any, fleet: Fleet | None, rewards: RewardRunner | None, envs: Envs | None, sync: WeightSync | None
) -> None:
    if rollouts is not None:
        rollouts.close()
    if fleet is not None:
        fleet.shutdown()
    if rewards is not None:
        rewards.close()
    if envs is not None:
        envs.close()
    if sync is not None:
        sync.cleanup()


def build(cfg: RunConfig) -> Components:
    """Everything the run needs, whole: process groups, data, tokenizer, engines (started, not
    awaited), actor, the phases; then the start (the checkpoint to resume from, or the warm
    start), and the reference and critic. What was started is stopped if any of it fails."""
    p = cfg.parallel
    dims = init_distributed(
        p.tensor_parallel, p.pipeline_parallel, cfg.train.seed, ep=p.expert_parallel, etp=p.expert_tensor_parallel
    )
    if p.cpu_keep_freed_memory and not torch.cuda.is_available():
        cpu_compat.keep_freed_memory()
    critic_dims = dims
    if cfg.algo.name == "ppo":
        ctp, cpp, _ = cfg.critic_layout(dims.world_size)
        critic_dims = init_layout(dims, ctp, cpp)
    run_dir = Path(cfg.train.run_dir)
    fleet, rewards, rollouts, sync = None, None, None, None
    envs: Envs | None = None
    if dims.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
    if dims.is_rank0 and not cfg.rollout.engine_addresses:
        # engines start first: they import vLLM while this process reads the data and writes
        # their model folder (they wait for its manifest), then load while the models build
        (run_dir / "hf_engine" / MANIFEST).unlink(missing_ok=True)  # not an earlier run's
        fleet = _start_local_fleet(cfg, run_dir)
    try:
        train_rows, val_rows = load_prompts(cfg.data, cfg.data.seed)
        tok = _tokenizer(cfg, run_dir, dims, tokenizer_texts(cfg.env.fn, train_rows))
        cfg.model = _model_config(cfg, tok)
        adapter = LlamaQwen2Adapter(cfg.model)
        if dims.is_rank0:
            _write_engine_folder(run_dir / "hf_engine", adapter, tok)
            if cfg.rollout.engine_addresses:  # engines started elsewhere wait for the folder
                r = cfg.rollout  # (slurm/engine_task.sh); the credential comes from MEGARL_ENGINE_TOKEN_FILE
                fleet = Fleet.attach(r.engine_addresses, r.request_timeout_s, r.engine_start_timeout_s)
            rewards = RewardRunner(cfg.reward, cfg.data)  # reward workers start (and import the rewards) meanwhile too
            envs = start_envs(cfg.env) if cfg.env.fn else None  # so do the environment workers
        actor = _actor(cfg, dims, adapter)
        models = ["actor", "critic"] if cfg.algo.name == "ppo" else ["actor"]
        planner = Planner(PlanSettings.of(cfg), dims.dp, models, critic_dp=critic_dims.dp)
        planner.attach_probe(actor)
        collector = RolloutCollector(CollectSettings.of(cfg), dims, tok, fleet, train_rows, val_rows, rewards, envs)
        sync = WeightSync(actor, adapter, fleet, cfg.weight_sync.bucket_mb, transport=cfg.weight_sync.transport)
        if fleet is not None:
            fleet.restart_in_background = (
                cfg.rollout.engine_restart == "background" and sync.transport.updates_joining_engines
            )
        publisher = _publisher(
            cfg, actor, sync, fleet, integrity_sequence(val_rows, tok, CollectSettings.of(cfg)), collector
        )
        k = cfg.rollout.max_staleness
        rollouts = RolloutPipeline(collector, k) if k else OnPolicy(collector, fleet)
        start = _start(cfg, dims, actor, tok, train_rows, _demonstrations(collector, tok))
        ref, critic = _reference_and_critic(cfg, dims, critic_dims, actor, adapter, planner)
    except BaseException:
        _close(rollouts, fleet, rewards, envs, sync if dims.is_rank0 else None)
        raise
    return Components(
        cfg=cfg,
        dims=dims,
        critic_dims=critic_dims,
        run_dir=run_dir,
        tok=tok,
        adapter=adapter,
        fleet=fleet,
        rewards=rewards,
        envs=envs,
        actor=actor,
        ref=ref,
        critic=critic,
        planner=planner,
        collector=collector,
        rollouts=rollouts,
        advantages=AdvantageEstimator(cfg.algo),
        updater=PolicyUpdater(UpdateSettings.of(cfg), dims, actor, critic, planner),
        publisher=publisher,
        start=start,
    )


def _publisher(
    cfg: RunConfig,
    actor: Model,
    sync: WeightSync,
    fleet: Fleet | None,
    integrity: list[int],
    collector: RolloutCollector,
) -> PolicyPublisher:
    """Phase 5, checking the engines against the trainer on ``integrity`` (the first fitting validation sequence)."""
    return PolicyPublisher(
        cfg.weight_sync, actor, sync, fleet, integrity, ready=collector.fleet_ready, colocate=cfg.rollout.colocate
    )


def _actor(cfg: RunConfig, dims: ParallelDims, adapter: LlamaQwen2Adapter) -> Model:
    """The actor, with ``model.init_from``'s weights when set (no source tensor left out)."""
    actor = build_gpt(cfg.model, cfg.parallel, dims, optim=cfg.optim, track_experts=True)
    if cfg.model.init_from:
        _, hf = read_hf_folder(cfg.model.init_from)
        shapes = {k: list(v.shape) for k, v in hf.items()}
        check_hf_tensors(adapter.hf_shapes(), shapes, tied=cfg.model.tie_embeddings, where=cfg.model.init_from)
        load_hf_tensors(actor, adapter, hf)
    return actor


def _demonstrations(collector: RolloutCollector, tok: PromptTokenizer) -> Example | None:
    """The warm start's examples when the environment demonstrates its task: whole episodes."""
    env_cls = collector.env_cls
    if env_cls is None or not can_demonstrate(env_cls):
        return None
    return functools.partial(demonstrated, env_cls, collector.renderer, tok)


def _start(
    cfg: RunConfig, dims: ParallelDims, actor: Model, tok: PromptTokenizer, rows: list[Any], example: Example | None
) -> Start:
    """The checkpoint to resume from (collective: the same on every rank), or the warm start of
    a fresh run (before the reference copies the actor)."""
    start = Start(resume_from=state.find_resume(cfg.train.run_dir, cfg.train.resume))
    if start.resume_from is None and cfg.warm_start.steps:
        t0 = time.perf_counter()
        done = warm_start(WarmStartSettings.of(cfg), dims, actor, tok, rows, example)
        start.warm_start_nll, start.warm_start_exact = done.nll[-1], done.exact[-1]
        start.warm_start_steps = len(done.nll)
        start.warm_start_s = time.perf_counter() - t0
    return start


def _reference_and_critic(
    cfg: RunConfig,
    dims: ParallelDims,
    critic_dims: ParallelDims,
    actor: Model,
    adapter: LlamaQwen2Adapter,
    planner: Planner,
) -> tuple[Model | None, Model | None]:
    """Frozen reference = copy of the current actor (same layout: shards copy one to one);
    critic (PPO) = actor trunk + zero-initialised value head, own optimizer and LR, on its
    own layout (``critic.parallel``). Across layouts the trunk goes through full HF-named
    tensors (the one Megatron⇄HF adapter), gathered from the actor's shards. A resumed run
    overwrites both from its checkpoint."""
    ref, critic = None, None
    if cfg.algo.kl_coef > 0:
        ref = build_gpt(cfg.model, cfg.parallel, dims, trainable=False)
        _copy_params(actor, ref)
    if cfg.algo.name == "ppo":
        cd = critic_dims
        critic = build_gpt(
            dataclasses.replace(cfg.model, tie_embeddings=False),
            cfg.parallel.critic(cd.tp, cd.pp, cd.dp),
            cd,
            value_head=True,
            optim=dataclasses.replace(cfg.optim, lr=cfg.critic.lr),
            seed=cfg.train.seed,
        )
        if cfg.critic.init_from_actor:
            copy_weights(actor, critic, adapter)
        planner.attach_probe(critic)
    return ref, critic


# ---------------------------------------------------------------------- helpers


def _tokenizer(cfg: RunConfig, run_dir: Path, dims: ParallelDims, texts: list[str]) -> PromptTokenizer:
    """``model.tokenizer``: the model folder's HF tokenizer, or the built-in SentencePiece one
    trained on the task's texts by rank 0 once (``open_tokenizer``)."""
    if dims.is_rank0:
        open_tokenizer(cfg, texts, train=True)
    dist.barrier()
    return cast(PromptTokenizer, open_tokenizer(cfg, texts, train=False))


def _model_config(cfg: RunConfig, tok: PromptTokenizer) -> Any:
    """``model`` with the HF folder's architecture (``init_from``) or the tokenizer's vocabulary."""
    m = cfg.model
    if m.init_from:
        m = model_config_from_hf(json.loads((Path(m.init_from) / "config.json").read_text()), m)
    elif m.vocab_size == 0:
        m = dataclasses.replace(m, vocab_size=tok.vocab_size)
    if m.vocab_size < tok.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} < tokenizer vocabulary {tok.vocab_size} "
            "(the tokenizer could produce ids the model has no embedding for)"
        )
    return m


def _write_engine_folder(model_dir: Path, adapter: LlamaQwen2Adapter, tok: PromptTokenizer) -> None:
    """config.json + weight manifest: engines start with dummy weights and get synced. No
    tokenizer: engines take and return token ids and stop on ``tok.eos_ids`` per request."""
    hf_cfg = adapter.hf_config(*tok.config_ids)
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(model_dir))
    tmp = model_dir / f"{MANIFEST}.tmp"  # the manifest last and whole: engines start on it
    tmp.write_text(json.dumps(adapter.hf_shapes()))
    os.replace(tmp, model_dir / MANIFEST)


def engine_threads(cfg: RunConfig, cores: int, local_ranks: int) -> int:
    """Torch threads of each engine megarl starts (``rollout.engine_threads``; 0 = auto): the
    ``cores`` this process may run on, minus the host's ``local_ranks`` trainer ranks when they
    compute while the fleet generates (pipelined rollouts), shared by the engines; at least 1.
    0 (the engine's inherited setting) on CUDA, where vLLM chooses, and for TP > 1 engines,
    whose workers vLLM binds to cores itself."""
    r = cfg.rollout
    if not r.engine_threads and (torch.cuda.is_available() or r.engine_tp > 1):
        return 0
    return cpu_engine_threads(r.engine_threads, r.max_staleness, cores, r.num_engines, local_ranks)


def _start_local_fleet(cfg: RunConfig, run_dir: Path) -> Fleet:
    r = cfg.rollout
    return Fleet.start_local(
        run_dir / "hf_engine",
        r.num_engines,
        r.engine_tp,
        r.kv_cache_gb,
        run_dir / "logs",
        cfg.train.seed,
        r.request_timeout_s,
        r.engine_start_timeout_s,
        sleep_mode=r.colocate,
        wait=False,
        token=run_token(run_dir),
        lease_s=r.engine_lease_s,
        threads=engine_threads(cfg, len(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        wait_for_model_s=math.inf,  # while the trainer lives (--parent-pid); the start timeout counts from ready()
        cpu_gemm=r.cpu_gemm,
        cpu_sampler=r.cpu_sampler,
        return_routes=cfg.algo.router_replay == "rollout",  # (refused on CPU, AlgoConfig.check_model)
    )


@torch.no_grad()
def _copy_params(src: Model, dst: Model) -> None:
    params = dict(src.core.named_parameters())
    for name, p in dst.core.named_parameters():
        p.copy_(params[name])
    if dst.optimizer is not None and hasattr(dst.optimizer, "reload_model_params"):
        dst.optimizer.reload_model_params()
