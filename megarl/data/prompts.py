"""Prompt data: the built-in arithmetic task, JSONL / Parquet files / HF ``save_to_disk``
folders, and a resumable sampler.

Every row becomes a :class:`PromptRecord` (prompt text or chat ``messages``, reference answer,
the row's other fields, source location); the tokenizer turns it into prompt ids. A
malformed row raises :class:`~megarl.errors.DataError` naming the file and line (the launcher
reads every row before any process starts: :func:`megarl.prelaunch.check_data`); a prompt longer than
``rollout.max_prompt_len`` tokens is skipped or truncated by config and always counted.

A null field is an absent field, at every level of a row's objects (:func:`without_nulls`):
Parquet files and ``datasets`` folders hold one schema for all their rows, so a chat row there
has ``prompt: null`` and a plain row ``messages: null`` where a JSONL row has no such key. Every
reader's rows pass through it first, so a reward gets the same record from each format.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.config import DataConfig
from megarl.errors import DataError, RolloutError

__all__ = ["DataError", "PromptRecord", "PromptSampler", "RolloutError", "load_prompts"]

TOKENIZER_CORPUS_ROWS = 5000
"""The tokenizer is trained on prompt + answer of the first this-many training rows."""


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


def multiplication_rows(n: int, max_operand: int, seed: int) -> list[PromptRecord]:
    """Products of two operands drawn from [max_operand // 10, max_operand) (three-digit numbers
    at max_operand=1000): prompt 'a*b=' with answer str(a*b). The agents example: a task a tiny
    model cannot do unaided, and does with the calculator tool."""
    rng = random.Random(seed)
    low = max(max_operand // 10, 1)
    rows = []
    for i in range(n):
        a, b = rng.randrange(low, max_operand), rng.randrange(low, max_operand)
        rows.append(PromptRecord(f"{a}*{b}=", str(a * b), f"builtin:{i}"))
    return rows


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    raw: list[tuple[str, Any]] = []
    with path.open("rb") as fh:  # bytes: a bad encoding is reported with its line
        for lineno, data in enumerate(fh, 1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                raw.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    return raw


def _rows_from_file(path: Path, cfg: DataConfig) -> list[PromptRecord]:
    if path.is_dir():  # a folder written by HF datasets' save_to_disk
        from megarl.data.saved_dataset import read_saved_dataset

        raw = read_saved_dataset(path)
    elif not path.is_file():
        raise DataError(f"data.source: prompt file {path} does not exist")
    elif path.suffix == ".jsonl":
        raw = _read_jsonl(path)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        raw = [(f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist())]
    else:
        raise DataError(
            f"data.source: {path}: unsupported prompt file type '{path.suffix}' (use .jsonl, .parquet or a datasets save_to_disk folder)"
        )
    out: list[PromptRecord] = []
    for where, row in raw:
        if not isinstance(row, dict):
            raise DataError(f"{where}: row must be an object, got {type(row).__name__}")
        row = without_nulls(row)
        messages = chat_messages(row, cfg.messages_key, where)
        keys = (
            ((cfg.answer_key, "data.answer_key"),)
            if messages is not None
            else ((cfg.prompt_key, "data.prompt_key"), (cfg.answer_key, "data.answer_key"))
        )
        for key, setting in keys:
            if key not in row:
                raise DataError(f"{where}: missing field '{key}' ({setting}; the row has {sorted(row)})")
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise DataError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
        if messages is None and not str(row[cfg.prompt_key]).strip():
            raise DataError(f"{where}: field '{cfg.prompt_key}' is empty")
        extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.messages_key)}
        prompt = str(row[cfg.prompt_key]) if cfg.prompt_key in row else _last_user_turn(messages)
        out.append(PromptRecord(prompt, str(row[cfg.answer_key]), where, messages=messages, extra=extra))
    return out


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of its objects dropped, at any depth (list items
    are kept: ``[1, null]`` is data). A mixed-schema Parquet / ``datasets`` row then reads as
    the same row in JSONL: a chat row's ``prompt``, a turn's ``name``, a metadata field
    another row has, all absent rather than ``None``."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def _last_user_turn(messages: list[dict[str, Any]] | None) -> str:
    """A chat row's question as plain text (what a reward sees as the prompt)."""
    return next((m["content"] for m in reversed(messages or []) if m["role"] == "user"), "")


def chat_messages(row: dict[str, Any], key: str, where: str) -> list[dict[str, Any]] | None:
    """The row's chat turns under ``key`` (None if it has none), checked for role/content."""
    msgs = row.get(key)
    if msgs is None:
        return None
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content', got {m!r}")
    return [dict(m) for m in msgs]


BUILTIN_TASKS = {"arithmetic": arithmetic_rows, "multiply": multiplication_rows}
"""Built-in prompt sources by the name after ``builtin:``: (n, max_operand, seed) → rows."""


def load_prompts(cfg: DataConfig, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, validation) prompt records; :class:`DataError` names the file and line."""
    if cfg.source.startswith("builtin:"):
        name = cfg.source.split(":", 1)[1]
        if name not in BUILTIN_TASKS:
            raise DataError(
                f"data.source='{cfg.source}': unknown built-in task '{name}' (known: {list(BUILTIN_TASKS)})"
            )
        rows_of = BUILTIN_TASKS[name]
        train = rows_of(cfg.num_train, cfg.max_operand, seed)
        val = rows_of(cfg.num_val, cfg.max_operand, seed + 7919)
        return train, val
    rows: list[PromptRecord] = []
    for part in cfg.source.split(","):
        rows.extend(_rows_from_file(Path(part.strip()), cfg))
    if len(rows) <= cfg.num_val:
        raise DataError(
            f"data.source={cfg.source} has {len(rows)} rows, need more than data.num_val={cfg.num_val} "
            "(the last num_val rows are the validation set)"
        )
    return rows[: -cfg.num_val] if cfg.num_val else rows, rows[-cfg.num_val :] if cfg.num_val else []


def tokenizer_corpus(train: list[PromptRecord]) -> list[str]:
    return [r.prompt + r.answer for r in train[:TOKENIZER_CORPUS_ROWS]]


def fit_prompt(ids: list[int], limit: int, mode: str) -> list[int] | None:
    """``data.overlong_prompt`` on one encoded prompt: the ids to use, or None (skipped).

    Truncation keeps the first token (BOS) and the last ``limit - 1`` tokens, where the
    question usually ends."""
    if len(ids) <= limit:
        return ids
    if mode == "skip":
        return None
    return [ids[0], *ids[len(ids) - limit + 1 :]]


class PromptSampler:
    """Epoch-wise seeded shuffle; ``state_dict`` = (epoch, position) so a resume replays nothing."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise DataError("no prompts to sample from")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    @property
    def drawn(self) -> int:
        """Prompts drawn so far over all epochs: the stream position of the next draw."""
        return self.epoch * self.n + self.pos

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
            raise DataError(
                f"the checkpoint's prompt sampler is for {state['n']} training prompts, the data has {self.n}: "
                "resume with the data it was trained on, or start afresh (train.resume=never, or a new train.run_dir)"
            )
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._perm()
