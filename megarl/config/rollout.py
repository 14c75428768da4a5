"""Run config sections for what is sampled and scored: prompt data, rewards, rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def cpu_engine_threads(threads: int, max_staleness: int, cores: int, engines: int, trainer_ranks: int) -> int:
    """Torch threads of each of ``engines`` CPU engines on a host with ``cores`` CPUs and
    ``trainer_ranks`` trainer ranks: ``rollout.engine_threads`` when set, else (0 = auto) the
    cores shared by the engines, less the trainer ranks when they compute while the fleet
    generates (``max_staleness`` > 0); at least 1. One rule for the engines the trainer starts
    (:func:`megarl.components.engine_threads`) and those the SLURM scripts start
    (``slurm/engine_task.sh``, per node)."""
    if threads:
        return threads
    busy = trainer_ranks if max_staleness > 0 else 0
    return max(1, (cores - busy) // engines)


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin:arithmetic"
    """'builtin:arithmetic', a .jsonl/.parquet file or an HF datasets save_to_disk folder
    (or several, comma-separated)."""
    prompt_key: str = "prompt"
    """Field holding the prompt text in file rows."""
    messages_key: str = "messages"
    """Field holding OpenAI-style chat turns ([{role, content}]); used instead of the prompt."""
    chat_template: str = "auto"
    """'auto' (the HF tokenizer's own template: applied to chat rows and to plain prompts as one
    user turn), 'none' (plain prompts as raw text), or a Jinja template file."""
    system_prompt: str = ""
    """System turn put first in every templated prompt that has none ('' = none)."""
    answer_key: str = "answer"
    """Field holding the reference answer in file rows."""
    num_train: int = 20000
    """Built-in task: training prompts generated."""
    num_val: int = 128
    """Validation prompts (built-in: generated; files: the last rows)."""
    max_operand: int = 50
    """Built-in arithmetic task: operands are drawn from [0, max_operand)."""
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    """What to do with a prompt longer than rollout.max_prompt_len (always counted)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded, resumable)."""
    seed: int = 1234
    """Seed of the built-in task's data (and so of its tokenizer); separate from train.seed."""
    reward: str = ""
    """Deprecated alias of ``reward.fn`` (one built-in name); use the ``reward`` section."""


@dataclass(kw_only=True)
class RewardConfig:
    fn: list[str] = field(default_factory=list)
    """Reward functions: built-in names (arithmetic, exact_match, answer_prefix, math),
    'package.module:function' or 'path/to/file.py:function' (megarl/rewards/runner.py
    documents the signature). Empty = 'arithmetic' for built-in data, else 'exact_match'."""
    weights: list[float] = field(default_factory=list)
    """Weight of each reward in ``fn``; a sample's reward is the weighted sum. Empty = all 1."""
    timeout_s: float = 10.0
    """Per-call limit of a reward in the worker pool, seconds; past it the worker is killed."""
    workers: int = 2
    """Reward worker processes on rank 0 (started only for rewards that run isolated)."""
    max_tasks_per_worker: int = 1000
    """Calls a worker serves before it is replaced (bounds slow memory leaks; 0 = never)."""
    worker_memory_mb: int = 0
    """Address-space limit of each worker, MiB (a reward over it fails with MemoryError; 0 = none)."""
    failed_reward: float = 0.0
    """Reward of a sample whose reward call raised, timed out or crashed its worker."""
    stop_after_failed_steps: int = 3
    """Stop the run (it can resume) once every sample's reward failed in this many consecutive
    steps: the reward is broken and every advantage is 0. A shorter outage (a verifier service
    down for a step or two) is survived. 0 = never stop."""
    isolate_builtins: bool = False
    """Run the built-in rewards in the worker pool too (default: in-process, they are trusted)."""


