"""The pre-registered study of #45: ``time_to_target.py --study [--pilot-only] [--power] [--quick]``.

Reads ``benchmarks/ttt/registration.toml`` (``registration.py``) and runs, through the result
cache (an interrupted study resumes):

1. **pilot, LR pick** — the 3-point LR sweep at the start (128 responses) on the pilot seeds; the
   start's LR multiplier m* is the one with the fewest samples to the last target (geometric
   mean over pilot seeds; runs that missed it rank last): a clock-free choice;
2. **pilot, rest** — the rest of the batch × LR grid (V5) and the coordinator at both starts
   (LR reference lr_ref · m*) under every registered clock, on the pilot seeds;
3. **judged** — only with the registration committed (git) and the base pinned: the fixed
   batches on the √ line through m* and both coordinator starts under every clock, on the
   fresh judged seeds. Fixed runs are re-costed per clock; coordinators are rerun per clock.

Prints one table of figures (V1, V2, V3, V5 per clock: ``verdict.py``) with PASS/FAIL, and one
JSON line; writes ``OUT/study.json`` (and ``OUT/power.json`` with ``--power``). ``--quick``
runs the same path with the quick mode's budgets, two batches and one pilot seed, judged on that
pilot seed (no bounds, no verdict that counts): the machinery, end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import table
from benchmarks.ttt import registration, runs, stats, verdict
from benchmarks.ttt.analysis import HALF
from benchmarks.ttt.clocked import clock_view, load_clocks
from benchmarks.ttt.harness import MODES, Mode, common_sets, executor, make_base, run_plan

COLUMNS = ["figure", "clock", "n", "gm", "lower", "rule", "verdict", "statistical", "systems", "cpu_gm", "censored", "C"]  # fmt: skip


def quick(reg: registration.Registration) -> registration.Registration:
    """The registration shrunk to the quick mode: its budgets, batches 128 and 512, one seed."""
    q = MODES["quick"]
    return dataclasses.replace(
        reg, line_prompts=[reg.start_prompts, 32], coord_starts=[reg.start_prompts, 32], coord_range=(4, 64),
        max_samples=q.max_samples, eval_samples=q.eval_samples, gains=q.gains,
        warm_start_steps=q.warm_start_steps, pilot=reg.pilot[:1], judged=[],
    )  # fmt: skip


def study_mode(reg: registration.Registration, base: Mode) -> Mode:
    """The harness mode the registration describes (budgets, base, targets)."""
    return dataclasses.replace(
        base, prompts=reg.line_prompts, mults=reg.lr_mults, seeds=len(reg.judged), max_samples=reg.max_samples,
        eval_samples=reg.eval_samples, coord_range=reg.coord_range, gains=reg.gains,
        warm_start_steps=reg.warm_start_steps, lr_ref=reg.lr_ref, p_ref=reg.p_ref, val_metric=reg.val_metric,
    )  # fmt: skip


def arms(reg: registration.Registration, m: float | None) -> dict[str, Any]:
    """The study's variants: the LR sweep at the start, the grid, and (given m*) the line and
    the coordinators under each clock."""
    out: dict[str, Any] = {
        "lr_sweep": runs.sweep([reg.start_prompts], reg.lr_mults, reg.lr_ref, reg.p_ref),
        "grid": runs.sweep(reg.line_prompts, reg.lr_mults, reg.lr_ref, reg.p_ref),
    }
    if m is not None:
        out["line"] = runs.sweep(reg.line_prompts, [m], reg.lr_ref, reg.p_ref)
        lo, hi = reg.coord_range
        small, large = reg.coord_starts
        out["coords"] = [
            runs.coordinator(name, start, lo, hi, reg.lr_ref * m, reg.p_ref, [], c)
            for c in reg.clocks
            for name, start in (("coord_small", small), ("coord_large", large))
        ]
    return out


def rotated(group: list[runs.Variant], seeds: list[int]) -> list[tuple[runs.Variant, int]]:
    """Every variant on every seed; each seed's round starts at another variant."""
    order = []
    for seed in seeds:
        k = seed % len(group)
        order += [(v, seed) for v in group[k:] + group[:k]]
    return order


