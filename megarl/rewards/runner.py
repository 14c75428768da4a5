"""Rewards as the user configures them: resolve ``reward.fn``, check them before launch, score.

**Specs** (``reward.fn``, a list): a built-in name (``arithmetic``, ``exact_match``,
``answer_prefix``, ``math``: :mod:`megarl.rewards.builtin`); ``package.module:function``
(imported from ``sys.path``: PYTHONPATH or the working directory); or
``path/to/file.py:function`` (relative to the working directory). With several specs a
sample's reward is ``sum(weights[k] * reward_k)`` (``reward.weights``, default all 1).

**Per-sample rewards** (the default) take, by name, any of::

    response: str                  the decoded response, special tokens stripped
    prompt: str                    the prompt text sent to the engine
    answer: str                    the row's reference answer
    messages: list[dict] | None    the row's chat messages (None for a plain prompt)
    extra: dict                    the row's other fields

and return a number (bool, int or float)::

    def reward(response, answer, extra):  # declare only what you use; **kwargs gets all
        return float(response.strip() == answer and extra.get("difficulty") == "easy")

**Batched rewards** are marked with :func:`batched` (or an attribute ``batched = True``),
take one ``list[RewardSample]`` and return one number per sample, in order.

**Isolation.** User rewards run in a pool of worker processes (:mod:`megarl.rewards.pool`) with a
per-call timeout (``reward.timeout_s``): a reward that raises, returns a non-number, hangs or
kills its interpreter fails only its own sample(s), which get ``reward.failed_reward`` as
their whole reward, not a partial weighted sum that would look like a real score (counted: ``rollout/reward_failures``, ``_timeouts``, ``_crashes``, ``_errors``; one log line
per step names a sample or two). Built-ins run in-process unless ``reward.isolate_builtins``.

**Before launch** :func:`megarl.rewards.specs.check_reward_config` imports every spec and
checks its signature, so a typo or a wrong signature fails as a ConfigError naming
``reward.fn[k]`` before any process group or engine starts (resolving specs is
:mod:`megarl.rewards.specs`; this module scores).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.config import DataConfig, RewardConfig
from megarl.errors import RolloutError
from megarl.rewards.builtin import REWARDS
from megarl.rewards.pool import Outcome, RewardPool
from megarl.rewards.specs import PARAMS, Entry, absolute_spec, configured_specs, load_entry, metric_names

log = logging.getLogger("megarl.rewards")


@dataclass(frozen=True)
class RewardSample:
    """One response to score, with its prompt row. ``where`` names it in logs ('file:line #j')."""

    response: str
    prompt: str
    answer: str = ""
    messages: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn(samples: list[RewardSample]) -> list[float]`` as a batched reward."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


# ---------------------------------------------------------------------- calling


def _number(value: Any) -> float:
    if type(value) is float:  # the usual answer, without the ABC check below (~40 % of scoring a sample)
        out = value
    else:
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy / torch scalar
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise TypeError(f"reward returned {type(value).__name__} {value!r}, not a number")
        out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward returned {out}")
    return out


def invoke(entry: Entry, payload: Any) -> Any:
    """Call one reward: per-sample → float; batched → one float (or error text) per sample."""
    if entry.batched:
        samples = list(payload)
        values = entry.fn(samples)
        if getattr(values, "ndim", None) == 1 and hasattr(values, "tolist"):  # a numpy array / torch tensor
            values = values.tolist()
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != len(samples):
            got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
            raise TypeError(f"batched reward returned {got} for {len(samples)} samples")
        out: list[float | str] = []
        for v in values:
            try:
                out.append(_number(v))
            except (TypeError, ValueError) as e:
                out.append(f"{type(e).__name__}: {e}")
        return out
    s: RewardSample = payload
    names = PARAMS if entry.params is None else entry.params
    return _number(entry.fn(**{n: getattr(s, n) for n in names}))


def _inline(entry: Entry, payload: Any) -> Outcome:
    try:
        return Outcome("ok", value=invoke(entry, payload))
    except Exception as e:  # a built-in that raises fails its sample, counted, like a user reward
        return Outcome("error", error=f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------------- scoring


@dataclass
class RewardReport:
    """What scoring some samples went like; merged over a step's rounds."""

    samples: int = 0
    failures: int = 0
    """Samples that got ``reward.failed_reward`` (any of their rewards failed)."""
    timeouts: int = 0
    """Calls killed at ``reward.timeout_s``."""
    crashes: int = 0
    """Calls whose worker process died."""
    errors: int = 0
    """Calls that raised or returned a non-number."""
    examples: list[str] = field(default_factory=list)
    """The first failures, named ('file:line #j: reward name: what happened')."""
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    """Per reward name: sum and number of its successful values (for its mean)."""

    def merge(self, o: RewardReport) -> None:
        self.samples += o.samples
        self.failures += o.failures
        self.timeouts += o.timeouts
        self.crashes += o.crashes
        self.errors += o.errors
        self.examples = (self.examples + o.examples)[:2]
        for k, v in o.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + o.counts[k]

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        out = {
            f"{prefix}reward_failures": float(self.failures),
            f"{prefix}reward_timeouts": float(self.timeouts),
            f"{prefix}reward_crashes": float(self.crashes),
            f"{prefix}reward_errors": float(self.errors),
        }
        if len(self.sums) > 1:  # several rewards: each one's mean, before weighting
            out.update({f"{prefix}reward/{k}_mean": v / max(self.counts[k], 1) for k, v in self.sums.items()})
        return out

    def summary(self, failed_reward: float) -> str:
        """One line for the log ('' when nothing failed)."""
        if not self.failures:
            return ""
        return (
            f"{self.failures} of {self.samples} samples got reward.failed_reward={failed_reward:g} "
            f"({self.timeouts} timed out, {self.crashes} crashed their worker, {self.errors} raised); "
            f"e.g. {'; '.join(self.examples)}"
        )


