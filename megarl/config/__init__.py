"""Typed run configuration: one small kw_only dataclass per section, one module each, with the
section's own checks (its ``validate()``) beside its fields.

``load_config(path, overrides)`` (``load``) reads YAML, applies ``--set a.b=c`` overrides,
rejects unknown keys and wrong types (naming the dotted field), and :func:`validate` (``cross``)
applies every rule before any process group starts: the generic ones (``rules``), each
section's and those across sections (``cross``). Sections: ``model``, ``parallel``, ``optim``,
``data``, ``reward``, ``rollout``, ``env``, ``algo``, ``critic`` (and ``critic.parallel``),
``warm_start``, ``weight_sync``, ``coordinator``, ``train`` and ``tracking`` (``train.tracking``);
``run`` holds :class:`RunConfig`, one of each. ``hf`` maps an HF ``config.json`` onto a
ModelConfig or refuses it (the model check needs it at load time); ``docs`` prints the
resolved config with each field's docstring. Every error is a :class:`ConfigError` that names
the field, the value and the rule.
"""

from megarl.config.algo import AlgoConfig
from megarl.config.coordinator import CoordinatorConfig
from megarl.config.critic import CriticConfig, CriticParallelConfig
from megarl.config.cross import validate
from megarl.config.data import DataConfig
from megarl.config.env import EnvConfig
from megarl.config.load import load_config, parse_override, to_dict
from megarl.config.model import ModelConfig
from megarl.config.optim import OptimConfig
from megarl.config.parallel import ParallelConfig
from megarl.config.reward import RewardConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.run import RunConfig
from megarl.config.tracking import TrackingConfig
from megarl.config.train import TrainConfig
from megarl.config.warm_start import WarmStartConfig
from megarl.config.weight_sync import WeightSyncConfig
from megarl.errors import ConfigError

__all__ = [
    "AlgoConfig",
    "ConfigError",
    "CoordinatorConfig",
    "CriticConfig",
    "CriticParallelConfig",
    "DataConfig",
    "EnvConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainConfig",
    "WarmStartConfig",
    "WeightSyncConfig",
    "load_config",
    "parse_override",
    "to_dict",
    "validate",
]
