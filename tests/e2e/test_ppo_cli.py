"""A short PPO run through `megarl train`: actor + Megatron critic (TP=2), GAE, KL in the
reward with the adaptive controller, critic warm-up, 2 epochs × 2 mini-batches."""

from pathlib import Path

from megarl.metrics import read_metrics
from tests.helpers import megarl_train


def test_ppo_loop_updates_actor_and_critic(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sets = ["train.steps=4", "train.eval_every=0", "warm_start.steps=20", "rollout.num_prompts=8",
            "rollout.samples_per_prompt=4", "parallel.micro_batch_size=8", "data.num_train=2000",
            "data.num_val=16", "critic.warmup_steps=2", "train.tensorboard=false",
            "rollout.engine_logprobs_every=2", f"train.run_dir={run}"]
    megarl_train("ppo_cpu.yaml", sets)
    steps = [r for r in read_metrics(run) if "critic/value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # critic warm-up: the actor waits 2 steps, the critic trains from step 1
    assert [r["train/actor_updated"] for r in steps] == [0.0, 0.0, 1.0, 1.0]
    assert "train/loss" not in steps[0] and "train/loss" in steps[2]
    for r in steps:  # (a batch whose returns and values are all 0 has no critic gradient)
        assert (r["critic/grad_norm"] > 0) == (r["critic/value_loss"] > 0) and r["critic/lr"] == 5e-4
        assert "train/kl_coef" in r
        assert ("rollout/mismatch_abs_logp_mean" in r) == (r["step"] % 2 == 1)  # engine log-probs every 2nd step
    assert sum(r["critic/grad_norm"] > 0 for r in steps) >= 2
    assert steps[2]["train/grad_norm"] > 0
    # the adaptive controller moved the coefficient
    assert steps[-1]["train/kl_coef"] != 0.05


def test_ppo_critic_on_its_own_layout_with_the_coordinator(tmp_path: Path) -> None:
    """Actor TP2 with the critic on TP1 × DP2 (its own groups): the coordinator's probe reads
    every micro-batch of the critic's 2 DP ranks (one mini-batch of 32 rows: 16 per rank,
    micro-batch 8: 4 parts, 3 dof), gathered over the critic's DP group."""
    import math

    run = tmp_path / "run"
    sets = ["train.steps=3", "train.eval_every=0", "warm_start.steps=20", "rollout.num_prompts=8",
            "rollout.samples_per_prompt=4", "parallel.micro_batch_size=8", "data.num_train=2000",
            "data.num_val=16", "critic.warmup_steps=1", "algo.mini_batches=1", "critic.parallel.tensor_parallel=1",
            "coordinator.enabled=true", "coordinator.adapt=false", "coordinator.min_prompts=8",
            "train.tensorboard=false", f"train.run_dir={run}"]
    megarl_train("ppo_cpu.yaml", sets)
    steps = [r for r in read_metrics(run) if "critic/value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["coord/probe_s/critic"] > 0 and r["critic/grad_norm"] >= 0
    assert math.isfinite(steps[-1]["coord/g2/critic"]), steps[-1]
    # the estimate from the two critic DP ranks' gradients is a real one (non-zero noise trace)
    assert any(math.isfinite(r["coord/tr_sigma/critic"]) and r["coord/tr_sigma/critic"] > 0 for r in steps)
    assert steps[0]["coord/noise_dof/critic"] == 3.0  # 4 parts: micro-batches of both DP ranks
    assert steps[0]["coord/signal_fraction/critic"] == 1.0  # a value loss has gradient on every row
    # the update's and the forwards' fixed shares are measured (the configured prior is 0.3):
    # each phase runs micro-batches of three models, and its time outside them is a share of it
    for phase in ("train", "logprobs"):
        fracs = {r[f"coord/time_fixed_frac/{phase}"] for r in steps}
        assert len(fracs) == 3 and all(0 < f < 1 for f in fracs), (phase, fracs)
