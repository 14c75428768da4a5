"""benchmarks/ttt: the resume cache (real files), the run plan, and the held-out task split."""

import json

from benchmarks.ttt import runs
from benchmarks.ttt.tasks import STRATA, split, write_task_file


def test_cache_returns_a_result_only_for_the_same_settings(tmp_path):
    settings = ["rollout.num_prompts=8", "optim.lr=5e-05", "train.seed=1"]
    assert runs.cache_load(tmp_path, "sweep_p8_m1_s1", settings) is None
    runs.cache_store(tmp_path, "sweep_p8_m1_s1", settings, {"time_s": [12.5]})
    assert runs.cache_load(tmp_path, "sweep_p8_m1_s1", settings)["time_s"] == [12.5]
    assert runs.cache_load(tmp_path, "sweep_p8_m1_s1", settings[:2] + ["train.seed=2"]) is None  # stale
    assert not list((tmp_path / "results").glob("*.tmp"))  # written atomically


def test_a_copied_benchmark_folder_keeps_its_cache(tmp_path):
    """Results name the folder's own task file and base model relative to it: a copy under
    another --out still finds them (with absolute paths every run was silently done again)."""
    import shutil

    import benchmarks.time_to_target as ttt

    mode = ttt.MODES["quick"]
    first, second = tmp_path / "s22" / "ttt", tmp_path / "s23" / "ttt"
    settings = ttt.common_sets(first, mode, [0.25, 0.32]) + ["optim.lr=5e-05", "train.seed=1"]
    assert any(str(first) in x for x in settings)  # the folder's own paths are in the settings
    runs.cache_store(first, "sweep_p32_m0.5_s1", settings, {"time_s": [4.8, 16.9]})
    shutil.copytree(first, second)
    moved = ttt.common_sets(second, mode, [0.25, 0.32]) + ["optim.lr=5e-05", "train.seed=1"]
    assert runs.cache_load(second, "sweep_p32_m0.5_s1", moved)["time_s"] == [4.8, 16.9]
    assert runs.cache_load(second, "sweep_p32_m0.5_s1", moved[:-1] + ["train.seed=2"]) is None
    other = ttt.common_sets(second, mode, [0.25, 0.30]) + ["optim.lr=5e-05", "train.seed=1"]
    assert runs.cache_load(second, "sweep_p32_m0.5_s1", other) is None  # another target: run again
    # a result stored with absolute paths before this rule is still found in its own folder
    (first / "results" / "old.json").write_text(json.dumps({"time_s": [1.0], "settings": settings}))
    assert runs.cache_load(first, "old", settings)["time_s"] == [1.0]


def test_results_of_the_older_stop_rule_are_kept_only_where_it_cannot_have_cut_them_short(tmp_path):
    """The stop rule before ``train.target_window`` ended a run on one raw validation past the
    target: a run it stopped before its smoothed curve crossed is run again; one that crossed,
    or trained its whole budget, measured the same thing and is kept."""
    import benchmarks.time_to_target as ttt

    mode = ttt.Mode(**{**ttt.MODES["quick"].__dict__, "max_samples": 1000})
    targets = [0.25, 0.32]
    new = ttt.common_sets(tmp_path, mode, targets)
    old, accept = ttt.older_sets(tmp_path, mode, targets)
    assert "train.target_val_reward=0.3200" in new and "train.target_window=5" in new
    assert "train.target_val_reward=0.3600" in old and "train.evals_past_target=4" in old
    assert [x for x in new if "target" not in x] == [x for x in old if "target" not in x]
    own = ["rollout.num_prompts=8", "train.seed=1"]
    cases = {
        "crossed": {"reached": [True, True], "samples": [300, 700]},
        "budget": {"reached": [True, False], "samples": [300, 1024]},
        "spike": {"reached": [True, False], "samples": [300, 640]},  # stopped by one high validation
    }
    for key, res in cases.items():
        runs.cache_store(tmp_path, key, old + own, res)
    got = {key: runs.cache_load(tmp_path, key, new + own, (old + own, accept)) for key in cases}
    assert got["crossed"]["samples"] == [300, 700] and got["budget"]["samples"] == [300, 1024]
    assert got["spike"] is None
    assert runs.cache_load(tmp_path, "crossed", new + own) is None  # only where the caller allows it
    assert runs.cache_load(tmp_path, "crossed", new + ["train.seed=2"], (old + ["train.seed=2"], accept)) is None


