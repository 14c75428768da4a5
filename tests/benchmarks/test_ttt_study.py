"""The #45 study's pure parts: the registration (parsed, checked, refused while uncommitted), the
V-figures with their PASS/FAIL against the bars, the power rows, and the pilot's LR pick."""

import math
import shutil
import subprocess

import pytest

from benchmarks.ttt import registration, runs, study
from benchmarks.ttt.verdict import power, verdicts
from tests.helpers import ROOT

NAMES = {"start": "sweep_p8_m1", "line": ["sweep_p8_m1", "sweep_p16_m1"], "grid": ["sweep_p8_m1", "sweep_p16_m1"],
         "small": "coord_small", "large": "coord_large"}  # fmt: skip
BARS = registration.load().bars


def _run(variant, seed, t, samples=1000.0, reached=True):
    return {
        "variant": variant,
        "seed": seed,
        "time_s": [t],
        "cpu_s": [10 * t],
        "samples": [samples],
        "reached": [reached],
    }


def _view():
    """start 100 s, the 16-prompt batch 50 s (C = 2), the coordinator at 128 100/e^x with
    x = 0.6, 0.8, 0.7, 0.7 (mean 0.7, sd √(0.02/3)), started at 1024 1.2× slower."""
    view = []
    for seed, x in zip((1, 2, 3, 4), (0.6, 0.8, 0.7, 0.7)):
        t = 100 / math.exp(x)
        view += [_run("sweep_p8_m1", seed, 100.0), _run("sweep_p16_m1", seed, 50.0, 1200.0),
                 _run("coord_small", seed, t, 800.0), _run("coord_large", seed, 1.2 * t, 800.0)]  # fmt: skip
    return view


def test_the_registered_bars_and_seeds_are_the_issues():
    reg = registration.load()
    assert reg.bars["v1"] == {"gpu-mid": {"ceiling_exponent": 0.7, "lower": 1.05},
                              "gpu-high": {"ceiling_exponent": 0.7, "lower": 1.3}, "cpu": {"lower": 0.95}}  # fmt: skip
    assert reg.bars["v2"] == {"gm": 0.95, "lower": 0.85} and reg.bars["v3"] == {"low": 0.87, "high": 1.15}
    assert reg.bars["level"] == 0.9
    assert len(reg.judged) >= 8 and not set(reg.judged) & set(reg.pilot)
    assert reg.start_prompts * runs.SAMPLES == 128 and max(reg.line_prompts) * runs.SAMPLES == 1024
    assert reg.clocks == ["cpu", "gpu-mid", "gpu-high"]
    # item 3: coupled seeds in every arm; the exact endpoint reaches the base (its validation sets the targets)
    assert reg.common_sets == ["rollout.sampling_seed=prompt"] and reg.val_metric == "answer_prob"
    mode = study.study_mode(reg, study.MODES["full"])
    assert mode.val_metric == "answer_prob" and mode.gains == reg.gains


def test_v_figures_by_hand_pass_and_fail_against_the_bars():
    rows = {(r["figure"]): r for r in verdicts(_view(), "gpu-mid", NAMES, [1, 2, 3, 4], [1, 2, 3, 4], BARS)}
    t3 = 1.637744  # t_{0.9, 3} (any t table)
    sd = math.sqrt(0.02 / 3)
    v1 = rows["V1"]
    assert v1["C"] == pytest.approx(2.0) and v1["best_fixed"] == "sweep_p16_m1"
    assert v1["gm"] == pytest.approx(math.exp(0.7), abs=1e-4)
    assert v1["lower"] == pytest.approx(math.exp(0.7 - t3 * sd / 2), abs=1e-4)
    assert v1["statistical"] == pytest.approx(1000 / 800) and v1["cpu_gm"] == pytest.approx(v1["gm"], abs=1e-3)
    assert v1["systems"] == pytest.approx(math.exp(0.7) * 0.8, abs=1e-4)  # time = statistical × systems
    assert v1["verdict"] == "PASS"  # gm 2.01 ≥ 2^0.7 = 1.62, lower 1.88 ≥ 1.05
    assert rows["V2"]["gm"] == pytest.approx(math.exp(0.7) / 2, abs=1e-4) and rows["V2"]["verdict"] == "PASS"
    assert rows["V3"]["gm"] == pytest.approx(1 / 1.2, abs=1e-4) and rows["V3"]["verdict"] == "FAIL"  # < 0.87
    assert rows["V5"]["verdict"] == "-" and rows["V5"]["best_of_grid"] == "sweep_p16_m1"
    strict = {**BARS, "v1": {**BARS["v1"], "gpu-mid": {"ceiling_exponent": 0.7, "lower": 1.9}}}
    assert verdicts(_view(), "gpu-mid", NAMES, [1, 2, 3, 4], [1], strict)[0]["verdict"] == "FAIL"  # lower 1.88 < 1.9
    steep = [r if r["variant"] != "sweep_p16_m1" else r | {"time_s": [20.0]} for r in _view()]  # C = 5: C^0.7 = 3.09
    assert verdicts(steep, "gpu-mid", NAMES, [1, 2, 3, 4], [1], BARS)[0]["verdict"] == "FAIL"


