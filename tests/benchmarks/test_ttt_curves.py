"""benchmarks/ttt/curves.py: the curve read from real metrics.jsonl lines, the running-line
smoother, and the interpolated crossing (hand-computed numbers)."""

import json

import pytest

from benchmarks.ttt.curves import Curve, crossing, curve_from_records, smooth
from megarl.metrics import read_metrics


def _write_metrics(path, lines):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_curve_sums_step_times_between_evaluations_and_skips_validation(tmp_path):
    lines = [{"step": 0, "val/reward": 0.2}]
    for s in range(1, 7):
        rec = {"step": s, "timing/step/total": 0.5 * s, "rollout/responses": 128}
        if s % 3 == 0:
            rec["val/reward"] = 0.2 + 0.05 * s
        lines.append(rec)
    lines.append({"step": 6, "val/reward": 0.52})  # the final validation at the same step: averaged
    lines.append({"step": 6, "timing/checkpoint_blocked_s": 9.0})  # not training time
    _write_metrics(tmp_path / "run", lines)
    c = curve_from_records(read_metrics(tmp_path / "run"))
    assert c.steps == [0, 3, 6]
    assert c.train_s == pytest.approx([0.0, 0.5 + 1.0 + 1.5, 0.5 * 21])
    assert c.samples == [0, 384, 768]
    assert c.reward == pytest.approx([0.2, 0.35, (0.5 + 0.52) / 2])


def test_curve_refuses_a_validation_without_its_step_times():
    recs = [{"step": 0, "val/reward": 0.1}, {"step": 2, "timing/step/total": 1.0, "val/reward": 0.3}]
    with pytest.raises(ValueError, match="validation at step 2 but no step time for step 1"):
        curve_from_records(recs)


def test_smooth_keeps_a_line_and_averages_noise_in_the_interior():
    line = [0.1 + 0.02 * i for i in range(8)]
    assert smooth(line, half=2) == pytest.approx(line)  # the running line reproduces a trend, ends included
    zigzag = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    s = smooth(zigzag, half=1)
    assert s[2] == pytest.approx(2 / 3)  # interior: the centred mean of 3 (1, 0, 1)
    assert s[3] == pytest.approx(1 / 3)
    assert s[0] == pytest.approx(0.0)  # end: the line through (0, 0), (1, 1) evaluated at 0
    assert s[-1] == pytest.approx(0.0)  # the line through (5, 1), (6, 0) evaluated at 6


def test_crossing_interpolates_time_steps_and_samples():
    c = Curve(
        steps=[0, 5, 10, 15],
        train_s=[0.0, 10.0, 22.0, 30.0],
        samples=[0, 640, 1280, 1920],
        reward=[0.30, 0.40, 0.50, 0.60],
    )
    x = crossing(c, 0.45, half=1)  # linear curve: smoothing changes nothing; 0.45 is halfway 5→10
    assert x.reached
    assert x.time_s == pytest.approx(16.0)
    assert x.steps == pytest.approx(7.5)
    assert x.samples == pytest.approx(960.0)


def test_a_lucky_evaluation_does_not_count_as_the_crossing():
    c = Curve(
        steps=[0, 5, 10, 15, 20],
        train_s=[0, 5, 10, 15, 20],
        samples=[0, 1, 2, 3, 4],
        reward=[0.30, 0.30, 0.46, 0.30, 0.30],
    )
    assert crossing(c, 0.45, half=0).reached  # raw: the spike crosses
    x = crossing(c, 0.45, half=1)  # smoothed: (0.30+0.46+0.30)/3 = 0.353 < 0.45
    assert not x.reached
    assert x.time_s == 20 and x.steps == 20  # censored: the whole run, a lower bound


def test_crossing_at_the_start_is_zero():
    c = Curve(steps=[0, 5], train_s=[0.0, 3.0], samples=[0, 10], reward=[0.5, 0.6])
    assert crossing(c, 0.4) == crossing(c, 0.4).__class__(True, 0.0, 0.0, 0.0)


def test_a_crossing_is_read_only_where_its_window_is_complete():
    """A run cut right after a high evaluation: the running line at the end follows that
    value, so a crossing read there would move with where the run was cut."""
    rising = [0.30, 0.31, 0.32, 0.33, 0.34, 0.35, 0.36, 0.37]
    cut = Curve(steps=[5 * i for i in range(6)], train_s=[float(i) for i in range(6)],
                samples=[10 * i for i in range(6)], reward=rising[:5] + [0.50])
    assert smooth(cut.reward, half=2)[-1] > 0.44  # the end leans on the last value
    assert not crossing(cut, 0.42, half=2).reached  # no evaluation past it: nothing to read
    assert crossing(cut, 0.42, half=0).reached  # (raw, half=0: the last point counts)
    # the same run with two more evaluations: the crossing is read, from a complete window
    longer = Curve(steps=[5 * i for i in range(8)], train_s=[float(i) for i in range(8)],
                   samples=[10 * i for i in range(8)], reward=rising[:5] + [0.50, 0.52, 0.54])
    x = crossing(longer, 0.42, half=2)
    sm = smooth(longer.reward, half=2)
    k = next(i for i, v in enumerate(sm) if v >= 0.42)
    assert x.reached and k <= len(sm) - 3 and x.time_s == pytest.approx(k - 1 + (0.42 - sm[k - 1]) / (sm[k] - sm[k - 1]))


def test_a_clock_recosts_each_step_from_its_batch_as_the_planner_logged_it(tmp_path):
    """Under a virtual clock a step costs the clock's time for its batch — the same number the
    planner logs as ``vclock/step_s`` (it observes step s as s - 1) — whatever the machine took."""
    from megarl.coordinator.clock import PHASES, Clock
    from tests.helpers import ROOT

    clock = Clock.load(ROOT / "benchmarks/ttt/clocks.toml", "gpu-mid")
    lines = [{"step": 0, "val/reward": 0.2}]
    for s, n in ((1, 128), (2, 512), (3, 256)):
        planner_logged = sum(clock.phase_times(n, s - 1)[k] for k in PHASES)
        lines.append({"step": s, "timing/step/total": 0.1, "rollout/responses": n, "vclock/step_s": planner_logged,
                      **({"val/reward": 0.3} if s == 3 else {})})  # fmt: skip
    _write_metrics(tmp_path / "run", lines)
    recs = read_metrics(tmp_path / "run")
    c = curve_from_records(recs, clock)
    assert c.train_s[-1] == pytest.approx(sum(r["vclock/step_s"] for r in recs if "vclock/step_s" in r), rel=1e-12)
    assert c.train_s[-1] > 100 * 0.3 and c.samples == [0, 896]  # seconds of a GPU step, not the CPU's 0.1
    assert curve_from_records(recs).train_s[-1] == pytest.approx(0.3)
