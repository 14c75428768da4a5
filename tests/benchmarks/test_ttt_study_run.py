"""``time_to_target --study`` end to end with ``megarl train`` stood in for (this test is about
which runs the study starts, in which phase, under which clock, and what it writes — the real
runs are ``--study --quick``'s): the stand-in writes a metrics.jsonl that the real ``run_result``,
re-costing and verdict code read."""

import json

import pytest

import benchmarks.time_to_target as ttt
from benchmarks.ttt import harness, registration


def fake_train(calls):
    def run_train(config, sets, log_path, timeout=0, env=None):
        kv = dict(s.split("=", 1) for s in sets)
        run_dir = harness.Path(kv["train.run_dir"])
        calls.append((run_dir.name, (env or {}).get("MEGARL_VIRTUAL_CLOCK", "").rpartition("#")[2]))
        if kv.get("train.steps") == "0":  # the base
            (run_dir / "hf_final").mkdir(parents=True, exist_ok=True)
            (run_dir / "hf_final" / "tokenizer.model").write_bytes(b"spm")
            return {"val/reward_start": 0.2}
        batch = int(kv["rollout.num_prompts"]) * int(kv["rollout.samples_per_prompt"])
        rate = 2e-4 * (float(kv["optim.lr"]) / 5e-5) ** 0.5 / (1 + batch / 512)  # reward per sample
        coord = kv.get("coordinator.enabled") == "true"
        lines, n, reward = [{"step": 0, "val/reward": 0.2}], 0, 0.2
        for s in range(1, 200):
            b = batch * (2 if coord and env and s > 2 else 1)  # under a virtual clock it grows the batch
            n += b
            reward = 0.2 + rate * n
            rec = {"step": s, "timing/step/total": 0.01 + 1e-4 * b, "rollout/responses": b}
            lines.append(rec | ({"val/reward": reward} if s % 2 == 0 else {}))
            if s % 2 == 0 and reward > float(kv["train.target_val_reward"]) + 0.05:
                break
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return {"rl_wall_s": sum(r.get("timing/step/total", 0) for r in lines) + 1.0}

    return run_train


def test_the_quick_study_runs_its_phases_under_each_clock_and_resumes(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(harness, "run_train", fake_train(calls))
    out = tmp_path / "study"
    assert ttt.main(["--study", "--quick", "--out", str(out)]) == 0
    keys = [k for k, _ in calls]
    assert keys[0] == "base" and sorted(keys[1:4]) == ["sweep_p8_m0.5_s1", "sweep_p8_m1_s1", "sweep_p8_m2_s1"]
    # the LR pick: reward per sample ∝ √lr at one batch → m* = 2; the coordinators start from it
    study = json.loads((out / "study.json").read_text())
    assert study["start_lr_mult"] == 2.0 and study["seeds"].startswith("pilot")
    assert sorted(keys[4:]) == sorted(["sweep_p32_m0.5_s1", "sweep_p32_m1_s1", "sweep_p32_m2_s1"] + [
        f"{c}{at}_s1" for at in ("", "@gpu-mid", "@gpu-high") for c in ("coord_small", "coord_large")])  # fmt: skip
    assert {k: c for k, c in calls if k.startswith("coord")} == {
        "coord_small_s1": "", "coord_large_s1": "", "coord_small@gpu-mid_s1": "gpu-mid",
        "coord_large@gpu-mid_s1": "gpu-mid", "coord_small@gpu-high_s1": "gpu-high", "coord_large@gpu-high_s1": "gpu-high"}  # fmt: skip
    assert all(c == "" for k, c in calls if not k.startswith("coord"))  # fixed runs: one run, re-costed
    figs = {(f["figure"], f["clock"]): f for f in study["figures"]}
    assert len(figs) == 12 and study["clocks_sha256"] == registration.load().clocks_sha256
    v1 = figs[("V1", "gpu-mid")]
    assert v1["n"] == 1 and v1["lower"] is None and v1["verdict"] == "FAIL"  # one seed: no bound, nothing passes
    assert v1["gm"] == pytest.approx(v1["statistical"] * v1["systems"], rel=1e-3)
    assert figs[("V5", "cpu")]["verdict"] == "-"
    printed = capsys.readouterr().out
    assert "V1" in printed and '"figures"' in printed
    calls.clear()
    assert ttt.main(["--study", "--quick", "--out", str(out)]) == 0
    assert calls == []  # every run from the cache


def test_judged_seeds_are_refused_before_any_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(harness, "run_train", fake_train(calls))
    reg = tmp_path / "registration.toml"
    reg.write_text(registration.DEFAULT.read_text())  # not in any commit
    with pytest.raises(SystemExit, match="uncommitted"):
        ttt.main(["--study", "--registration", str(reg), "--out", str(tmp_path / "o")])
    assert calls == []
