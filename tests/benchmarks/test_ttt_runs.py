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


def test_benchmark_resume_skips_cached_runs(tmp_path, monkeypatch):
    """The benchmark's loop runs only what the cache lacks (run_train replaced by a counter:
    this test is about which runs start, not about training)."""
    import benchmarks.time_to_target as ttt

    mode = ttt.MODES["quick"]
    order = ttt.plan(mode, None, [])
    assert [v.name for v, _ in order] == ["coord_small", "sweep_p8_m1", "default", "coord_large", "sweep_p32_m1"]
    common = ["x=1"]
    for v, seed in order[:3]:
        runs.cache_store(tmp_path, runs.run_key(v, seed), common + v.overrides() + [f"train.seed={seed}"], {"ok": 1})
    todo = [
        runs.run_key(v, s)
        for v, s in order
        if runs.cache_load(tmp_path, runs.run_key(v, s), common + v.overrides() + [f"train.seed={s}"]) is None
    ]
    assert todo == ["coord_large_s1", "sweep_p32_m1_s1"]


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
