"""The benchmark's task mix: three arithmetic strata written to one JSONL file.

    addsub20   a+b or a-b (a >= b), a, b < 20      -- the demo task: mostly learned by the warm start
    add100     a+b, a, b < 100                      -- two-digit carries: the long horizon
    add3_20    a+b+c, a, b, c < 20                  -- three operands, longer prompts

Validation is held out **by problem**: every distinct prompt of a stratum is ranked by the
SHA-256 of its text and the lowest-ranked ones are validation problems, the rest training
problems, so no validation prompt is ever a training prompt (not even in the warm start).
The file holds the training rows first and the validation rows last, as ``data.source`` with
``data.num_val = len(validation)`` expects (``megarl.data.prompts.load_prompts``).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

STRATA: dict[str, float] = {"addsub20": 0.3, "add100": 0.4, "add3_20": 0.3}
"""Share of each stratum in the training rows and in the validation set."""


def problems(stratum: str) -> list[tuple[str, str]]:
    """Every distinct (prompt, answer) of a stratum, in a fixed order."""
    if stratum == "addsub20":
        add = [(f"{a}+{b}=", str(a + b)) for a in range(20) for b in range(20)]
        return add + [(f"{a}-{b}=", str(a - b)) for a in range(20) for b in range(a + 1)]
    if stratum == "add100":
        return [(f"{a}+{b}=", str(a + b)) for a in range(100) for b in range(100)]
    if stratum == "add3_20":
        return [(f"{a}+{b}+{c}=", str(a + b + c)) for a in range(20) for b in range(20) for c in range(20)]
    raise ValueError(f"unknown stratum {stratum!r} (known: {sorted(STRATA)})")


def problem_hash(prompt: str) -> int:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")


def split(num_val: int) -> tuple[dict[str, list[tuple[str, str]]], dict[str, list[tuple[str, str]]]]:
    """(train, validation) problems per stratum; validation = the lowest hashes of each stratum.

    addsub20 appears in both prompt forms 'a+b=' of add100 (a, b < 20): those prompts are
    shared problems, so a prompt held out in one stratum is dropped from the other's training set."""
    train: dict[str, list[tuple[str, str]]] = {}
    val: dict[str, list[tuple[str, str]]] = {}
    for name, share in STRATA.items():
        ranked = sorted(problems(name), key=lambda p: problem_hash(p[0]))
        k = round(num_val * share)
        val[name], train[name] = ranked[:k], ranked[k:]
    held_out = {p for rows in val.values() for p, _ in rows}
    for name in train:
        train[name] = [(p, a) for p, a in train[name] if p not in held_out]
    return train, val


def write_task_file(path: Path, num_train: int, num_val: int, seed: int = 0) -> dict[str, int]:
    """Write the mix (``num_train`` training rows drawn by stratum share, then the validation
    problems) to ``path``; returns row counts. Same arguments → the same bytes."""
    train, val = split(num_val)
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for name, share in STRATA.items():
        pool = train[name]
        take = round(num_train * share)
        picks = rng.sample(pool, take) if take <= len(pool) else [rng.choice(pool) for _ in range(take)]
        rows += [{"prompt": p, "answer": a, "stratum": name} for p, a in picks]
    rng.shuffle(rows)
    val_rows = [{"prompt": p, "answer": a, "stratum": name} for name in STRATA for p, a in val[name]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + val_rows))
    return {"train": len(rows), "val": len(val_rows)}
