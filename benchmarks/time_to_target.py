"""Time to a validation target: can the coordinator match the best fixed (batch, LR) a sweep
finds, from one run, whatever its start? (issue #13)

Task: the arithmetic mix of ``benchmarks/ttt/tasks.py`` (a±b, a,b < 20; a+b, a,b < 100;
a+b+c, a,b,c < 20), validation on 600 problems held out by hash. All runs start from one
warm-started actor (made once: ``warm_start.steps`` supervised steps, exported to HF,
``model.init_from``); TP=2 + one vLLM engine (``benchmarks/ttt/config.yaml``).

Variants (``benchmarks/ttt/runs.py``):
  sweep_pP_mM   fixed P prompts × 16, LR = lr_ref·√(P/P_ref)·M, seed 1 (the best: every seed)
  default       the library's defaults (RolloutConfig / OptimConfig), every seed
  coord_small   coordinator started at the smallest P with its √-rule LR, every seed
  coord_large   coordinator started at the largest P, every seed

Targets are the base's validation reward plus fixed gains (``--gains``), known before any
variant runs. Metric: training time to each target (validation excluded; crossing
interpolated on a smoothed curve where its window is complete, ``benchmarks/ttt/curves.py``),
and steps and samples. Every run validates every ``eval_samples`` responses, trains at most
``max_samples`` (a budget in samples, so a small batch is not censored sooner than a large
one), and stops once the mean of its last ``2·HALF + 1`` validations reaches the last target
(``train.target_window``: the smoothed curve has crossed it with its window complete).
Runs go one at a time, seeds and variants interleaved; each finished run is cached in
``OUT/results`` so a rerun resumes. Prints a table, the critical batch fitted from the
sweep vs the coordinators' online B_noise, and one JSON line of ratios; writes
``OUT/sweep.json`` for ``megarl report RUN --sweep OUT``.

    python benchmarks/time_to_target.py --quick           # the machinery end to end (2.5 min, session 22)
    python benchmarks/time_to_target.py [--out DIR]       # full: 23 runs, ~0.5-0.8 h on 2 idle cores (estimated)
    python benchmarks/time_to_target.py --best sweep_p32_m1 --seeds 6 [--max-samples N] [--out DIR]
        # no sweep: that setting and the coordinator (both starts) on seeds 1..6, paired
        # ratios per seed (runs named as in the full mode: the two share a result cache)
    python benchmarks/time_to_target.py --best sweep_p32_m1 --seeds 3 --arm inf:coordinator.unresolved_as_infinite=true
        # an A/B of a coordinator option: both starts with and without it, interleaved per seed
        # (coord_small_inf, ...); the JSON line adds control/arm time ratios per start
    python benchmarks/time_to_target.py --quick --clock cpu,gpu-mid,gpu-high
        # each mode under virtual clocks (#45, benchmarks/ttt/clocks.toml): a fixed setting's run is
        # re-costed from its recorded per-step batches under every clock, the coordinator is rerun
        # under each (MEGARL_VIRTUAL_CLOCK: its choices depend on it); one report per clock, every
        # JSON line with the clocks file's sha256, time = samples to target × cost per sample and
        # each ratio's statistical × systems factors, CPU train time beside the clock's
    python benchmarks/time_to_target.py --study [--pilot-only] [--power [--sigma S]] [--quick]
        # the pre-registered study (benchmarks/ttt/registration.toml, benchmarks/ttt/study.py):
        # V1/V2/V3/V5 per clock with one-sided 90 % lower bounds and PASS/FAIL; judged seeds run
        # only with the registration committed and the base pinned (docs/COORDINATOR.md §6)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT  # noqa: E402
from benchmarks.ttt import runs  # noqa: E402
from benchmarks.ttt.analysis import estimate_wall_s  # noqa: E402
from benchmarks.ttt.clocked import CPU, load_clocks  # noqa: E402
from benchmarks.ttt.harness import (  # noqa: E402, F401 (tests reach the harness through this module)
    MODES,
    Execute,
    Mode,
    common_sets,
    data_sets,
    executor,
    make_base,
    older_sets,
    run_plan,
)
from benchmarks.ttt.report import report_clocks  # noqa: E402


def plan(
    mode: Mode, best: runs.Variant | None, extra: list[str], clocks: tuple[str, ...] | list[str] = (CPU,)
) -> list[tuple[runs.Variant, int]]:
    """(variant, seed) in run order; the seeds after the first need the sweep's best setting.
    The coordinator runs once per clock (both starts); fixed settings once (re-costed)."""
    coords = coordinators(mode, extra, clocks=clocks)
    smalls, larges = coords[0::2], coords[1::2]
    first = runs.interleave(
        runs.sweep(mode.prompts, mode.mults, mode.lr_ref, mode.p_ref), [*smalls, runs.library_default(), *larges]
    )
    order = [(v, 1) for v in first]
    if best is not None:
        for seed in range(2, mode.seeds + 1):
            group = [best, *smalls, runs.library_default(), *larges]
            k = seed % len(group)  # rotate, so no variant always runs first in its round
            order += [(v, seed) for v in group[k:] + group[:k]]
    return order


def coordinators(
    mode: Mode, extra: list[str], suffix: str = "", clocks: tuple[str, ...] | list[str] = (CPU,)
) -> list[runs.Variant]:
    """The coordinator started at the sweep's smallest and at its largest prompt count, under
    each clock: [small@c1, large@c1, small@c2, ...] (no suffix on ``cpu``)."""
    lo, hi = mode.coord_range
    return [
        runs.coordinator(name + suffix, start, lo, hi, mode.lr_ref, mode.p_ref, extra, c)
        for c in clocks
        for name, start in (("coord_small", mode.prompts[0]), ("coord_large", mode.prompts[-1]))
    ]


def parse_arms(specs: list[str]) -> dict[str, list[str]]:
    """``--arm NAME:KEY=VALUE`` (repeatable; one NAME may take several) → {NAME: [KEY=VALUE, ...]}."""
    arms: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, setting = spec.partition(":")
        if not sep or not name.isidentifier() or "=" not in setting:
            raise ValueError(f"--arm {spec!r}: expected NAME:KEY=VALUE (NAME a plain identifier)")
        arms.setdefault(name, []).append(setting)
    return arms


def plan_seeds(
    mode: Mode,
    fixed: runs.Variant,
    extra: list[str],
    arms: dict[str, list[str]] | None = None,
    clocks: tuple[str, ...] | list[str] = (CPU,),
) -> list[tuple[runs.Variant, int]]:
    """``--best`` mode: the fixed setting and both coordinator starts (under each clock) on every
    seed, rotated; each arm adds both starts again with its settings on top
    (``coord_small_NAME``, ...), run interleaved with the others so the comparison sees the same machine."""
    group = [fixed, *coordinators(mode, extra, clocks=clocks)]
    for name, sets in (arms or {}).items():
        group += coordinators(mode, extra + sets, "_" + name, clocks)
    order = []
    for seed in range(1, mode.seeds + 1):
        k = seed % len(group)
        order += [(v, seed) for v in group[k:] + group[:k]]
    return order


def run_all(
    out: Path,
    mode: Mode,
    common: list[str],
    coord_extra: list[str],
    execute: Execute,
    older: runs.Older | None = None,
    clocks: tuple[str, ...] | list[str] = (CPU,),
) -> tuple[list[dict[str, Any]], runs.Variant]:
    """Every planned run's result, in plan order: from the cache, or ``execute``d and cached.

    The plan grows once the sweep's best setting is known (its extra seeds)."""
    results: list[dict[str, Any]] = []
    best: runs.Variant | None = None
    done: set[str] = set()
    while True:
        todo = [(v, s) for v, s in plan(mode, best, coord_extra, clocks) if runs.run_key(v, s) not in done]
        if not todo:
            break
        done.update(runs.run_key(v, s) for v, s in todo)
        results += run_plan(out, common, todo, execute, older)
        if best is None:
            top = min(
                (r for r in results if r["kind"] == "sweep"), key=lambda r: (not r["reached"][-1], r["time_s"][-1])
            )
            best = next(
                v for v in runs.sweep(mode.prompts, mode.mults, mode.lr_ref, mode.p_ref) if v.name == top["variant"]
            )
    assert best is not None
    return results, best


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--quick", action="store_true", help="small mode (a few minutes on 2 idle cores): validates the machinery")
    add("--out", help="output folder (default runs/bench_ttt[_quick]); a rerun resumes it")
    add("--gains", help="comma-separated target gains over the base's validation reward")
    add("--clock", action="append", default=[], metavar="CLOCK",
        help="cpu (this machine, the default) or a [clock.NAME] of benchmarks/ttt/clocks.toml (gpu-mid, "
        "gpu-high); repeat or comma-separate for several: fixed runs are re-costed, coordinators rerun")  # fmt: skip
    add("--coord-set", action="append", default=[], metavar="KEY=VALUE",
        help="extra --set for the coordinator runs (e.g. coordinator.warmup_steps=3)")  # fmt: skip
    add("--arm", action="append", default=[], metavar="NAME:KEY=VALUE",
        help="with --best: also run both coordinator starts with this --set, as coord_small_NAME / "
        "coord_large_NAME, interleaved with the control (repeat to add settings or arms)")  # fmt: skip
    add("--warm-start-steps", type=int, help="supervised steps of the shared base (mode default)")
    add("--max-samples", type=int, help="responses trained per run at most (mode default)")
    add("--seeds", type=int, help="seeds of the best setting and the coordinators (mode default)")
    add("--best", help="no sweep: compare the coordinators with this sweep setting (e.g. sweep_p32_m1)")
    add("--val-metric", choices=["reward", "answer_prob"],
        help="train.val_metric of the base and the runs (default reward; give --gains in its units)")  # fmt: skip
    add("--study", action="store_true", help="the pre-registered study of #45 (benchmarks/ttt/registration.toml)")
    add("--registration", help="with --study: the registration file (default benchmarks/ttt/registration.toml)")
    add("--pilot-only", action="store_true", help="with --study: the pilot seeds only (no judged seeds)")
    add("--power", action="store_true", help="with --study: the seed count each bar needs, from the pilot's spread")
    add("--sigma", type=float, help="with --power: this σ of the log ratios instead of the pilot's")
    add("--dry-run", action="store_true", help="print the run plan and exit")
    args = ap.parse_args(argv)
    args.clock = [c for spec in (args.clock or [CPU]) for c in spec.split(",") if c] or [CPU]
    try:
        args.clocks = load_clocks(args.clock)
        args.arms = parse_arms(args.arm)
    except ValueError as e:
        ap.error(str(e))
    if args.arms and args.best is None:
        ap.error("--arm needs --best (the sweep mode compares one coordinator)")
    if (args.power or args.pilot_only or args.registration) and not args.study:
        ap.error("--power, --pilot-only and --registration need --study")
    return args


