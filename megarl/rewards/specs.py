"""Reward specs (``reward.fn``) resolved to callables, and checked before launch.

A spec is a built-in name (:mod:`megarl.rewards.builtin`), ``package.module:function`` or
``path/to/file.py:function``; what a reward may take and return is the user's documentation
in :mod:`megarl.rewards.runner`. :func:`load_entry` imports a spec and inspects its signature
(the scorer and each reward worker run it); :func:`check_reward_config` runs it for every
configured spec before any process group or engine starts, so a typo or a wrong signature is a
ConfigError naming ``reward.fn[k]``.

Invariant: a spec that passed :func:`check_reward_config` loads without error later (the
runner relies on it); a file spec loads as one module per absolute path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config import ConfigError, DataConfig, RewardConfig, RunConfig
from megarl.rewards.builtin import NEEDS_PACKAGE, REWARDS

log = logging.getLogger("megarl.rewards")

PARAMS = ("response", "prompt", "answer", "messages", "extra")
"""What a per-sample reward may take, by name."""


class RewardSpecError(ValueError):
    """A spec names no usable reward (unknown name, missing file or attribute, wrong signature)."""


@dataclass(frozen=True)
class Entry:
    """A loaded reward: the function, how to call it, and which named arguments it takes."""

    fn: Callable[..., Any]
    batched: bool
    params: tuple[str, ...] | None
    """Per-sample: the names it takes (None: all of PARAMS, it has ``**kwargs``)."""


def import_reward(spec: str) -> Callable[..., Any]:
    """The callable named by ``spec`` (a built-in name, 'module:function' or 'file.py:function')."""
    if ":" not in spec:
        if spec not in REWARDS:
            raise RewardSpecError(
                f"is not a built-in reward ({', '.join(sorted(REWARDS))}) "
                "nor 'package.module:function' / 'path/to/file.py:function'"
            )
        return REWARDS[spec]
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardSpecError("must be 'package.module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise RewardSpecError(f"reward file {path} does not exist")
        # one module name per file, so two reward files with the same stem do not collide
        name = f"megarl_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if str(path.parent) not in sys.path:  # its own helper modules next to it import as in a script
            sys.path.append(str(path.parent))
        module = sys.modules.get(name)
        if module is None:
            mspec = importlib.util.spec_from_file_location(name, path)
            if mspec is None or mspec.loader is None:
                raise ImportError(f"cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[name] = module  # pickling and dataclasses look the module up by name
            try:
                mspec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:  # the `megarl` console script lacks it
            sys.path.append(os.getcwd())
        module = importlib.import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"{getattr(module, '__file__', target)} has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"'{attr}' is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


def inspect_reward(fn: Callable[..., Any]) -> Entry:
    """How to call ``fn``; TypeError saying what is wrong with its signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"has no inspectable signature ({e})") from e
    ps = list(sig.parameters.values())
    if getattr(fn, "batched", False):
        try:
            sig.bind([])
        except TypeError as e:
            raise TypeError(f"is marked batched but cannot be called as fn(samples): {sig} ({e})") from e
        return Entry(fn, True, None)
    names: list[str] = []
    takes_all = False
    for p in ps:
        if p.kind is p.VAR_KEYWORD:
            takes_all = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.name in PARAMS:
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(f"parameter '{p.name}' is positional-only; rewards get their arguments by name")
            names.append(p.name)
        elif p.default is p.empty:
            raise TypeError(
                f"{sig}: parameter '{p.name}' is not one of {', '.join(PARAMS)} (a per-sample reward takes "
                "these by name; a batched reward fn(samples) needs @megarl.rewards.runner.batched)"
            )
    if not takes_all and "response" not in names:
        raise TypeError(f"{sig} does not take 'response' (per-sample rewards get it by name)")
    return Entry(fn, False, None if takes_all else tuple(names))


def load_entry(spec: str) -> Entry:
    """Import and inspect one spec (also what each worker process runs at start-up)."""
    fn = import_reward(spec)
    try:
        return inspect_reward(fn)
    except TypeError as e:
        raise RewardSpecError(f"wrong signature: {e}") from e


def configured_specs(reward: RewardConfig, data: DataConfig) -> list[tuple[str, str]]:
    """(setting, spec) pairs: ``reward.fn[k]``, the deprecated ``data.reward``, or the default."""
    if reward.fn:
        return [(f"reward.fn[{k}]", s) for k, s in enumerate(reward.fn)]
    if data.reward:
        return [("data.reward", data.reward)]
    return [("reward.fn", "arithmetic" if data.source.startswith("builtin:") else "exact_match")]


def check_reward_config(cfg: RunConfig) -> None:
    """Pre-launch: every reward imports and has a usable signature; sizes are sane."""
    rc = cfg.reward
    if rc.fn and cfg.data.reward:
        raise ConfigError(
            f"data.reward={cfg.data.reward!r} is a deprecated alias of reward.fn and conflicts with "
            f"reward.fn={rc.fn!r}: set reward.fn only"
        )
    if rc.weights and len(rc.weights) != len(rc.fn):
        raise ConfigError(f"reward.weights={rc.weights!r} has {len(rc.weights)} entries, reward.fn has {len(rc.fn)}")
    if not rc.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s={rc.timeout_s!r} must be > 0 seconds")
    for setting, spec in configured_specs(rc, cfg.data):
        pkg = NEEDS_PACKAGE.get(spec)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"{setting}={spec!r} needs the {pkg.replace('_', '-')} package (pip install it)")
        if spec not in REWARDS:  # a module that hangs at import then shows where the launch stopped
            log.info("checking %s=%r: importing it", setting, spec)
        try:
            load_entry(spec)
        except (Exception, SystemExit) as e:  # the user's import-time error, named
            raise ConfigError(f"{setting}={spec!r} {_reason(e)}") from e


def _reason(e: BaseException) -> str:
    if isinstance(e, RewardSpecError):
        return str(e)
    return f"cannot be imported: {type(e).__name__}: {e}"  # raised by the user's module


def absolute_spec(spec: str) -> str:
    """A file spec with an absolute path (workers and ranks may resolve it elsewhere)."""
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target or os.sep in target):
        return f"{Path(target).resolve()}:{attr}"
    return spec


def metric_names(specs: list[str]) -> list[str]:
    """Metric names: the built-in name or the function name, made unique."""
    out: list[str] = []
    for s in specs:
        base = s.rpartition(":")[2].rpartition(".")[2] or s
        name, j = base, 2
        while name in out:
            name, j = f"{base}_{j}", j + 1
        out.append(name)
    return out
