"""Phases 2–4 and 6 of the RL step on the trainer's Megatron models.

``evaluate``: forward-only old-policy / reference log-probs and critic values (phase 2);
``advantages``: rewards (+ KL penalty) → advantages and returns (phase 3);
``optimize``: PPO epochs × mini-batches of actor and critic updates, measured by the grad
probes for the coordinator (phase 4), and the step's observation for the planner (phase 6).
"""

from megarl.update.advantages import AdvantageEstimator
from megarl.update.evaluate import evaluate, mismatch
from megarl.update.optimize import PolicyUpdater
from megarl.update.rows import dp_rows

__all__ = ["AdvantageEstimator", "PolicyUpdater", "dp_rows", "evaluate", "mismatch"]
