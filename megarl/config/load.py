"""Loading a run config: YAML (or defaults) + ``--set a.b=c`` overrides into the typed
sections, rejecting unknown keys and wrong types with a :class:`ConfigError` that names the
dotted field, the value and the rule."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from megarl.config.rules import fail
from megarl.config.run import RunConfig
from megarl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SetText:
    """A ``--set`` value: its text as typed and as YAML reads it. A string field takes the
    text (YAML would cut ``a #1`` at the comment, turn ``no`` into False and ``a: b`` into a
    mapping); every other field takes the YAML value."""

    raw: str
    parsed: Any


def _coerce(path: str, tp: Any, value: Any) -> Any:
    """Check/convert ``value`` to the annotated type ``tp``; raise ConfigError naming path."""
    if isinstance(value, SetText):
        return _coerce(path, tp, value.raw if tp is str else value.parsed)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            fail(path, value, f"must be one of {list(typing.get_args(tp))}")
        return value
    if origin in (list,):
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if isinstance(value, (int, float)):  # '--set reward.weights=1': a list of one
            value = [value]
        if not isinstance(value, list):
            fail(path, value, "must be a list")
        return [_coerce(f"{path}[{i}]", item, v) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(path, arg, value)
            except ConfigError:
                continue
        fail(path, value, f"does not match {tp}")
    if tp is type(None):
        if value is not None:
            fail(path, value, "must be null")
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        fail(path, value, "must be a bool")
    if tp is int:
        if isinstance(value, bool):
            fail(path, value, "must be an int")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        fail(path, value, "must be an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        fail(path, value, "must be a float")
    if tp is str:
        if not isinstance(value, str):
            fail(path, value, "must be a string")
        return value
    raise ConfigError(f"{path}: unsupported annotation {tp}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}' (valid: {sorted(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            value = value.parsed if isinstance(value, SetText) else value
            if not isinstance(value, dict):
                fail(path, value, "must be a mapping")
            kwargs[key] = _build(tp, value, path + ".")  # type: ignore[arg-type]
        else:
            kwargs[key] = _coerce(path, tp, value)
    return cls(**kwargs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last silently: a second ``rollout:`` section would drop the first one's settings)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' given twice (first at line {seen[key].line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def parse_override(text: str) -> tuple[list[str], SetText]:
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw  # not YAML: the text itself (a string field takes it; others say why not)
    return key.strip().split("."), SetText(raw, value)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config and apply ``a.b=c`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if not p.is_file():
            raise ConfigError(f"config file {p} is a directory, not a YAML file")
        try:
            loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}  # noqa: S506 (safe)
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not valid UTF-8 text (byte offset {e.start})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{where}: invalid YAML ({problem})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        data = loaded
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: '{k}' is not a section")
        node[keys[-1]] = value
    return _build(RunConfig, data, "")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
