"""The benchmark's shared machinery: its modes, the shared base, the settings every run shares,
and running a plan through the result cache (``benchmarks/time_to_target.py`` drives it).

A run under a virtual clock (a coordinator variant with ``clock`` other than ``cpu``) gets
``MEGARL_VIRTUAL_CLOCK=clocks.toml#CLOCK`` in its environment, and its cached result is keyed on
the clock and the clocks file's sha256 (``Variant.cache_tags``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, run_train
from benchmarks.ttt import runs
from benchmarks.ttt.analysis import HALF, run_result
from benchmarks.ttt.clocked import CLOCKS_FILE
from benchmarks.ttt.tasks import write_task_file

CONFIG = str(ROOT / "benchmarks/ttt/config.yaml")
Execute = Callable[[runs.Variant, int, list[str]], dict[str, Any]]


@dataclass(frozen=True)
class Mode:
    prompts: list[int]
    """Sweep grid of prompts per step (× 16 responses)."""
    mults: list[float]
    """LR multipliers on the √ rule."""
    seeds: int
    max_samples: int
    """Responses trained per run at most (a budget in samples, not steps: a step cap let
    small-batch runs train for less time than large-batch ones before they were censored)."""
    eval_samples: int
    """Validation every this many responses (evenly spaced in samples whatever the batch)."""
    coord_range: tuple[int, int]
    """(min_prompts, max_prompts) the coordinator may choose from."""
    gains: list[float]
    """Targets = base validation reward + each gain."""
    warm_start_steps: int = 800
    """Supervised steps of the shared base. Measured on the held-out mix (lr 1e-3, batch 64,
    each stage continuing the last): 800 → validation 0.28, 1600 → 0.37, 3200 → 0.77."""
    num_val: int = 600
    lr_ref: float = 1.0e-4
    """LR validated at p_ref prompts × 16 (the demo's setting)."""
    p_ref: int = 32
    timeout_s: int = 1800
    max_steps: int = 5000
    """A backstop only: ``max_samples`` ends the runs."""
    val_metric: str = "reward"
    """``train.val_metric`` of the base and every run (``answer_prob``: the exact teacher-forced
    probability of the answers; targets and ``--gains`` are then in its units)."""


MODES = {
    # gains: the quick mode's best fixed run (8 × 16) gained 0.06 in 17 steps and 0.10 in ~24;
    # +0.20 is meant to take it ~40-80 steps (an extrapolation: check the full run's steps).
    "full": Mode([8, 16, 32, 64], [0.5, 1.0, 2.0], 3, 400 * 512, 5 * 512, (4, 128), [0.10, 0.20]),
    "quick": Mode([8, 32], [1.0], 1, 20 * 512, 2 * 512, (4, 64), [0.03, 0.06], timeout_s=600),
}


def run_plan(
    out: Path,
    common: list[str],
    order: list[tuple[runs.Variant, int]],
    execute: Execute,
    older: runs.Older | None = None,
) -> list[dict[str, Any]]:
    """Each planned run's result, from the cache or ``execute``d and cached. ``older`` =
    (common settings of an earlier stop rule, which of their results still hold)."""
    results = []
    for v, seed in order:
        key, own = runs.run_key(v, seed), v.overrides() + [f"train.seed={seed}"]
        settings, tags = common + own, v.cache_tags()  # tags: what the cache keys on beyond --set
        res = runs.cache_load(out, key, settings + tags, (older[0] + own + tags, older[1]) if older else None)
        if res is None:
            runs.cache_store(out, key, settings + tags, execute(v, seed, settings))
            res = runs.cache_load(out, key, settings + tags)  # as a resumed run will see it
            assert res is not None
        results.append(res)
    return results


def make_base(out: Path, mode: Mode) -> dict[str, Any]:
    """Task file + warm-started actor, once (cached like a run)."""
    settings = [f"warm_start.steps={mode.warm_start_steps}", f"num_val={mode.num_val}", "num_train=20000"]
    settings += [] if mode.val_metric == "reward" else [f"val_metric={mode.val_metric}"]
    cached = runs.cache_load(out, "base", settings)
    if cached is not None:
        return cached
    counts = write_task_file(out / "tasks.jsonl", num_train=20000, num_val=mode.num_val)
    t0 = time.time()
    s = run_train(
        CONFIG,
        [
            *data_sets(out, mode),
            "train.steps=0",
            f"warm_start.steps={mode.warm_start_steps}",
            f"train.run_dir={out / 'base'}",
        ],
        out / "logs/base.log",
        timeout=mode.timeout_s,
    )
    base = {
        "val": s["val/reward_start"],
        "warm_start_nll": s.get("warm_start/final_nll"),
        "wall_s": time.time() - t0,
        "train_rows": counts["train"],
        "val_rows": counts["val"],
    }
    runs.cache_store(out, "base", settings, base)
    return base


def data_sets(out: Path, mode: Mode) -> list[str]:
    """The data and the validation metric: the base's validation sets the targets, so both share them."""
    metric = [] if mode.val_metric == "reward" else [f"train.val_metric={mode.val_metric}"]
    return [f"data.source={out / 'tasks.jsonl'}", f"data.num_val={mode.num_val}", *metric]


def common_sets(out: Path, mode: Mode, targets: list[float]) -> list[str]:
    """The overrides every RL run shares (part of each cached result's settings)."""
    # stop once the smoothed curve has crossed the last target with its window complete (the
    # window's mean is the running-line smoother at its centre): one lucky validation does not
    # end a run before its crossing, and no run trains past it
    return _run_sets(out, mode) + [f"train.target_val_reward={targets[-1]:.4f}", f"train.target_window={2 * HALF + 1}"]


def older_sets(out: Path, mode: Mode, targets: list[float]) -> runs.Older:
    """The stop rule before ``train.target_window`` (a raw validation 0.04 past the last target,
    then 2·HALF more) and which of its results still hold: a run that reached the last target
    (its curve up to the crossing is the same run) or trained its whole budget. A run that one
    high validation stopped before its smoothed curve crossed is run again."""
    rule = [f"train.target_val_reward={targets[-1] + 0.04:.4f}", f"train.evals_past_target={2 * HALF}"]
    return _run_sets(out, mode) + rule, lambda res: bool(res["reached"][-1]) or res["samples"][-1] >= mode.max_samples


def _run_sets(out: Path, mode: Mode) -> list[str]:
    """The shared overrides other than the stop rule."""
    return [
        *data_sets(out, mode),
        f"model.init_from={out / 'base/hf_final'}",
        "model.tokenizer=builtin",  # the base's own SentencePiece model, copied in by execute()
        "warm_start.steps=0",
        f"train.steps={mode.max_steps}",
        f"train.max_samples={mode.max_samples}",
        "train.eval_every=0",
        f"train.eval_every_samples={mode.eval_samples}",
    ]


def executor(out: Path, mode: Mode, targets: list[float]) -> Execute:
    """Runs one (variant, seed) with ``settings`` in ``OUT/runs/KEY`` and returns its result."""

    def execute(v: runs.Variant, seed: int, settings: list[str]) -> dict[str, Any]:
        key = runs.run_key(v, seed)
        run_dir = out / "runs" / key
        runs.clean_run_dir(run_dir)
        runs.copy_tokenizer(out / "base/hf_final", run_dir)
        env = {} if v.clock == "cpu" else {"MEGARL_VIRTUAL_CLOCK": f"{CLOCKS_FILE}#{v.clock}"}
        t1 = time.time()
        summary = run_train(
            CONFIG, settings + [f"train.run_dir={run_dir}"], out / f"logs/{key}.log", timeout=mode.timeout_s, env=env
        )
        res = run_result(v, seed, run_dir, summary, targets, time.time() - t1)
        print(json.dumps({k: res[k] for k in ("key", "time_s", "steps", "samples", "reached")}), flush=True)
        return res

    return execute
