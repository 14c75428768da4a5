"""Typed run configuration: one small kw_only dataclass per component.

``load_config(path, overrides)`` (``load``) reads YAML, applies ``--set a.b=c`` overrides,
rejects unknown keys and wrong types (naming the dotted field), and
:func:`validate` (``checks``) applies the cross-field rules before any process
group starts. Sections: ``model`` (model, parallel, optim), ``rollout`` (data, reward,
rollout), ``algo`` (algo, critic, warm start), ``run`` (weight sync, coordinator, train,
RunConfig), ``tracking`` (W&B / MLflow settings, ``train.tracking``); ``hf`` maps an HF
``config.json`` onto a ModelConfig or refuses it; ``docs``
prints the resolved config with each field's docstring. Every error is a
:class:`ConfigError` that names the field, the value and the rule.
"""

from megarl.config.algo import AlgoConfig, CriticConfig, CriticParallelConfig, WarmStartConfig
from megarl.config.checks import validate
from megarl.config.load import load_config, parse_override, to_dict
from megarl.config.model import ModelConfig, OptimConfig, ParallelConfig
from megarl.config.rollout import DataConfig, RewardConfig, RolloutConfig
from megarl.config.run import CoordinatorConfig, RunConfig, TrainConfig, WeightSyncConfig
from megarl.config.tracking import TrackingConfig
from megarl.errors import ConfigError

__all__ = [
    "AlgoConfig",
    "ConfigError",
    "CoordinatorConfig",
    "CriticConfig",
    "CriticParallelConfig",
    "DataConfig",
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