def test_benchmark_resumes_after_an_interruption_and_reruns_nothing(tmp_path):
    """``run_all`` with an ``execute`` that stands in for a training run (this test is about
    which runs start, not about training): killed at the third run, the rerun starts only the
    runs without a result, then adds the best setting's extra seeds."""
    import benchmarks.time_to_target as ttt

    mode = ttt.Mode(**{**ttt.MODES["quick"].__dict__, "seeds": 2})
    started: list[str] = []

    def execute(v, seed, settings, fail_at=None):
        key = runs.run_key(v, seed)
        if key == fail_at:
            raise KeyboardInterrupt
        started.append(key)
        t = {"sweep_p8_m1": 50.0, "sweep_p32_m1": 30.0}.get(v.name, 40.0)
        return {"key": key, "variant": v.name, "kind": v.kind, "seed": seed, "reached": [True], "time_s": [t]}

    order = [runs.run_key(v, s) for v, s in ttt.plan(mode, None, [])]
    assert order == ["coord_small_s1", "sweep_p8_m1_s1", "default_s1", "coord_large_s1", "sweep_p32_m1_s1"]
    try:
        ttt.run_all(tmp_path, mode, ["x=1"], [], lambda v, s, st: execute(v, s, st, fail_at="default_s1"))
    except KeyboardInterrupt:
        pass
    assert started == ["coord_small_s1", "sweep_p8_m1_s1"]
    started.clear()
    results, best = ttt.run_all(tmp_path, mode, ["x=1"], [], execute)
    assert best.name == "sweep_p32_m1"  # fastest to target
    assert started[:3] == ["default_s1", "coord_large_s1", "sweep_p32_m1_s1"]
    assert sorted(started[3:]) == ["coord_large_s2", "coord_small_s2", "default_s2", "sweep_p32_m1_s2"]
    assert len(results) == 9
    started.clear()
    again, _ = ttt.run_all(tmp_path, mode, ["x=1"], [], execute)
    assert started == [] and again == results  # everything from the cache
    started.clear()
    ttt.run_all(tmp_path, mode, ["x=2"], [], execute)  # other settings: every result is stale
    assert len(started) == 9


def test_full_plan_has_three_seeds_of_best_default_and_both_coordinator_starts():
    import benchmarks.time_to_target as ttt

    full = ttt.MODES["full"]
    best = runs.sweep(full.prompts, full.mults, full.lr_ref, full.p_ref)[4]
    order = ttt.plan(full, best, [])
    keys = [runs.run_key(v, s) for v, s in order]
    assert len(keys) == len(set(keys)) == 12 + 3 + 2 * 4
    for name in (best.name, "default", "coord_small", "coord_large"):
        assert {s for v, s in order if v.name == name} == {1, 2, 3}
    small = next(v for v, _ in order if v.name == "coord_small")
    large = next(v for v, _ in order if v.name == "coord_large")
    assert (small.prompts, large.prompts) == (8, 64)
    assert small.lr == runs.sqrt_lr(1e-4, 32, 8) == 5e-5  # the √ rule from 32 prompts at 1e-4


def test_validation_problems_never_appear_in_training(tmp_path):
    train, val = split(600)
    assert sum(len(v) for v in val.values()) == 600
    held = {p for rows in val.values() for p, _ in rows}
    assert not held & {p for rows in train.values() for p, _ in rows}
    counts = write_task_file(tmp_path / "t.jsonl", num_train=3000, num_val=600)
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert counts == {"train": 3000, "val": 600} and len(rows) == 3600
    assert not {r["prompt"] for r in rows[:3000]} & {r["prompt"] for r in rows[3000:]}
    assert {r["stratum"] for r in rows[3000:]} == set(STRATA)
    for r in rows[:50]:
        assert str(eval(r["prompt"].rstrip("="))) == r["answer"]  # noqa: S307 — our own digits and +/-
    again = tmp_path / "again.jsonl"
    write_task_file(again, num_train=3000, num_val=600)
    assert again.read_bytes() == (tmp_path / "t.jsonl").read_bytes()


