"""The two helpers every config rule uses: walk a config's fields by dotted name, and fail
naming the field, its value and the rule (:class:`ConfigError`)."""

from __future__ import annotations

import dataclasses
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


# --------------------------------------------------------------------------- loading
