"""The ``rollout`` section: prompts × samples per step, lengths, sampling, the vLLM engines and
their resources, and its own checks. The rules it shares with the model (context, KV cache,
engine TP) and the algorithm (group estimators, staleness) are :mod:`megarl.config.cross`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megarl.config.rules import fail


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
    sampling_seed: Literal["round", "prompt"] = "round"
    """What a seeded sample's random stream is keyed by: ``round`` (train.seed, step, sampling
    round, the prompt's place in the round); ``prompt`` (train.seed, the prompt's position in
    the prompt stream, the sample's index in its group): two runs with different batch sizes
    that draw the same prompt at the same position sample it alike while their weights are
    alike (coupled arms, :mod:`megarl.rollout.seeds`). Single-turn rollouts only."""
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
    (:func:`megarl.engine.worker_ext.cpu_gemm_mode`). Engines started elsewhere take
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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = (
        "min_response_len",
        "engine_logprobs_every",
        "engine_threads",
        "max_staleness",
    )

    def validate(self) -> None:
        """Sampling that can feed a group, positive resources and timeouts, lengths and lags in range."""
        if self.temperature < 0:
            fail("rollout.temperature", self.temperature, "must be >= 0")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            fail(
                "rollout.temperature",
                0.0,
                f"is greedy decoding: the rollout.samples_per_prompt={self.samples_per_prompt} samples of a "
                "prompt would be identical (use a temperature > 0, or samples_per_prompt=1 with a non-group "
                "estimator)",
            )
        if not 0 < self.top_p <= 1:
            fail("rollout.top_p", self.top_p, "must be in (0, 1]")
        if not self.kv_cache_gb > 0:
            fail("rollout.kv_cache_gb", self.kv_cache_gb, "must be > 0 (KV cache per engine, GiB)")
        for name, value in (
            ("rollout.engine_start_timeout_s", self.engine_start_timeout_s),
            ("rollout.request_timeout_s", self.request_timeout_s),
        ):
            if not value > 0:
                fail(name, value, "must be > 0")
        self._check_lengths_and_engines()

    def _check_lengths_and_engines(self) -> None:
        if not 0 <= self.min_response_len <= self.max_response_len:
            fail(
                "rollout.min_response_len",
                self.min_response_len,
                f"must be in [0, max_response_len={self.max_response_len}]",
            )
        if self.engine_tp < 1:
            fail("rollout.engine_tp", self.engine_tp, "must be >= 1")
        if self.engine_lease_s and self.engine_lease_s < 15:
            fail("rollout.engine_lease_s", self.engine_lease_s, "must be 0 (off) or >= 15 s (3 heartbeats of 5 s)")
        if self.sampling_seed == "prompt" and not self.seeded:
            fail(
                "rollout.sampling_seed", "prompt", "needs rollout.seeded=true (the engines' own RNG has no seed to key)"
            )
        if self.max_staleness not in (0, 1, 2):
            fail("rollout.max_staleness", self.max_staleness, "must be 0 (generate, then train), 1 or 2")
