"""benchmarks/ttt/clocked.py and report.py: a run re-costed under a clock from its recorded step
batches, the per-clock view, and time = samples × cost per sample split into two factors."""

import pytest

from benchmarks.ttt.clocked import CPU, clock_view, decompose, load_clocks, on_clock, recost, step_batches
from benchmarks.ttt.curves import Curve
from benchmarks.ttt.report import decomposition
from megarl.coordinator.clock import PHASES


@pytest.fixture(scope="module")
def gpu_mid():
    return load_clocks(["gpu-mid"])["gpu-mid"]


def _result(variant, kind, seed, batches, reward, clock=CPU, every=2):
    """A cached result whose curve is evaluated every ``every`` steps of ``batches``; CPU step 1 s."""
    steps = list(range(0, len(batches) + 1, every))
    samples = [sum(batches[:s]) for s in steps]
    return {"key": f"{variant}_s{seed}", "variant": variant, "kind": kind, "seed": seed, "clock": clock,
            "curve": Curve(steps, [float(s) for s in steps], samples, reward).to_dict(), "step_batches": batches,
            "reached": [True], "time_s": [3.0], "steps": [3.0], "samples": [float(sum(batches[:3]))]}  # fmt: skip


def test_step_batches_reads_each_steps_responses_and_refuses_a_gap():
    recs = [{"step": 0, "val/reward": 0.1}] + [
        {"step": s, "timing/step/total": 1.0, "rollout/responses": 64 * s} for s in (1, 2, 3)
    ]
    assert step_batches(recs) == [64, 128, 192]
    with pytest.raises(ValueError, match=r"no step record for steps \[2\]"):
        step_batches([r for r in recs if r["step"] != 2])


def test_recost_charges_each_step_the_clocks_time_for_its_batch(gpu_mid):
    batches = [128, 128, 512, 256]
    c = recost(Curve([0, 2, 4], [0.0, 2.0, 4.0], [0, 256, 1024], [0.1, 0.2, 0.3]), batches, gpu_mid)
    per_step = [sum(gpu_mid.phase_times(n, k)[p] for p in PHASES) for k, n in enumerate(batches)]  # observed as s - 1
    assert c.train_s == pytest.approx([0.0, per_step[0] + per_step[1], sum(per_step)], rel=1e-12)
    assert c.samples == [0, 256, 1024] and c.reward == [0.1, 0.2, 0.3]  # learning untouched
    with pytest.raises(ValueError, match="reaches step 4 but only 3"):
        recost(Curve([0, 4], [0.0, 4.0], [0, 512], [0.1, 0.3]), batches[:3], gpu_mid)


def test_on_clock_moves_time_not_samples_and_keeps_cpu_time_beside(gpu_mid):
    # linear rewards 0.1 → 0.5 every 2 steps; target 0.25 is halfway from eval 1 to 2 (steps 2 → 4):
    # on the CPU (1 s a step) 3.0 s, 384 samples
    res = _result("sweep_p8_m1", "sweep", 1, [128] * 8, [0.1, 0.2, 0.3, 0.4, 0.5])
    res |= {"time_s": [3.5]}  # the CPU time as measured (not the clock's)
    v = on_clock(res, "gpu-mid", gpu_mid, [0.25], half=1)
    cum = [0.0]
    for k in range(8):
        cum.append(cum[-1] + sum(gpu_mid.phase_times(128, k)[p] for p in PHASES))
    assert v["time_s"][0] == pytest.approx(cum[2] + 0.5 * (cum[4] - cum[2]), rel=1e-9)  # halfway, smoothed line
    assert v["cpu_s"] == [3.5] and v["samples"] == [384.0] and v["clock"] == "gpu-mid"
    assert v["cost_per_sample"][0] == pytest.approx(v["time_s"][0] / 384.0)
    cpu = on_clock(res, CPU, None, [0.25], half=1)
    assert cpu["time_s"] == [3.5] and cpu["cost_per_sample"] == [3.5 / 384.0]
    with pytest.raises(ValueError, match="no step_batches"):
        on_clock({k: x for k, x in res.items() if k != "step_batches"}, "gpu-mid", gpu_mid, [0.25], half=1)


def test_a_clocks_view_holds_every_fixed_run_and_only_its_own_coordinator_runs(gpu_mid):
    rw = [0.1, 0.2, 0.3, 0.4, 0.5]
    results = [_result("sweep_p8_m1", "sweep", 1, [128] * 8, rw),
               _result("coord_small", "coord", 1, [128] * 8, rw),
               _result("coord_small@gpu-mid", "coord", 1, [128, 256, 512, 512, 512, 512, 512, 512], rw, "gpu-mid"),
               _result("coord_small@gpu-high", "coord", 1, [128] * 8, rw, "gpu-high")]  # fmt: skip
    view = clock_view(results, "gpu-mid", gpu_mid, [0.25], half=1)
    assert [(r["key"], r["variant"]) for r in view] == [
        ("sweep_p8_m1_s1", "sweep_p8_m1"),
        ("coord_small@gpu-mid_s1", "coord_small"),
    ]
    cpu = clock_view(results, CPU, None, [0.25], half=1)
    assert [r["key"] for r in cpu] == ["sweep_p8_m1_s1", "coord_small_s1"]


def test_a_time_ratio_splits_exactly_into_samples_and_cost_per_sample():
    a = {"reached": [True], "time_s": [100.0], "samples": [1000.0]}
    b = {"reached": [True], "time_s": [40.0], "samples": [800.0]}
    d = decompose(a, b, 0)
    assert d == pytest.approx({"time": 2.5, "statistical": 1.25, "systems": 2.0})
    assert decompose(a, b | {"reached": [False]}, 0) is None
    view = [
        {"variant": "fixed", "seed": 1, **a}, {"variant": "coord", "seed": 1, **b},
        {"variant": "fixed", "seed": 2, "reached": [True], "time_s": [50.0], "samples": [500.0]},
        {"variant": "coord", "seed": 2, "reached": [True], "time_s": [50.0], "samples": [1000.0]},
    ]  # fmt: skip
    got = decomposition(view, "fixed", ["coord"], 0)["fixed/coord"]
    # seed 2: time 1, statistical 0.5, systems 2 → gm time √2.5, statistical √0.625, systems 2
    assert got["time"] == pytest.approx(2.5**0.5, abs=1e-4) and got["statistical"] == pytest.approx(
        0.625**0.5, abs=1e-4
    )
    assert got["systems"] == pytest.approx(2.0, abs=1e-4) and got["seeds"] == 2
