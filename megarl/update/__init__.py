"""Phases 2–4 and 6 of the RL step on the trainer's Megatron models.

``evaluate``: forward-only old-policy / reference log-probs and critic values (phase 2), and
the teacher-forced answer probability (``train.val_metric: answer_prob``);
``advantages``: rewards (+ KL penalty) → advantages and returns (phase 3);
``optimize``: PPO epochs × mini-batches of actor and critic updates (``Learner`` records, typed
``UpdateRows`` and loss terms), measured by the grad probes for the coordinator (phase 4), and
the step's observation for the planner (phase 6); ``losses``: the policy and value loss
functions it hands to the train step; ``rows``: which rows each DP rank trains on.
"""

from megarl.update.advantages import AdvantageEstimator
from megarl.update.evaluate import answer_probability, evaluate, mismatch
from megarl.update.optimize import Learner, PolicyUpdater, UpdateSettings
from megarl.update.rows import dp_rows

__all__ = [
    "AdvantageEstimator",
    "answer_probability",
    "Learner",
    "PolicyUpdater",
    "UpdateSettings",
    "dp_rows",
    "evaluate",
    "mismatch",
]