def pick_mult(results: list[dict[str, Any]], sweep: list[runs.Variant], seeds: list[int]) -> float:
    """m* of the LR sweep at the start (see the module docstring)."""

    def rank(v: runs.Variant) -> tuple[int, float]:
        rs = [r for r in results if r["variant"] == v.name and r["seed"] in seeds]
        return sum(not r["reached"][-1] for r in rs), stats.geomean([max(r["samples"][-1], 1.0) for r in rs])

    best = min(sweep, key=rank)
    return float(best.name.rsplit("_m", 1)[1])


def base_sha256(hf: Path) -> str:
    """Of the base's files (names and bytes, sorted by name)."""
    h = hashlib.sha256()
    for f in sorted(p for p in hf.rglob("*") if p.is_file()):
        h.update(f.relative_to(hf).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main(args: argparse.Namespace, mode: Mode, out: Path) -> int:
    reg = registration.load(Path(args.registration) if args.registration else registration.DEFAULT)
    if args.quick:
        reg = quick(reg)
    judged = [] if args.pilot_only or args.quick else reg.judged
    mode = study_mode(reg, mode)
    clocks = load_clocks(reg.clocks, reg.clocks_file)
    if args.dry_run:
        for v, seed in rotated(arms(reg, None)["lr_sweep"], reg.pilot):
            print(f"pilot seed {seed}  {v.name:22s} {' '.join(v.overrides())}")
        print("then: the rest of the grid and the coordinators on the pilot seeds; the line and the "
              f"coordinators on judged seeds {judged} (m* from the pilot)")  # fmt: skip
        return 0
    commit = registration.require_committed(reg) if judged else registration.git_state(reg.path)[1]
    t0 = time.time()
    base = make_base(out, mode)
    sha = base_sha256(out / "base/hf_final")
    if reg.base_sha256 and reg.base_sha256 != sha:
        raise registration.RegistrationError(
            f"{reg.path}: base.sha256 = {reg.base_sha256[:12]}… but {out}/base is {sha[:12]}…"
        )
    if judged and not reg.base_sha256:
        raise registration.RegistrationError(f'{reg.path}: pin the base before judged runs: base.sha256 = "{sha}"')
    targets = [round(base["val"] + g, 4) for g in mode.gains]
    print(json.dumps({"base": base, "base_sha256": sha, "targets": targets}), flush=True)
    common, execute = common_sets(out, mode, targets) + reg.common_sets, executor(out, mode, targets)
    first = arms(reg, None)
    results = run_plan(out, common, rotated(first["lr_sweep"], reg.pilot), execute)
    m = pick_mult(results, first["lr_sweep"], reg.pilot)
    a = arms(reg, m)
    rest = [v for v in a["grid"] if v.name not in {x.name for x in first["lr_sweep"]}] + a["coords"]
    results += run_plan(out, common, rotated(rest, reg.pilot), execute)
    if judged:
        results += run_plan(out, common, rotated(a["line"] + a["coords"], judged), execute)
    names = {"start": a["line"][0].name, "line": [v.name for v in a["line"]], "grid": [v.name for v in a["grid"]],
             "small": "coord_small", "large": "coord_large"}  # fmt: skip
    rows, pilot_rows = [], []
    for name, clock in clocks.items():
        view = clock_view(results, name, clock, targets, HALF)
        rows += verdict.verdicts(view, name, names, judged or reg.pilot, reg.pilot, reg.bars)
        pilot_rows += verdict.verdicts(view, name, names, reg.pilot, reg.pilot, reg.bars)
    seeds_label = "judged" if judged else "pilot (no verdict counts)"
    print(f"\nstudy figures on the {seeds_label} seeds {judged or reg.pilot}; start LR multiplier m* = {m:g}")
    print(table(rows, COLUMNS))
    meta = {"benchmark": "time_to_target", "mode": "study" + ("_quick" if args.quick else ""), "seeds": seeds_label,
            "clocks_sha256": reg.clocks_sha256, "registration_commit": commit, "base_sha256": sha,
            "targets": targets, "start_lr_mult": m, "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    line = meta | {"figures": rows}
    print(json.dumps(line))
    (out / "study.json").write_text(json.dumps(line, indent=1))
    if args.power:
        need = verdict.power(pilot_rows, reg.bars, args.sigma, reg.bars.get("level", 0.9))
        print(table(need, ["figure", "clock", "effect_gm", "sigma_log", "bar_lower", "seeds_needed", "pilot_seeds"]))
        (out / "power.json").write_text(json.dumps(meta | {"power": need}, indent=1))
        print(json.dumps({"benchmark": "time_to_target", "mode": "power"} | meta | {"power": need}))
    return 0
