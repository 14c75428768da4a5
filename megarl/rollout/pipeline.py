"""Rollouts generated ahead of their training step (``rollout.max_staleness`` = k > 0).

The fleet generates step s+k's batch while the trainer updates on step s's, so neither waits
for the other (one-step-off-policy as in verl, AReaL's bounded staleness). One step s:

    issue(s+k)  every rank takes s+k's prompts now (sampler order = step order); rank 0's
                worker thread generates them while the trainer computes
    take(s)     step s's batch, generated earlier, shipped to every rank
    ... log-probs, advantages, update ...
    drain()     before the weight sync: the fleet finishes what it generates, so an update
                never lands in the middle of a generation (weights still sync every step)

Invariants:
- step s's samples come from the policy pushed after update s-k-1: they lag the trainer by
  at most k versions (``RolloutBatch.versions`` records each response's; the loss corrects the
  lag with the behaviour log-probs, ``megarl.update.losses``);
- one worker thread, jobs in issue order: the fleet runs one generation at a time;
- at the end of every step nothing is in flight (drained before the sync), so validation,
  checkpoints and the weight sync see an idle fleet; the batches generated ahead are saved
  with the checkpoint (:meth:`state_dict`): a resumed run trains on exactly them.
- the pipeline keeps k batches ahead even past ``train.steps``: a run stopped by its step
  budget and resumed with more steps equals one run.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.rollout.batch import batch_from_dict, batch_to_dict
from megarl.rollout.collector import RolloutCollector, RolloutJob
from megarl.types import RolloutBatch

if TYPE_CHECKING:  # (the plan is read, not built: the coordinator is a sibling layer)
    from megarl.coordinator import StepPlan

Result = tuple[RolloutBatch, dict[str, float]]


@dataclass
class _Pending:
    step: int
    future: Future[Result] | None = None  # rank 0, while generating
    result: Result | None = None  # rank 0, once known (or restored from a checkpoint)


class RolloutPipeline:
    def __init__(self, collector: RolloutCollector, depth: int) -> None:
        """``depth`` = k, batches generated ahead of the step being trained."""
        if depth < 1:
            raise ValueError(f"RolloutPipeline depth={depth} must be >= 1 (rollout.max_staleness)")
        self.collector, self.depth = collector, depth
        self.rank0 = collector.dims.is_rank0
        self.queue: deque[_Pending] = deque()
        self.next_step = 0
        """The next step whose batch :meth:`issue` would generate."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead") if self.rank0 else None
        self._busy: list[tuple[float, float]] = []  # rank 0: perf_counter spans the worker generated in

    # ------------------------------------------------------------------ schedule

    def wanted(self, step: int) -> list[int]:
        """Steps to issue before training ``step``: up to ``step + depth`` (all of them at the
        first step, one a step afterwards)."""
        first = max(self.next_step, step)
        return list(range(first, step + self.depth + 1))

    def issue(self, step: int, num_prompts: int, samples: int) -> None:
        """Every rank: take ``step``'s prompts; rank 0 starts generating them in the background."""
        if not self.queue and step > self.next_step:  # resumed from a checkpoint saved without batches ahead
            self.next_step = step
        if step != self.next_step:
            raise RuntimeError(f"rollout issued for step {step}, expected step {self.next_step} (steps in order)")
        job = self.collector.issue(step, num_prompts, samples)
        pending = _Pending(step)
        if self._pool is not None:
            pending.future = self._pool.submit(self._run, job)
        self.queue.append(pending)
        self.next_step = step + 1

    # ------------------------------------------------------------------ the RolloutSource

    def start(self, step: int, plan_ahead: Callable[[int], StepPlan]) -> None:
        """Issue the batches of steps up to ``step + depth``, each with the plan made for its
        step now (all of them at the first step, one a step afterwards)."""
        for s in self.wanted(step):
            plan = plan_ahead(s)
            self.issue(s, plan.num_prompts, plan.samples_per_prompt)

    def take(self, step: int, plan: StepPlan | None = None) -> Result:
        """Every rank: step ``step``'s batch (waits for it if it is still being generated; its
        plan was made when it was issued, so ``plan`` is not read)."""
        if not self.queue or self.queue[0].step != step:
            have = [p.step for p in self.queue]
            raise RuntimeError(f"step {step} has no rollout generated ahead (pending steps: {have})")
        head = self.queue.popleft()
        return self.collector.deliver(self._wait(head) if self.rank0 else None)

    def fleet_idle(self, version: int) -> None:
        pass  # the fleet generates the batches ahead meanwhile

    def finish(self) -> None:
        self.drain()

    def drain(self) -> None:
        """Wait until the fleet has generated everything issued (before a weight sync)."""
        for p in self.queue:
            if self.rank0:
                self._wait(p)

    def fleet_busy_s(self, t0: float, t1: float, generate_s: float = 0.0) -> float:
        """Rank 0: seconds of [t0, t1] (perf_counter) the fleet spent generating (its worker's
        spans; the trainer's own wait ``generate_s`` is not the measure here)."""
        self._busy = [(a, b) for a, b in self._busy if b > t0]
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self._busy)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.collector.close()

    def _run(self, job: RolloutJob) -> Result:
        t0 = time.perf_counter()
        try:
            batch, stats = self.collector.run(job)
        finally:
            self._busy.append((t0, time.perf_counter()))
        stats["pipeline/batch_generate_s"] = time.perf_counter() - t0
        return batch, stats

    @staticmethod
    def _wait(p: _Pending) -> Result:
        if p.result is None:
            assert p.future is not None
            p.result = p.future.result()  # a failed generation raises here, in the trainer's thread
        return p.result

    # ------------------------------------------------------------------ checkpoint part

    def state_dict(self) -> dict[str, Any]:
        """The collector's state + the batches generated ahead (rank 0 holds them; rank 0 writes
        the checkpoint's state). Called between steps, when nothing is in flight."""
        ahead = []
        for p in self.queue:
            entry: dict[str, Any] = {"step": p.step}
            if self.rank0:
                batch, stats = self._wait(p)
                entry.update(batch=batch_to_dict(batch), stats=stats)
            ahead.append(entry)
        return {**self.collector.state_dict(), "ahead": ahead, "next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        ahead = state.pop("ahead", [])
        next_step = state.pop("next_step", None)
        self.collector.load_state_dict(state)
        self.queue.clear()
        for entry in ahead:
            result = (batch_from_dict(entry["batch"]), dict(entry["stats"])) if self.rank0 else None
            self.queue.append(_Pending(int(entry["step"]), result=result))
        if next_step is not None:
            self.next_step = int(next_step)