def failed_steps_check(report: RewardReport, failed_steps: int, limit: int, step: int) -> int:
    """Consecutive steps so far in which every sample's reward failed (``report`` is this
    step's); raises once they reach ``limit`` (0: never): nothing is learned from rewards that
    are all ``reward.failed_reward``, and the reward code is what to fix."""
    failed_steps = failed_steps + 1 if report.samples and report.failures == report.samples else 0
    if limit and failed_steps >= limit:
        raise RolloutError(
            f"step {step}: the reward failed on every sample for {failed_steps} steps in a row "
            f"(reward.stop_after_failed_steps={limit}); this step: {report.samples} samples, {report.timeouts} "
            f"timed out, {report.crashes} crashed their worker, {report.errors} raised or returned a non-number, "
            f"e.g. {'; '.join(report.examples)}. Fix reward.fn and resume."
        )
    return failed_steps


class RewardRunner:
    """Rank 0's rewards: in-process built-ins and a worker pool for the rest."""

    def __init__(self, reward: RewardConfig, data: DataConfig) -> None:
        """``data``: where the deprecated ``data.reward`` and the default reward come from."""
        rc = self.cfg = reward
        if data.reward:
            log.warning("data.reward is deprecated: use reward.fn (the 'reward' section)")
        self.specs = [absolute_spec(spec) for _, spec in configured_specs(reward, data)]
        self.weights = list(rc.weights) or [1.0] * len(self.specs)
        self.names = metric_names(self.specs)
        self.isolated = [rc.isolate_builtins or s not in REWARDS for s in self.specs]
        loaded = [load_entry(s) for s in self.specs]  # checked before launch: this does not fail
        self._batched = [e.batched for e in loaded]
        self.entries: list[Entry | None] = [None if iso else e for e, iso in zip(loaded, self.isolated)]
        """The in-process rewards (None: it runs in the pool)."""
        pooled = [s for s, iso in zip(self.specs, self.isolated) if iso]
        self._pool_index = {k: pooled.index(s) for k, s in enumerate(self.specs) if self.isolated[k]}
        self.pool = (
            RewardPool(
                pooled,
                load_entry,
                invoke,
                workers=rc.workers,
                timeout_s=rc.timeout_s,
                max_tasks=rc.max_tasks_per_worker,
                memory_mb=rc.worker_memory_mb,
            )
            if pooled
            else None
        )

    def score(self, samples: list[RewardSample]) -> tuple[list[float], RewardReport]:
        """(reward per sample, report). Never raises for a failing reward."""
        n, K = len(samples), len(self.specs)
        values: list[list[float | None]] = [[None] * n for _ in range(K)]
        report = RewardReport(samples=n)
        failed: dict[int, str] = {}  # sample -> first failure, for the log
        calls: list[tuple[int, Any]] = []
        routes: list[tuple[int, list[int], bool]] = []  # (reward k, sample indices, batched)
        inline: list[tuple[int, list[int], bool, Outcome]] = []
        for k, entry in enumerate(self.entries):
            if entry is not None:  # in-process
                if entry.batched:
                    inline.append((k, list(range(n)), True, _inline(entry, samples)))
                else:
                    inline.extend((k, [i], False, _inline(entry, s)) for i, s in enumerate(samples))
            elif self._batched[k]:  # the batch is split over the workers
                for chunk in _chunks(n, max(self.cfg.workers, 1)):
                    calls.append((self._pool_index[k], [samples[i] for i in chunk]))
                    routes.append((k, chunk, True))
            else:
                for i, s in enumerate(samples):
                    calls.append((self._pool_index[k], s))
                    routes.append((k, [i], False))
        outcomes = self.pool.run(calls) if self.pool is not None and calls else []
        done = [(k, idx, b, o) for (k, idx, b), o in zip(routes, outcomes)] + inline
        for k, idx, is_batched, o in done:
            if o.kind != "ok":
                report.timeouts += o.kind == "timeout"
                report.crashes += o.kind == "crash"
                report.errors += o.kind == "error"
                for i in idx:
                    failed.setdefault(i, f"{samples[i].where}: {self.names[k]}: {o.error}")
                continue
            for i, v in zip(idx, o.value if is_batched else [o.value]):
                if isinstance(v, str):  # one bad value of a batched reward
                    report.errors += 1
                    failed.setdefault(i, f"{samples[i].where}: {self.names[k]}: {v}")
                else:
                    values[k][i] = v
        totals: list[float] = []
        for i in range(n):
            if i in failed:
                totals.append(self.cfg.failed_reward)
            else:
                totals.append(sum(w * (values[k][i] or 0.0) for k, w in enumerate(self.weights)))
        report.failures = len(failed)
        report.examples = [failed[i] for i in sorted(failed)[:2]]
        for k, name in enumerate(self.names):
            ok = [v for v in values[k] if v is not None]
            report.sums[name], report.counts[name] = sum(ok), len(ok)
        return totals, report

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _chunks(n: int, parts: int) -> list[list[int]]:
    size = -(-n // parts) if n else 1
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
