"""``megarl train --print-config``: the resolved config as YAML, each field with its docstring.

The config dataclasses document every field with a string literal under it (Megatron-core's
style); Python keeps no such attribute docstrings at run time, so they are read from the
class source with :mod:`ast`. The output is valid YAML (docs are comments): it can be saved
and passed back with ``--config``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import yaml


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring on one line} of a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def explain(cfg: Any, indent: int = 0) -> str:
    """YAML of a config dataclass with one ``# doc`` comment per field."""
    lines: list[str] = []
    docs = field_docs(type(cfg))
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        value, doc = getattr(cfg, f.name), docs.get(f.name, "")
        comment = f"  # {doc}" if doc else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:{comment}")
            lines.append(explain(value, indent + 1))
        else:
            lines.append(f"{pad}{f.name}: {_scalar(value)}{comment}")
    return "\n".join(lines)
