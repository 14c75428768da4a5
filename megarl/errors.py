"""megarl's domain exceptions, in one place: the failures a user can fix.

Each carries a ``kind`` (``config``, ``data``, ``rollout``, ``weight sync``, ``checkpoint``,
``convert``, ``report``). ``megarl.cli.main`` catches :class:`MegarlError` and prints exactly
one line, ``megarl: <kind> error: <message>``, and exits with code 2; anything else is a bug
and keeps its traceback. Messages name the field, file (and row) or checkpoint, what was
expected and what was found. This module imports nothing from megarl (every layer may raise).
"""

from __future__ import annotations


class MegarlError(Exception):
    """A user-facing failure (bad config, data, checkpoint, engine, ...); one line, exit 2."""

    kind = "megarl"

    @property
    def message(self) -> str:
        # KeyError subclasses would quote str(self); the message is the first argument
        return str(self.args[0]) if len(self.args) == 1 else str(self)


class ConfigError(MegarlError, ValueError):
    """A configuration value is unknown, mistyped or inconsistent."""

    kind = "config"


class RolloutError(MegarlError, RuntimeError):
    """A failed engine request, an engine that will not start, or prompts that cannot be sampled."""

    kind = "rollout"


class EngineDead(RolloutError):
    """An engine did not answer at all (connection refused or reset, timeout): it is down."""


class DataError(RolloutError):
    """Bad prompt data: the message names the file and line (or row) and the field."""

    kind = "data"


class WeightSyncError(MegarlError, RuntimeError):
    """A weight update was rejected; the fleet still serves the previous version."""

    kind = "weight sync"


class CheckpointError(MegarlError, RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model being built."""

    kind = "checkpoint"


class AdapterError(CheckpointError, KeyError):
    """A Megatron or HF parameter name/shape the one Megatron⇄HF adapter does not know."""


class UnsupportedHFModel(MegarlError, ValueError):
    """An HF checkpoint megarl would not reproduce exactly; the message names key and value."""

    kind = "config"


class ConvertError(MegarlError, RuntimeError):
    """``megarl convert`` cannot convert this folder or checkpoint (names the file)."""

    kind = "convert"


class ReportError(MegarlError, RuntimeError):
    """``megarl report`` has no metrics to draw (names the run folder or file)."""

    kind = "report"


class EngineError(RuntimeError):
    """Engine side: a request the engine refuses (HTTP 409); it keeps serving its current
    version. The trainer sees it as a :class:`RolloutError` / :class:`WeightSyncError`."""


class EngineUnhealthy(EngineError):
    """Engine side: the engine cannot serve until restarted (HTTP 503, also on /health)."""


class CredentialError(RuntimeError):
    """Engine side: the run's credential is missing or unsafe to use (the engine will not start)."""