@dataclass(kw_only=True)
class RolloutConfig:
    num_prompts: int = 16
    """Prompts per RL step."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group size)."""
    max_prompt_len: int = 24
    """Prompt limit, tokens."""
    max_response_len: int = 12
    """Response limit, tokens."""
    min_response_len: int = 0
    """EOS is suppressed until a response has this many tokens (vLLM min_tokens; 0 = off)."""
    seeded: bool = True
    """Per-prompt sampling seeds: samples are reproducible (exact resume, same samples on any
    engine). False = the engines' own RNG: faster with many short responses (vLLM draws
    seeded requests one by one), but a resumed run samples differently."""
    temperature: float = 1.0
    """Sampling temperature (logprobs on both sides use logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    engine_logprobs_every: int = 10
    """Ask the engines for the sampled tokens' log-probs on every this many steps (the first
    step, then every k-th; 1 = every step, 0 = never). Only the train/inference mismatch
    metrics (``rollout/mismatch_*``, ``train/engine_*``) read them then, so they are logged on
    those steps only; vLLM's per-token log-prob work is ~10 % of a demo generation. The loss
    needs them on every step with ``algo.tis_cap`` > 0 or ``rollout.max_staleness`` > 0, and
    then they are always requested (verl's ``rollout.calculate_log_probs``, default off)."""
    num_engines: int = 1
    """vLLM engines started by megarl (ignored when engine_addresses is set)."""
    engine_tp: int = 1
    """Tensor-parallel size of each engine."""
    engine_threads: int = 0
    """Torch threads of each engine megarl starts on a machine without CUDA (its OMP_NUM_THREADS).
    0 = auto: with ``max_staleness`` 0 the trainer waits while the fleet generates, so the
    engines share the cores this process may run on; with pipelined rollouts they share what the
    host's trainer ranks leave, at least 1 each (:func:`megarl.components.engine_threads`).
    Engines with ``engine_tp`` > 1 bind their workers through vLLM (VLLM_CPU_OMP_THREADS_BIND).
    CPU engines the SLURM scripts start apply the same rule per node (``slurm/engine_task.sh``)."""
    cpu_gemm: Literal["auto", "packed", "plain"] = "auto"
    """Linear layers of a CPU engine megarl starts: ``packed`` (vLLM's oneDNN kernels; an update
    is vLLM's layer-wise reload and repack), ``plain`` (``F.linear`` on the weights; an update is
    a copy in place); ``auto``: plain up to hidden size 256, where packing does not decode faster
    (:func:`megarl.engine.vllm_engine.cpu_gemm_mode`). Engines started elsewhere take
    ``--cpu-gemm`` (SLURM: ``MEGARL_ENGINE_ARGS``). No effect on GPU engines."""
    cpu_sampler: Literal["batched", "vllm"] = "batched"
    """How a CPU engine megarl starts seeds the noise of a seeded request's token: ``batched``
    hashes (request seed, draw index) for all rows of a decode step at once; ``vllm`` draws
    from each request's generator, one Python call per row (~3.5 us each, ~10 ms of a demo
    generation). Both give each request tokens that depend on its seed only, not on its batch;
    they are different streams (:mod:`megarl.engine.cpu_sampler`). Engines started elsewhere
    take ``--cpu-sampler``. No effect on GPU engines."""
    engine_addresses: list[str] = field(default_factory=list)
    """host:port of engines started elsewhere (e.g. by srun); empty = start locally."""
    kv_cache_gb: float = 0.25
    """KV cache per engine on CPU, GiB."""
    engine_restart: Literal["background", "blocking"] = "background"
    """A local engine that dies while others serve: ``background`` restarts it in its own thread
    (at low CPU priority) while the others take its prompts, and it serves again from the next
    weight update; ``blocking`` restarts it and gives it the current weights before the fleet
    goes on (the step waits). A fleet of one, and the nccl / cuda_ipc transports and http with
    pipeline_parallel > 1 (which cannot update a joining engine alone), always block."""
    engine_start_timeout_s: float = 300.0
    """Give up on an engine that is not healthy after this long, seconds."""
    request_timeout_s: float = 600.0
    """HTTP timeout for one engine request, seconds."""
    engine_lease_s: float = 120.0
    """Engines megarl starts exit after this long without a request or heartbeat (sent every
    5 s) from the trainer, seconds; they also exit as soon as the trainer process is gone.
    0 = no lease. Engines started by SLURM take MEGARL_ENGINE_LEASE_S instead."""
    dump_rollouts: bool = False
    """Rank 0 appends every step's prompt ids, response ids and texts to run_dir/rollouts.jsonl."""
    max_staleness: int = 0
    """Policy versions a training batch may lag the trainer (0 | 1 | 2). 0 = generate, then train
    (today's loop). k > 0 = the fleet generates the batch of step s+k while the trainer updates on
    step s (weights still synced every step, with the fleet idle); the loss corrects the lag with
    decoupled PPO (needs ``algo.tis_cap`` > 0). Each step's batch is generated k steps ahead, also
    past ``train.steps`` (the checkpoint saves it: exact resume)."""
    colocate: bool = False
    """Engines share the trainer's GPUs: vLLM sleep mode frees their memory while the trainer
    works (sleep after generation, wake weights before a sync, KV cache after it). CUDA only."""
