"""`parallel.max_tokens_per_micro_batch` through `megarl train`: the same seeded PPO run (actor
TP2, critic TP1 × DP2 on its own layout, reference KL, 2 epochs × 2 mini-batches) with fixed-row
and with token-budget micro-batches (padded, and packed padding-free: `parallel.pack_sequences`)
sees the same first-step batch and computes the same forward-only passes (old/reference
log-probs, values) and updates to fp32 round-off."""

from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import megarl_train

SETS = [
    "train.steps=1",
    "train.eval_every=0",
    "warm_start.steps=120",  # rewards > 0 at step 1 (3 of 32 correct: a signal to compare)
    "warm_start.batch_size=32",
    "rollout.num_prompts=8",
    "rollout.samples_per_prompt=4",
    "parallel.micro_batch_size=8",
    "data.num_train=2000",
    "data.num_val=16",
    "critic.warmup_steps=0",
    "critic.parallel.tensor_parallel=1",
    "train.tensorboard=false",
    # Adam's epsilon well above fp32 gradient noise (as in tests/model/worker_parity.py): a
    # mini-batch without reward signal has returns of exactly 0 in one path and ~1e-8 in another
    # (the actor and its frozen reference agree to round-off, so the KL reward is 0 or ~1e-10),
    # and with eps=1e-8 Adam's first step is ~lr·sign(g) for such a gradient — an lr-sized
    # update from a round-off difference, not a difference between the paths
    "optim.adam_eps=1e-4",
]
COMPARED = [
    "train/loss",
    "train/grad_norm",
    "train/kl_reward",
    "critic/value_loss",
    "critic/grad_norm",
    "train/engine_logprob_absdiff",
    "train/clipfrac",
    "rollout/mismatch_abs_logp_mean",
]


VARIANTS = {  # 36 = two whole rows of 12 + 6 tokens
    "fixed": ["parallel.max_tokens_per_micro_batch=0"],
    "budget": ["parallel.max_tokens_per_micro_batch=36"],
    "packed": ["parallel.max_tokens_per_micro_batch=36", "parallel.pack_sequences=true"],  # padding-free
}


def test_token_budget_step_equals_fixed_rows(tmp_path: Path) -> None:
    steps = {}
    for name, sets in VARIANTS.items():
        run = tmp_path / name
        megarl_train("ppo_cpu.yaml", [*SETS, *sets, f"train.run_dir={run}"])
        (steps[name],) = [r for r in read_metrics(run) if "critic/value_loss" in r]
    a = steps["fixed"]
    assert a["rollout/reward_mean"] > 0 and a["train/grad_norm"] > 0 and a["critic/grad_norm"] > 0
    for name in ("budget", "packed"):
        b = steps[name]
        for k in ("rollout/prompt_fingerprint", "rollout/tokens", "rollout/reward_mean"):  # the same batch
            assert a[k] == b[k], (name, k)
        for k in COMPARED:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (name, k, a[k], b[k])