def test_base_keeps_its_validation_reward_and_is_cached(tmp_path, monkeypatch):
    """make_base with run_train standing in for the warm start (a quick run once had the
    task file's row counts overwrite the base's validation reward: targets of 600.03)."""
    import benchmarks.time_to_target as ttt
    from benchmarks.ttt import harness

    calls = []

    def fake_train(config, sets, log_path, timeout):
        calls.append(sets)
        return {"val/reward_start": 0.25, "warm_start/final_nll": 1.3}

    monkeypatch.setattr(harness, "run_train", fake_train)
    mode = ttt.MODES["quick"]
    base = ttt.make_base(tmp_path, mode)
    assert base["val"] == 0.25 and (base["train_rows"], base["val_rows"]) == (20000, 600)
    assert f"warm_start.steps={mode.warm_start_steps}" in calls[0]
    assert (tmp_path / "tasks.jsonl").is_file()
    assert ttt.make_base(tmp_path, mode)["val"] == 0.25 and len(calls) == 1  # cached


def test_a_rerun_starts_from_an_empty_run_dir_holding_the_base_tokenizer(tmp_path):
    base = tmp_path / "base" / "hf_final"
    base.mkdir(parents=True)
    (base / "tokenizer.model").write_bytes(b"\x00spm-bytes")
    run = tmp_path / "runs" / "sweep_p8_m1_s1"
    (run / "checkpoints").mkdir(parents=True)  # left by an interrupted run
    runs.clean_run_dir(run)
    runs.copy_tokenizer(base, run)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["tokenizer", "tokenizer/tokenizer.model"]
    assert (run / "tokenizer" / "tokenizer.model").read_bytes() == b"\x00spm-bytes"


def test_an_arm_runs_both_starts_again_with_its_settings_interleaved_with_the_control():
    import benchmarks.time_to_target as ttt

    full = ttt.MODES["full"]
    fixed = next(v for v in runs.sweep(full.prompts, full.mults, full.lr_ref, full.p_ref) if v.name == "sweep_p32_m1")
    arms = ttt.parse_arms(["inf:coordinator.unresolved_as_infinite=true", "inf:coordinator.band_ratio=0"])
    assert arms == {"inf": ["coordinator.unresolved_as_infinite=true", "coordinator.band_ratio=0"]}
    order = ttt.plan_seeds(full, fixed, ["coordinator.warmup_steps=3"], arms)
    names = ["sweep_p32_m1", "coord_small", "coord_large", "coord_small_inf", "coord_large_inf"]
    for seed in (1, 2, 3):
        group = [v for v, s in order if s == seed]
        assert sorted(v.name for v in group) == sorted(names)
        byname = {v.name: v for v in group}
        for start in ("coord_small", "coord_large"):
            control, arm = byname[start], byname[start + "_inf"]
            assert (arm.prompts, arm.lr) == (control.prompts, control.lr)
            assert list(arm.sets) == [*control.sets, *arms["inf"]]  # the control's settings, then the arm's
            assert "coordinator.warmup_steps=3" in control.sets
    assert [v.name for v, s in order if s == 1][0] != [v.name for v, s in order if s == 2][0]  # rotated
    for bad in (["inf=coordinator.x=1"], ["in f:coordinator.x=1"], ["inf:coordinator.x"]):
        try:
            ttt.parse_arms(bad)
        except ValueError as e:
            assert bad[0] in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def test_the_validation_metric_reaches_the_base_and_every_run(tmp_path):
    """``--val-metric answer_prob``: the base (whose validation sets the targets) and the runs
    validate alike; the default adds nothing (earlier results keep their cache keys)."""
    import benchmarks.time_to_target as ttt

    exact = ttt.Mode(**{**ttt.MODES["quick"].__dict__, "val_metric": "answer_prob"})
    assert "train.val_metric=answer_prob" in ttt.data_sets(tmp_path, exact)
    assert "train.val_metric=answer_prob" in ttt.common_sets(tmp_path, exact, [0.3])
    assert not any("val_metric" in s for s in ttt.common_sets(tmp_path, ttt.MODES["quick"], [0.3]))
