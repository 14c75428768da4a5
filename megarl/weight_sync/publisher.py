"""Phase 5 of the RL step: publish the actor's current weights to the fleet as a new version.

The publisher owns the policy version: the run's one counter, on every trainer rank,
incremented only by :meth:`PolicyPublisher.push` and checkpointed (key ``"version"``: a
resumed run re-sends the saved version). Everything else reads it: each update carries it
to the engines (the fleet records the version of its last committed update, it counts
nothing), the engines report it with every sample (``RolloutBatch.versions``, data per
sample), and the loop's staleness is this counter minus those.

It also owns the order around a sync: engines healthy → colocated engines wake their weights
→ :meth:`WeightSync.push` → KV cache back → optional integrity check (engine vs trainer
log-probs on one fixed sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megarl.config import WeightSyncConfig
from megarl.fleet.fleet import Fleet
from megarl.model.builder import Model
from megarl.weight_sync.sync import WeightSync, check_integrity


class PolicyPublisher:
    """``settings``: the run's ``weight_sync`` section (integrity check); ``colocate``:
    ``rollout.colocate`` (engines sleep while the trainer runs and wake around a sync)."""

    def __init__(
        self,
        settings: WeightSyncConfig,
        actor: Model,
        sync: WeightSync,
        fleet: Fleet | None,
        integrity_tokens: list[int],
        ready: Callable[[], None],
        *,
        colocate: bool,
    ) -> None:
        self.settings, self.actor, self.sync, self.fleet = settings, actor, sync, fleet
        self.integrity_tokens = integrity_tokens
        self.colocate = colocate
        self._ready = ready  # rank 0: wait for engines spawned at start-up (once)
        self.version = 0
        """The policy version: of the weights last pushed to the fleet (0 = none pushed yet)."""
        self._checked_restarts = -1  # fleet.rejoins at the last integrity check (-1: none yet)

    def push(self) -> dict[str, float]:
        """Collective over the trainer ranks: the actor's weights become version + 1."""
        self._ready()
        self.version += 1
        self._wake(["weights"])  # colocated: weights back on the GPU to be overwritten
        try:
            stats = self.sync.push(self.version)
        finally:
            self._wake(["kv_cache"])  # ... then the KV cache: the fleet serves again
        out = {f"sync/{k}": v for k, v in stats.items()}
        if self._check_due():
            out["sync/integrity_max_abs_diff"] = check_integrity(
                self.actor, self.fleet, self.integrity_tokens, self.settings.integrity_tol
            )
            self._checked_restarts = self._restarts()
        if self.fleet is not None:  # engines restarted so far, including during this sync
            out["fleet/restarts"] = float(self.fleet.restarts)
            out["fleet/rejoins"] = float(self.fleet.rejoins)
        return out

    def _check_due(self) -> bool:
        """Integrity check at this version: the first sync of this process, every
        ``integrity_every``-th version, and the first sync after a restarted engine came back into
        service (the same on every rank: versions are collective and rank 0's count is broadcast)."""
        w = self.settings
        if not w.integrity_check:
            return False
        if self._checked_restarts < 0 or self.version % w.integrity_every == 0:
            return True
        flag = torch.tensor([float(self._restarts() != self._checked_restarts)])
        if dist.is_initialized():
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _restarts(self) -> int:
        return self.fleet.rejoins if self.fleet is not None else 0

    def _wake(self, tags: list[str]) -> None:
        """Colocated engines wake in two steps around a sync (no-op for engines awake)."""
        if self.colocate and self.fleet is not None:
            self.fleet.wake_up(tags)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"]) - 1  # the next push re-sends the saved version
