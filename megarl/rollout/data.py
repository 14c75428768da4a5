"""Prompt data: the built-in arithmetic task, JSONL / Parquet files / HF ``save_to_disk``
folders, and a resumable sampler.

Every row becomes a :class:`PromptRecord` (prompt text or chat ``messages``, reference answer,
the row's other fields, source location); the tokenizer turns it into prompt ids.
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
    messages: list[dict[str, Any]] | None = None
    """OpenAI-style chat turns ({'role', 'content'}); the tokenizer's chat template makes the prompt."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other fields (answer, test cases, metadata), passed along to the reward."""


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
    elif path.is_dir():  # a folder written by HF datasets' save_to_disk
        from megarl.rollout.saved_dataset import read_saved_dataset

        raw.extend(read_saved_dataset(path))
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
        messages = chat_messages(row, cfg.messages_key, where)
        for key in (cfg.answer_key,) if messages is not None else (cfg.prompt_key, cfg.answer_key):
            if key not in row:
                raise RolloutError(f"{where}: missing field '{key}'")
            if not isinstance(row[key], (str, int, float)):
                raise RolloutError(f"{where}: field '{key}' must be a string")
        extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.messages_key)}
        prompt = str(row[cfg.prompt_key]) if cfg.prompt_key in row else _last_user_turn(messages)
        out.append(PromptRecord(prompt, str(row[cfg.answer_key]), where, messages=messages, extra=extra))
    return out


def _last_user_turn(messages: list[dict[str, Any]] | None) -> str:
    """A chat row's question as plain text (what a reward sees as the prompt)."""
    return next((m["content"] for m in reversed(messages or []) if m["role"] == "user"), "")


def chat_messages(row: dict[str, Any], key: str, where: str) -> list[dict[str, Any]] | None:
    """The row's chat turns under ``key`` (None if it has none), checked for role/content."""
    msgs = row.get(key)
    if msgs is None:
        return None
    if not isinstance(msgs, list) or not msgs:
        raise RolloutError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RolloutError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content', got {m!r}")
    return [dict(m) for m in msgs]


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
