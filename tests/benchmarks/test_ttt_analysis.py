"""benchmarks/ttt/analysis.py: one run folder → result (curve, crossings, coordinator
stats) from a real metrics.jsonl, and the ratios / calibration assembled from results."""

import json
import math

import pytest

from benchmarks.ttt import runs
from benchmarks.ttt.analysis import _row, analyse, compare_seeds, estimate_wall_s, resolution_line, run_result


def _metrics(run, batch_of_step, b_noise=None, step_s=0.5):
    run.mkdir(parents=True)
    lines = [{"step": 0, "val/reward": 0.30}]
    for s in range(1, 31):
        rec = {"step": s, "timing/step/total": step_s, "rollout/responses": batch_of_step(s)}
        if s % 5 == 0:
            rec["val/reward"] = 0.30 + 0.01 * s  # linear: 0.40 at step 10, 0.60 at step 30
        if b_noise is not None:
            rec |= {
                "coord/batch": batch_of_step(s),
                "coord/b_noise/actor": b_noise(s),
                "coord/b_noise_low/actor": b_noise(s) / 2,
                "coord/b_noise_high/actor": b_noise(s) * 2,
                "coord/probe_s/actor": 0.003,
                "coord/probe_s/critic": 0.002,
                "timing/step/plan": 0.005,
                "train/lr": 1e-4 if s <= 10 else 2e-4,
            }
        lines.append(rec)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_run_result_reads_crossings_and_the_coordinator_from_a_run_folder(tmp_path):
    v = runs.coordinator("coord_small", 8, 4, 64, 1e-4, 32, [])
    _metrics(tmp_path / "r", lambda s: 128 if s <= 10 else 512, b_noise=lambda s: 100.0 * s)
    res = run_result(v, 2, tmp_path / "r", {"rl_wall_s": 21.0}, [0.40, 0.45, 0.60], wall_s=40.0)
    assert res["key"] == "coord_small_s2" and res["kind"] == "coord"
    assert res["reached"] == [True, True, False]
    assert res["steps"][:2] == pytest.approx([10.0, 15.0])
    assert res["time_s"][:2] == pytest.approx([5.0, 7.5])
    assert res["samples"][:2] == pytest.approx([1280.0, 1280 + 5 * 512])
    # 0.60 is the last evaluation: no complete window there, so censored (all 30 steps)
    assert res["time_s"][2] == pytest.approx(15.0)
    assert res["val_s"] == pytest.approx((21.0 - 15.0) / 6)
    assert res["overhead_s"] == pytest.approx(19.0)
    c = res["coord"]
    assert c["b_noise"] == pytest.approx(100.0 * 23)  # median over steps 16..30
    assert (c["b_noise_low"], c["b_noise_high"]) == pytest.approx((1150.0, 4600.0))
    assert c["batches"] == [128, 512] and c["final_batch"] == 512
    assert c["overhead_frac"] == pytest.approx(0.01 / 0.5)
    assert c["lr_run"] == (1e-4, 2e-4)  # what ran (train/lr), not the variant's nominal LR
    row = _row(res)  # the table row
    assert (row["batch"], row["lr"]) == ("128->512", "0.0001->0.0002")


def _result(variant, kind, seed, batch, time_s, steps, reached=True, coord=None):
    return {
        "key": f"{variant}_s{seed}",
        "variant": variant,
        "kind": kind,
        "seed": seed,
        "prompts": batch // 16,
        "batch": batch,
        "lr": 1e-4,
        "reached": [reached],
        "time_s": [time_s],
        "steps": [steps],
        "samples": [steps * batch],
        "val_start": 0.3,
        "steps_run": 60,
        "step_s": 0.001 * batch + 0.2,
        "val_s": 1.0,
        "overhead_s": 30.0,
        "coord": coord,
    }


