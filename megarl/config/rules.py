"""The helpers every config rule uses: walk a config's fields by dotted name, fail naming the
field, its value and the rule (:class:`ConfigError`); and the two rules every field obeys,
whatever its section: an int is positive (unless its section lists it in ``ZERO_ALLOWED``, where
0 means off, auto or none) and a float is finite."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from megarl.errors import ConfigError


def walk(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.extend(walk(v, name + "."))
        else:
            out.append((name, v))
    return out


def fail(field_name: str, value: Any, rule: str) -> typing.NoReturn:
    raise ConfigError(f"{field_name}={value!r} {rule}")


def positive_ints(cfg: Any, prefix: str = "") -> None:
    """Every int field, at any depth in field order, is > 0, or >= 0 when its section's
    ``ZERO_ALLOWED`` names it."""
    zero_allowed = getattr(type(cfg), "ZERO_ALLOWED", ())
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            positive_ints(value, name + ".")
        elif isinstance(value, int) and not isinstance(value, bool):
            if value < 0 or (value == 0 and f.name not in zero_allowed):
                fail(name, value, "must be a positive integer")


def finite_floats(cfg: Any) -> None:
    """No NaN or infinity in any float setting (a NaN reward or KL weight surfaces steps later as
    NaN weights, blamed on the weight sync)."""
    for path, value in walk(cfg):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            fail(path, value, "must be a finite number")
