"""Where a step's rollout batch comes from: one :class:`RolloutSource`, chosen when the run is built.

    OnPolicy          (``rollout.max_staleness`` = 0) the step generates its batch when it
                      needs it, with the policy the trainer has now; the fleet idles meanwhile
    RolloutPipeline   (``rollout.max_staleness`` = k > 0, ``megarl.rollout.pipeline``) the fleet
                      generates step s+k's batch while the trainer updates on step s's

The loop calls the same four methods on either, in this order, and never asks which it has:

    start(step, plan_ahead)   before the step's plan: batches ahead issued (pipelined)
    take(step, plan)          the step's batch and its rollout metrics, on every rank
    fleet_idle(version)       the trainer computes now; the fleet has nothing of this step left
    finish()                  before the weight sync: nothing generating when weights change

and reads :meth:`fleet_busy_s` for the step's ``pipeline/fleet_wait_frac``. Each source is a
checkpoint part (``rollouts``) and closes what it started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from megarl.errors import RolloutError
from megarl.fleet import faults
from megarl.fleet.fleet import Fleet
from megarl.rollout.collector import RolloutCollector
from megarl.types import RolloutBatch

if TYPE_CHECKING:  # (the plan is read, not built: the coordinator is a sibling layer)
    from megarl.coordinator import StepPlan

Result = tuple[RolloutBatch, dict[str, float]]


class RolloutSource(Protocol):
    def start(self, step: int, plan_ahead: Callable[[int], StepPlan]) -> None:
        """Before step ``step`` is planned (``plan_ahead(s)``: the plan of a later step ``s``)."""
        ...

    def take(self, step: int, plan: StepPlan) -> Result:
        """Every rank: step ``step``'s batch (``plan``'s prompts × samples per prompt)."""
        ...

    def fleet_idle(self, version: int) -> None:
        """The trainer computes on the batch (log-probs); test faults that hit an idle fleet fire here."""
        ...

    def finish(self) -> None:
        """Before the weight sync: the fleet generates nothing."""
        ...

    def fleet_busy_s(self, t0: float, t1: float, generate_s: float) -> float:
        """Rank 0: seconds of the step's window [t0, t1] the fleet spent generating
        (``generate_s``: the trainer's own wait for rollouts this step)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class OnPolicy:
    """The step's batch generated in the step, by the policy the trainer holds (phase 1)."""

    def __init__(self, collector: RolloutCollector, fleet: Fleet | None) -> None:
        self.collector, self.fleet = collector, fleet

    def start(self, step: int, plan_ahead: Callable[[int], StepPlan]) -> None:
        pass  # nothing is generated ahead of its step

    def take(self, step: int, plan: StepPlan) -> Result:
        return self.collector.collect(step, plan.num_prompts, plan.samples_per_prompt)

    def fleet_idle(self, version: int) -> None:
        if self.fleet is not None:  # test-only: an engine killed while idle (fleet/faults.py)
            faults.inject("logprobs", version, self.fleet.engines)

    def finish(self) -> None:
        pass  # generation ended inside take()

    def fleet_busy_s(self, t0: float, t1: float, generate_s: float) -> float:
        return generate_s  # the fleet generates exactly while the trainer waits for it

    def state_dict(self) -> dict[str, Any]:
        return self.collector.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("ahead"):
            raise RolloutError(
                f"the checkpoint holds {len(state['ahead'])} rollout batches generated ahead of their step "
                "(saved with rollout.max_staleness > 0); resume with the same rollout.max_staleness"
            )
        self.collector.load_state_dict(state)

    def close(self) -> None:
        self.collector.close()
