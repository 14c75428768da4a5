"""Pipelined rollouts through the real entry point (``megarl train``: TP=2 trainer ranks, one
vLLM engine): with ``rollout.max_staleness=1`` the engine generates step s+1's batch while the
trainer updates on step s. The run completes; every step logs the samples' lag (0 at the first
step, then exactly 1: sampled by the weights pushed one sync before), the policy version that
sampled them and the fraction of the step the trainer and the fleet waited. A run stopped after
step 2 — whose checkpoint holds the batch generated ahead for step 3 — and resumed equals the
uninterrupted run: same prompts, same metrics, bitwise-equal final weights."""

import json
from pathlib import Path

from tests.e2e.test_resume import COMMON, GRPO, _assert_same_run, _run, _steps

PIPELINED = [*GRPO[1], "rollout.max_staleness=1", "algo.tis_cap=2"]


def test_staleness_one_runs_logs_its_lag_and_resumes_exactly(tmp_path: Path) -> None:
    config = GRPO[0]
    full, parts = tmp_path / "full", tmp_path / "parts"
    _run(config, [*COMMON, *PIPELINED, "train.steps=4", f"train.run_dir={full}"])
    steps = _steps(full)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[s]["pipeline/staleness_max"] for s in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    assert [steps[s]["pipeline/staleness_mean"] for s in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    # steps 1 and 2 were both generated before the first update (version 1), then one a sync
    assert [steps[s]["rollout/policy_version"] for s in range(1, 5)] == [1.0, 1.0, 2.0, 3.0]
    for s in range(1, 5):
        r = steps[s]
        assert 0.0 <= r["pipeline/trainer_wait_frac"] <= 1.0 and 0.0 <= r["pipeline/fleet_wait_frac"] <= 1.0
        assert r["pipeline/batch_generate_s"] > 0
        assert r["rollout/mismatch_abs_logp_mean"] >= 0  # π_prox was computed (decoupled PPO)
    # the lag is real: at steps 2-4 the trainer's policy differs from the sampler's by an update
    assert min(steps[s]["rollout/mismatch_abs_logp_mean"] for s in (2, 3, 4)) > steps[1][
        "rollout/mismatch_abs_logp_mean"
    ]

    _run(config, [*COMMON, *PIPELINED, "train.steps=2", f"train.run_dir={parts}"])
    state = json.loads((parts / "checkpoints" / "step_00000002" / "state.json").read_text())
    ahead = state["rollouts"]["ahead"]
    assert [e["step"] for e in ahead] == [2] and state["rollouts"]["next_step"] == 3  # step 3's batch, 0-based 2
    assert len(ahead[0]["batch"]["tokens"]) == 8 * 4 and set(ahead[0]["batch"]["versions"]) == {2}
    assert list(state["planner"]["plans_ahead"]) == ["2"]
    log = _run(config, [*COMMON, *PIPELINED, "train.steps=4", f"train.run_dir={parts}"])
    assert "resumed from" in log and "at step 2" in log
    _assert_same_run(full, parts, 4)
    resumed = _steps(parts)
    for s in (3, 4):
        for k in ("pipeline/staleness_max", "rollout/policy_version", "rollout/mismatch_abs_logp_mean"):
            assert resumed[s][k] == steps[s][k], (s, k)
