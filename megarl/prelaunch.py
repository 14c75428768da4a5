"""What ``megarl train`` checks before any process group or engine starts, beyond the config's
own rules (:meth:`RunConfig.validate`): each reward is imported and its signature checked.
(The launcher then reads every data row, ``megarl.rollout.data.check_data``, and picks the
checkpoint to resume, ``megarl.checkpoint.integrity.choose_resume``.)"""

from __future__ import annotations

from megarl.config import RunConfig
from megarl.rollout.reward_runner import check_reward_config


def check_run(cfg: RunConfig, world_size: int) -> None:
    """Raise ConfigError naming the setting; nothing is started."""
    cfg.validate(world_size)
    check_reward_config(cfg)  # imports each reward and checks its signature
