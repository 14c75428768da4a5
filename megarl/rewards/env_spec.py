"""``env.fn`` resolved: a built-in environment by name, or a user's class imported and checked."""

from __future__ import annotations

from typing import Any

from megarl.rewards.env import EnvSpecError, check_env
from megarl.rewards.specs import RewardSpecError, import_reward
from megarl.rewards.tool_env import ENVS


def import_env(spec: str) -> type:
    """The environment class ``spec`` names (a built-in name, 'module:Class' or 'file.py:Class'),
    checked (:func:`check_env`); EnvSpecError saying what is wrong."""
    if ":" not in spec:
        if spec not in ENVS:
            raise EnvSpecError(
                f"is not a built-in environment ({', '.join(sorted(ENVS))}) "
                "nor 'package.module:Class' / 'path/to/file.py:Class'"
            )
        cls: Any = ENVS[spec]
    else:
        try:
            cls = import_reward(spec)  # (the same resolution as reward.fn: sys.path, or a file)
        except RewardSpecError as e:
            raise EnvSpecError(str(e).replace("reward file", "environment file")) from None
    try:
        check_env(cls)
    except TypeError as e:
        raise EnvSpecError(f"{getattr(cls, '__name__', spec)} {e}") from None
    return cls  # type: ignore[no-any-return]
