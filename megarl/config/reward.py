"""The ``reward`` section: which reward functions score a response, their weights, and the
worker processes that run them. Each reward is imported and its signature checked before the
run starts (:func:`megarl.rewards.runner.check_reward_config`, called by
:func:`megarl.prelaunch.check_run`), not here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


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

    ZERO_ALLOWED: ClassVar[tuple[str, ...]] = ("max_tasks_per_worker", "worker_memory_mb", "stop_after_failed_steps")