def mode_of(args: argparse.Namespace) -> Mode:
    mode = MODES["quick" if args.quick else "full"]
    changes: dict[str, Any] = {}
    if args.gains:
        changes["gains"] = [float(g) for g in args.gains.split(",")]
    for name in ("warm_start_steps", "max_samples", "seeds", "val_metric"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return Mode(**{**mode.__dict__, **changes})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = mode_of(args)
    out = Path(args.out or ROOT / ("runs/bench_ttt_quick" if args.quick else "runs/bench_ttt"))
    if args.study:
        from benchmarks.ttt import study
        from benchmarks.ttt.registration import RegistrationError

        try:
            return study.main(args, mode, out)
        except RegistrationError as e:
            raise SystemExit(f"time_to_target --study: {e}") from None
    grid = {v.name: v for v in runs.sweep(mode.prompts, mode.mults, mode.lr_ref, mode.p_ref)}
    if args.best and args.best not in grid:
        raise SystemExit(f"--best {args.best!r} is not a sweep setting of this mode ({', '.join(grid)})")
    fixed = grid.get(args.best) if args.best else None
    if args.dry_run:
        placeholder = runs.Variant("<best of sweep>", "sweep", 0, 16, 0.0)
        order = (
            plan_seeds(mode, fixed, args.coord_set, args.arms, args.clock)
            if fixed
            else plan(mode, placeholder, args.coord_set, args.clock)
        )
        for v, seed in order:
            print(f"seed {seed}  {v.name:22s} {' '.join(v.overrides())}  {' '.join(v.cache_tags())}")
        return 0
    t0 = time.time()
    base = make_base(out, mode)
    targets = [round(base["val"] + g, 4) for g in mode.gains]
    print(json.dumps({"base": base, "targets": targets}), flush=True)
    common, older = common_sets(out, mode, targets), older_sets(out, mode, targets)
    execute = executor(out, mode, targets)
    if fixed is not None:
        order = plan_seeds(mode, fixed, args.coord_set, args.arms, args.clock)
        results = run_plan(out, common, order, execute, older)
    else:
        results, _ = run_all(out, mode, common, args.coord_set, execute, older, args.clock)
    name = "seeds" if fixed else "quick" if args.quick else "full"
    line = {"benchmark": "time_to_target", "mode": name, "targets": targets, "wall_s": round(time.time() - t0, 1)}
    report_clocks(results, targets, args.clocks, fixed.name if fixed else None, line, out)
    if fixed is None:
        print(estimate_line(results))
    return 0


def estimate_line(results: list[dict[str, Any]]) -> str:
    """The full mode's wall time predicted from this run's measured costs (coordinator runs and
    the best of sweep counted at 32 prompts × 16; every run 80 × 512 responses, or all of
    ``max_samples`` at worst)."""
    full = MODES["full"]
    mid = runs.Variant("mid", "sweep", 32, runs.SAMPLES, 0.0)
    batches = [v.batch if v.kind == "sweep" or v.kind == "default" else mid.batch for v, _ in plan(full, mid, [])]
    typical = estimate_wall_s(results, batches, 80 * 512, full.eval_samples)
    worst = estimate_wall_s(results, batches, full.max_samples, full.eval_samples)
    if typical is None or worst is None:
        return "full-mode estimate: needs fixed runs at 2+ batch sizes"
    return (
        f"full-mode estimate from these costs: {len(batches)} runs, {typical / 3600:.1f} h at 80×512 responses "
        f"per run, {worst / 3600:.1f} h if every run trains all {full.max_samples}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