def test_a_missed_target_counts_with_its_bound_and_is_reported_as_censored():
    view = [r | {"reached": [False]} if (r["variant"], r["seed"]) == ("coord_small", 2) else r for r in _view()]
    v1 = verdicts(view, "cpu", NAMES, [1, 2, 3, 4], [1], BARS)[0]
    assert v1["censored"] == 1 and v1["n"] == 4


def test_power_rows_from_the_pilot_spread_or_a_given_sigma():
    rows = verdicts(_view(), "gpu-mid", NAMES, [1, 2, 3, 4], [1, 2, 3, 4], BARS)
    need = {r["figure"]: r for r in power(rows, BARS)}
    assert set(need) == {"V1", "V2"} and need["V1"]["bar_lower"] == 1.05 and need["V2"]["bar_lower"] == 0.85
    assert need["V1"]["seeds_needed"] == 2  # gap ln(2.01/1.05) = 0.65 ≫ 3.15 · 0.082
    assert power(rows, BARS, sigma=5.0)[0]["seeds_needed"] is None


def test_the_pilot_picks_the_lr_with_fewest_samples_runs_that_missed_last():
    sweep = runs.sweep([8], [0.5, 1.0, 2.0], 1e-4, 32)
    res = [_run("sweep_p8_m0.5", s, 1.0, 900.0) for s in (1, 2)] + [_run("sweep_p8_m1", s, 1.0, 1000.0) for s in (1, 2)]
    res += [_run("sweep_p8_m2", 1, 1.0, 100.0), _run("sweep_p8_m2", 2, 1.0, 200.0, reached=False)]
    assert study.pick_mult(res, sweep, [1, 2]) == 0.5
    assert study.pick_mult(res, sweep, [1]) == 2.0


def test_quick_study_shrinks_budgets_and_seeds_not_the_design():
    reg = registration.load()
    q = study.quick(reg)
    assert q.judged == [] and q.pilot == reg.pilot[:1] and q.line_prompts == [8, 32] and q.bars == reg.bars
    a = study.arms(q, 1.0)
    assert [v.name for v in a["lr_sweep"]] == ["sweep_p8_m0.5", "sweep_p8_m1", "sweep_p8_m2"]
    assert [v.name for v in a["coords"]] == ["coord_small", "coord_large", "coord_small@gpu-mid",
                                             "coord_large@gpu-mid", "coord_small@gpu-high", "coord_large@gpu-high"]  # fmt: skip
    assert a["coords"][2].cache_tags()[0].endswith(reg.clocks_sha256) and a["coords"][0].cache_tags() == []


def _copy(tmp_path, edit=lambda s: s):
    path = tmp_path / "registration.toml"
    path.write_text(edit(registration.DEFAULT.read_text()))
    return path


def test_a_malformed_registration_is_refused_naming_the_field(tmp_path):
    cases = {
        "seeds.judged shares [1]": lambda s: s.replace("judged = [4101,", "judged = [1, 4101,"),
        "clocks.sha256": lambda s: s.replace('sha256 = "5d30', 'sha256 = "0d30'),
        "bars.v1 has no bar for clocks": lambda s: s.replace("cpu = { lower = 0.95 }", "cpux = { lower = 0.95 }"),
        "common_sets entries": lambda s: s.replace("common_sets = [", 'common_sets = [\n  "rollout.sampling_seed",'),
        "missing seeds.pilot": lambda s: s.replace("pilot = [1, 2, 3]", ""),
        "targets.val_metric = 'greedy'": lambda s: s.replace('val_metric = "answer_prob"', 'val_metric = "greedy"'),
    }
    for match, edit in cases.items():
        with pytest.raises(registration.RegistrationError, match=match.replace("[", r"\[")):
            registration.load(_copy(tmp_path, edit), root=ROOT)


def test_judged_runs_are_refused_until_the_registration_is_committed(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    git("init", "-q")
    path = _copy(tmp_path)
    reg = registration.load(path, root=ROOT)
    with pytest.raises(registration.RegistrationError, match="uncommitted"):
        registration.require_committed(reg)  # untracked
    git("add", path.name)
    git("commit", "-qm", "register")
    head = registration.require_committed(reg)
    assert len(head) == 40
    path.write_text(path.read_text().replace("level = 0.9", "level = 0.8"))
    with pytest.raises(registration.RegistrationError, match="uncommitted"):
        registration.require_committed(reg)  # edited after the commit
    shutil.rmtree(tmp_path / ".git")
    assert registration.git_state(path)[0] is False  # no repository here (or not tracked in one above)
