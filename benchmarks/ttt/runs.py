"""The benchmark's variants, their order, and the result cache that makes it resumable.

Every run starts from the same warm-started actor and differs only in batch (prompts ×
samples), LR, seed and whether the coordinator plans. The sweep holds LR = lr_ref ·
√(P/P_ref) · m (Malladi et al. 2022's square-root rule for Adam, times a multiplier m) on a
grid of prompt counts P; the coordinator starts at the smallest and at the largest P with its
√-rule LR (so its LR reference is right for its own start whatever its ``b_ref`` rule is).

A finished run leaves ``results/<name>.json`` (its curve, summary and settings); a rerun of the
benchmark with the same settings skips it, so an interrupted benchmark resumes where it
stopped. A result written with other settings is stale and is run again.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAMPLES = 16
"""Responses per prompt in the sweep and the coordinator runs (the GRPO group size)."""


@dataclass(frozen=True)
class Variant:
    name: str
    """'sweep_p16_m1', 'default', 'coord_small', 'coord_large'."""
    kind: str
    """'sweep' | 'default' | 'coord'."""
    prompts: int
    samples: int
    lr: float
    sets: tuple[str, ...] = field(default=())
    """`--set` overrides beyond batch and LR (coordinator settings)."""
    clock: str = "cpu"
    """The clock the run is shown (``MEGARL_VIRTUAL_CLOCK``): a ``[clock.NAME]`` of
    ``clocks.toml``, or ``cpu`` for this machine's own. Only coordinator runs take one (a fixed
    setting learns the same on every clock and is re-costed: ``benchmarks/ttt/clocked.py``)."""

    @property
    def batch(self) -> int:
        return self.prompts * self.samples

    def overrides(self) -> list[str]:
        return [
            f"rollout.num_prompts={self.prompts}",
            f"rollout.samples_per_prompt={self.samples}",
            f"optim.lr={self.lr:.4g}",
            *(self.sets or ("coordinator.enabled=false",)),
        ]

    def cache_tags(self) -> list[str]:
        """What the result cache keys on beyond the ``--set`` overrides: the clock and the sha256
        of the clocks file (a changed cost model is a new clock, so its results are rerun)."""
        if self.clock == "cpu":
            return []
        from benchmarks.ttt.clocked import clocks_sha256

        return [f"#vclock={self.clock}:{clocks_sha256()}"]


def sqrt_lr(lr_ref: float, p_ref: int, prompts: int) -> float:
    return lr_ref * math.sqrt(prompts / p_ref)


def sweep(prompts: list[int], mults: list[float], lr_ref: float, p_ref: int) -> list[Variant]:
    return [
        Variant(f"sweep_p{p}_m{m:g}", "sweep", p, SAMPLES, sqrt_lr(lr_ref, p_ref, p) * m)
        for p in prompts
        for m in mults
    ]


def coordinator(
    name: str, start: int, lo: int, hi: int, lr_ref: float, p_ref: int, extra: list[str], clock: str = "cpu"
) -> Variant:
    """The coordinator started at ``start`` prompts; under a virtual clock it is named ``NAME@CLOCK``."""
    sets = (
        "coordinator.enabled=true",
        f"coordinator.min_prompts={lo}",
        f"coordinator.max_prompts={hi}",
        "coordinator.lr_rule=sqrt",
        f"coordinator.lr_max={sqrt_lr(lr_ref, p_ref, hi) * 4:.4g}",
        *extra,
    )
    name = name if clock == "cpu" else f"{name}@{clock}"
    return Variant(name, "coord", start, SAMPLES, sqrt_lr(lr_ref, p_ref, start), sets, clock)


def library_default() -> Variant:
    """What a user gets without choosing batch or LR: RolloutConfig / OptimConfig defaults."""
    from megarl.config import OptimConfig, RolloutConfig

    r, o = RolloutConfig(), OptimConfig()
    return Variant("default", "default", r.num_prompts, r.samples_per_prompt, o.lr)


def interleave(first: list[Variant], others: list[Variant]) -> list[Variant]:
    """``others`` spread evenly through ``first`` (so slow drift of the machine's load
    falls on every variant, not on whichever ran last)."""
    out = list(first)
    for k, v in enumerate(others):
        out.insert(round((k + 1) * len(out) / (len(others) + 1)), v)
    return out


def run_key(v: Variant, seed: int) -> str:
    return f"{v.name}_s{seed}"


Older = tuple[list[str], Callable[[dict[str, Any]], bool]]
"""(settings of an earlier rule, accept): which results made with them still hold."""


OUT = "{out}"
"""How a result's settings name the benchmark folder itself (its task file, its base model)."""


def portable(out: Path, settings: list[str]) -> list[str]:
    """``settings`` with the folder ``out`` written as :data:`OUT`. A cache copied or moved to
    another ``--out`` then still matches: with absolute paths every result missed and every
    run was done again, silently (session 23's copy of session 22's runs, docs/LOG.md session 24)."""
    root = str(out)
    return [x.replace(root, OUT) for x in settings]


def cache_load(out: Path, key: str, settings: list[str], older: Older | None = None) -> dict[str, Any] | None:
    """The cached result of run ``key`` if it was made with exactly ``settings`` (the folder's
    own paths aside: :func:`portable`), else None.

    ``older`` = (settings, accept): a result made with those earlier settings is also taken
    when ``accept(result)`` says the difference cannot have changed it (the benchmark's stop
    rule before ``train.target_window``: a run that reached its last target, or trained its
    whole budget, measured the same crossings)."""
    path = out / "results" / f"{key}.json"
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    stored = portable(out, res.get("settings") or [])
    if stored == portable(out, settings):
        return dict(res)
    if older is not None and stored == portable(out, older[0]) and older[1](res):
        return dict(res)
    return None


def cache_store(out: Path, key: str, settings: list[str], result: dict[str, Any]) -> None:
    """Write atomically (a kill mid-write leaves no half result that a rerun would trust)."""
    path = out / "results" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**result, "settings": portable(out, settings)}))
    tmp.replace(path)


def clean_run_dir(run_dir: Path) -> None:
    """A run dir left by an interrupted benchmark is started over (train.resume=never)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)


def copy_tokenizer(base: Path, run_dir: Path) -> None:
    """The base's built-in tokenizer into a run (``model.tokenizer=builtin`` then opens it).

    Why not ``model.tokenizer=auto``: it opens an ``init_from`` folder holding a
    ``tokenizer.model`` through transformers, which encodes prompts without the BOS id the
    built-in tokenizer puts first — the warm-started actor then scores 0.008 instead of 0.28."""
    (run_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
    shutil.copy2(base / "tokenizer.model", run_dir / "tokenizer" / "tokenizer.model")