def test_analyse_ratios_and_calibration():
    s_min, e_min = 20.0, 20.0 * 400  # B_crit = 400 responses
    sweep = [
        _result(f"sweep_p{b // 16}_m1", "sweep", 1, b, t, s_min + e_min / b)
        for b, t in ((128, 90.0), (256, 60.0), (512, 70.0), (1024, 100.0))
    ]
    sweep.append(_result("sweep_p64_m2", "sweep", 1, 1024, 500.0, 150, reached=False))
    coord = {"b_noise": 200.0, "final_batch": 512, "overhead_frac": 0.01}
    others = []
    for seed, (small, large, dflt, best) in {1: (50.0, 75.0, 120.0, None), 2: (80.0, 80.0, 160.0, 40.0)}.items():
        others += [
            _result("coord_small", "coord", seed, 128, small, 30, coord=coord),
            _result("coord_large", "coord", seed, 1024, large, 30, coord=coord | {"b_noise": 600.0}),
            _result("default", "default", seed, 128, dflt, 80),
        ]
        if best:
            others.append(_result("sweep_p16_m1", "sweep", seed, 256, best, 40))
    rep = analyse(sweep + others, [0.5], "sweep_p16_m1")
    r = rep["ratios"]
    assert r["best/coord_small_per_seed"] == {1: 1.2, 2: 0.5}
    assert r["best/coord_small"] == pytest.approx(math.sqrt(1.2 * 0.5), abs=1e-3)
    assert r["default/coord_large"] == pytest.approx(math.sqrt(120 / 75 * 2), abs=1e-3)
    assert r["median/coord_small"] == pytest.approx(90.0 / math.sqrt(50 * 80), abs=1e-3)  # median of 5 settings: 90
    assert r["coord_small/coord_large"] == pytest.approx(math.sqrt(50 / 75), abs=1e-3)
    assert r["b_crit_fit"] == pytest.approx(400.0)
    assert r["b_noise_online"] == pytest.approx(400.0)  # median of 200, 200, 600, 600
    assert r["b_noise_online/b_crit_fit"] == pytest.approx(1.0)
    assert r["chosen_batch/best_batch"] == [2.0] * 4
    assert r["censored_runs"] == 1
    assert rep["sweep"]["best"]["batch"] == 256 and rep["sweep"]["b_crit"] == pytest.approx(400.0)
    assert "B_crit = 400 responses" in rep["calibration_line"]
    assert next(row for row in rep["rows"] if row["key"] == "sweep_p64_m2_s1")["time_s"] == ">500.0"
    assert r["by_target"] == {
        "0.5": {k: r[k] for k in ("best/coord_small", "default/coord_small", "best/coord_large", "default/coord_large")}
    }
    # step time 0.2 + 0.001 B, 1 s per evaluation, 30 s per run: two runs of 3000 responses at
    # B = 100, 300 (30 and 10 steps), each validated every 1500 responses
    assert estimate_wall_s(sweep, [100, 300], 3000, 1500) == pytest.approx(2 * 30 + 30 * 0.3 + 10 * 0.5 + 2 * 2 * 1.0)


def test_headline_is_the_last_target_the_best_reached_and_censored_pairs_are_left_out():
    """Two targets; the best setting misses the second on seed 2, the small coordinator misses
    the first on seed 1: the headline is the first target, and seed 1 has no small-start pair."""

    def res(variant, kind, seed, times, reached):
        r = _result(variant, kind, seed, 256, times[0], 20)
        return r | {"time_s": times, "reached": reached, "steps": [20, 40], "samples": [5120, 10240]}

    results = [
        res("sweep_p16_m1", "sweep", 1, [10.0, 30.0], [True, True]),
        res("sweep_p16_m1", "sweep", 2, [12.0, 50.0], [True, False]),
        res("coord_small", "coord", 1, [40.0, 40.0], [False, False]),
        res("coord_small", "coord", 2, [24.0, 60.0], [True, True]),
        res("coord_large", "coord", 1, [20.0, 45.0], [True, True]),
        res("coord_large", "coord", 2, [6.0, 45.0], [True, True]),
        res("default", "default", 1, [30.0, 90.0], [True, True]),
        res("default", "default", 2, [36.0, 90.0], [True, True]),
    ]
    for r in results:
        r["coord"] = {"b_noise": 300.0, "final_batch": 256} if r["kind"] == "coord" else None
    r = analyse(results, [0.4, 0.5], "sweep_p16_m1")["ratios"]
    assert r["headline_target"] == 0.4
    assert r["best/coord_small_per_seed"] == {2: 0.5}  # seed 1: the coordinator's 40 s is a bound
    assert r["best/coord_large_per_seed"] == {1: 0.5, 2: 2.0}
    assert r["best/coord_large"] == pytest.approx(1.0)
    assert r["coord_small/coord_large"] == pytest.approx(4.0)  # seed 2 only: 24 / 6
    assert r["by_target"]["0.5"]["best/coord_large"] == pytest.approx(30 / 45, abs=1e-3)  # seed 2's best missed


