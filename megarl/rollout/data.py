"""Prompt data: the built-in arithmetic task, JSONL / Parquet files, and a resumable sampler.

Every row becomes a :class:`PromptRecord` (prompt text, reference answer, source location).
A malformed row raises :class:`RolloutError` naming the file and line; a prompt longer than
``rollout.max_prompt_len`` tokens is skipped or truncated by config and always counted.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config import DataConfig


class RolloutError(RuntimeError):
    """Bad prompt data, a failed engine request or a failed reward."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    answer: str
    where: str
    """'file:line' (or 'builtin:i') — used in error messages."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other fields, passed to rewards."""
    messages: list[dict] | None = None
    """The row's chat messages (None for a plain prompt), passed to rewards."""


def arithmetic_rows(n: int, max_operand: int, seed: int) -> list[PromptRecord]:
    """Two-operand addition/subtraction: prompt 'a+b=' with answer str(a+b)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        if rng.random() < 0.5:
            rows.append(PromptRecord(f"{a}+{b}=", str(a + b), f"builtin:{i}"))
        else:
            a, b = max(a, b), min(a, b)
            rows.append(PromptRecord(f"{a}-{b}=", str(a - b), f"builtin:{i}"))
    return rows


def _rows_from_file(path: Path, cfg: DataConfig) -> list[PromptRecord]:
    if not path.exists():
        raise RolloutError(f"prompt file {path} does not exist")
    raw: list[tuple[str, Any]] = []
    if path.suffix == ".jsonl":
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    raw.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise RolloutError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            raw.append((f"{path}:row {i}", row))
    else:
        raise RolloutError(f"{path}: unsupported prompt file type (use .jsonl or .parquet)")
    out: list[PromptRecord] = []
    for where, row in raw:
        if not isinstance(row, dict):
            raise RolloutError(f"{where}: row must be an object, got {type(row).__name__}")
        for key in (cfg.prompt_key, cfg.answer_key):
            if key not in row:
                raise RolloutError(f"{where}: missing field '{key}'")
            if not isinstance(row[key], (str, int, float)):
                raise RolloutError(f"{where}: field '{key}' must be a string")
        out.append(PromptRecord(str(row[cfg.prompt_key]), str(row[cfg.answer_key]), where))
    return out


def load_prompts(cfg: DataConfig, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, validation) prompt records."""
    if cfg.source.startswith("builtin:"):
        name = cfg.source.split(":", 1)[1]
        if name != "arithmetic":
            raise RolloutError(f"data.source: unknown built-in task '{name}' (known: arithmetic)")
        train = arithmetic_rows(cfg.num_train, cfg.max_operand, seed)
        val = arithmetic_rows(cfg.num_val, cfg.max_operand, seed + 7919)
        return train, val
    rows: list[PromptRecord] = []
    for part in cfg.source.split(","):
        rows.extend(_rows_from_file(Path(part.strip()), cfg))
    if len(rows) <= cfg.num_val:
        raise RolloutError(f"data.source has {len(rows)} rows, need more than data.num_val={cfg.num_val}")
    return rows[: -cfg.num_val], rows[-cfg.num_val :]


class PromptSampler:
    """Epoch-wise seeded shuffle; ``state_dict`` = (epoch, position) so a resume replays nothing."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise RolloutError("no prompts to sample from")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            take = min(k - len(out), self.n - self.pos)
            out.extend(self._order[self.pos : self.pos + take])
            self.pos += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise RolloutError(f"sampler state is for {state['n']} prompts, data has {self.n}")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._perm()