def test_compare_seeds_pairs_each_seed_and_bounds_censored_runs():
    coord = {"final_batch": 256}
    results = [
        _result("sweep_p32_m1", "sweep", 1, 512, 60.0, 30),
        _result("coord_small", "coord", 1, 128, 50.0, 40, coord=coord),  # won: 1.2
        _result("coord_large", "coord", 1, 1024, 75.0, 20, coord=coord),  # lost: 0.8
        _result("sweep_p32_m1", "sweep", 2, 512, 90.0, 45),
        _result("coord_small", "coord", 2, 128, 100.0, 60, reached=False, coord=coord),  # missed: < 0.9
        _result("coord_large", "coord", 2, 1024, 45.0, 15, coord=coord),  # won: 2.0
    ]
    r = compare_seeds(results, [0.4], "sweep_p32_m1")["ratios"]
    assert r["best/coord_small_per_seed"] == {1: "1.200", 2: "<0.900"}
    assert r["best/coord_small"] == 1.2  # the only seed where both reached the target
    assert r["best/coord_small_worst_per_seed"] == 0.9  # the censored seed is a loss of at least this
    assert r["best/coord_large_per_seed"] == {1: "0.800", 2: "2.000"}
    assert abs(r["best/coord_large"] - (0.8 * 2.0) ** 0.5) < 1e-3
    assert r["best/coord_large_worst_per_seed"] == 0.8
    assert r["coord_small/coord_large_per_seed"] == {1: round(50 / 75, 3)}
    assert r["censored_runs"] == 1
    assert r["chosen_batch/fixed_batch"] == [0.5, 0.5, 0.5, 0.5]
    assert r["bar_resolution"] is None  # two seeds of the fixed setting say nothing about its spread


def test_compare_seeds_reports_what_the_per_seed_bar_can_resolve():
    c = {"final_batch": 256}
    results = []
    for seed, (fixed, small) in enumerate([(10.0, 12.0), (20.0, 25.0), (40.0, 44.0)], 1):
        results += [
            _result("sweep_p32_m1", "sweep", seed, 512, fixed, 30),
            _result("coord_small", "coord", seed, 128, small, 40, coord=c),
        ]
    res = compare_seeds(results, [0.4], "sweep_p32_m1")["ratios"]["bar_resolution"]
    assert res["seeds"] == 3 and res["p_equal_method_every_seed"] == 0.125  # 3 of 6 ordered pairs >= 0.9
    assert res["sigma_log_fixed"] == round(math.log(2.0), 3)
    assert res["pairing"]["coord_small"] > 0.99  # these coordinator times follow the fixed ones
    assert "σ = 0.69 over 3 seeds" in resolution_line(res) and "p = 0.125" in resolution_line(res)


def test_compare_seeds_reports_each_arm_against_the_fixed_run_and_its_control():
    c = {"final_batch": 512}
    results = [
        _result("sweep_p32_m1", "sweep", 1, 512, 60.0, 30),
        _result("coord_small", "coord", 1, 128, 80.0, 40, coord=c),
        _result("coord_large", "coord", 1, 1024, 60.0, 20, coord=c),
        _result("coord_small_inf", "coord", 1, 128, 40.0, 40, coord=c),
        _result("coord_large_inf", "coord", 1, 1024, 50.0, 20, coord=c),
        _result("sweep_p32_m1", "sweep", 2, 512, 90.0, 45),
        _result("coord_small", "coord", 2, 128, 100.0, 60, reached=False, coord=c),
        _result("coord_large", "coord", 2, 1024, 45.0, 15, coord=c),
        _result("coord_small_inf", "coord", 2, 128, 60.0, 30, coord=c),
        _result("coord_large_inf", "coord", 2, 1024, 90.0, 15, coord=c),
    ]
    r = compare_seeds(results, [0.4], "sweep_p32_m1")["ratios"]
    assert r["best/coord_small_inf_per_seed"] == {1: "1.500", 2: "1.500"}
    assert r["best/coord_small_inf"] == 1.5
    assert r["best/coord_large_inf_worst_per_seed"] == 1.0
    assert r["best/coord_small_per_seed"] == {1: "0.750", 2: "<0.900"}  # the control, as before
    assert r["coord_small_inf/coord_large_inf_per_seed"] == {1: 0.8, 2: round(60 / 90, 3)}
    assert r["coord_small/coord_small_inf_per_seed"] == {1: 2.0}  # seed 2's control missed: no pair
    assert r["coord_large/coord_large_inf_per_seed"] == {1: 1.2, 2: 0.5}
    assert r["coord_large/coord_large_inf"] == round((1.2 * 0.5) ** 0.5, 3)
    assert len(r["chosen_batch/fixed_batch"]) == 8
