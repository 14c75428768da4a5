"""``PolicyUpdater`` (phase 4) on a tiny real Megatron actor and critic, one gloo rank
(``worker_updater.py``, run once for the module): the direction of one update, the number of
optimizer steps of PPO epochs × mini-batches, the critic's warm-up, and the metrics — their
keys in logging order and their values (sums as per-token means, maxima as maxima) against
numbers derived by hand from the batch."""

import json

import pytest
import torch

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/update/worker_updater.py"
LR = 1e-3
CRITIC_KEYS = ["critic/lr", "critic/grad_norm", "critic/value_mean", "critic/value_mse", "critic/value_loss"]
ACTOR_KEYS = ["train/loss", "train/grad_norm", "train/clipfrac"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("updater")
    hf = tiny_hf_model(base / "hf")
    torchrun(WORKER, 1, ["--hf", str(hf), "--out", str(base)])
    return json.loads((base / "result.json").read_text())


def test_one_update_moves_log_probs_with_the_advantage(results: dict) -> None:
    """A = +1 on rows 0–3, −0.5 on rows 4–7: every row's mean log-prob over its response goes
    up or down with its advantage; the loss at ratio 1 is −Σ A·mask / Σ mask."""
    r, mask = results["direction"], torch.tensor(results["mask"])
    delta = (torch.tensor(r["logprobs_after"]) - torch.tensor(r["logprobs_before"])) * mask
    per_row = delta.sum(1) / mask.sum(1)
    assert (per_row[:4] > 1e-3).all() and (per_row[4:] < -1e-3).all(), per_row.tolist()
    m = dict(r["metrics"])
    adv = torch.tensor([1.0] * 4 + [-0.5] * 4)
    expected_loss = float(-(adv[:, None] * mask).sum() / mask.sum())
    assert expected_loss == pytest.approx(-0.25)
    assert m["train/loss"] == pytest.approx(expected_loss, abs=1e-6)
    assert m["train/clipfrac"] == 0.0  # one update: the ratio is exactly 1
    assert m["train/grad_norm"] > 0 and m["train/actor_updated"] == 1.0 and m["train/lr"] == LR
    engine = ["train/engine_logprob_absdiff", "train/engine_prob_ratio_max"]
    assert [k for k, _ in r["metrics"]] == ["train/lr", "train/actor_updated", *ACTOR_KEYS, *engine]
    assert r["actor_steps"] == 1 and r["actor_moved"]


def test_engine_terms_are_a_per_token_mean_and_a_maximum(results: dict) -> None:
    """log π_train − log π_engine is the known shift on every response token: the absolute
    difference is its per-token mean over all micro-batches, the probability ratio its
    maximum exp(shift) (a maximum, never averaged)."""
    m, mask = dict(results["direction"]["metrics"]), torch.tensor(results["mask"], dtype=torch.float64)
    shift = torch.tensor(results["shift"], dtype=torch.float64)
    assert m["train/engine_logprob_absdiff"] == pytest.approx(float((shift.abs() * mask).sum() / mask.sum()), rel=1e-4)
    assert m["train/engine_prob_ratio_max"] == pytest.approx(float(shift[mask.bool()].exp().max()), rel=1e-4)
    assert m["train/engine_prob_ratio_max"] > 1.1


def test_ppo_epochs_times_mini_batches_updates_each_model(results: dict) -> None:
    r = results["counts"]
    assert r["actor_steps"] == 3 * 2 and r["critic_steps"] == 3 * 2
    assert r["actor_moved"] and r["critic_moved"]
    m = dict(r["metrics"])
    assert [k for k, _ in r["metrics"]] == ["train/lr", "train/actor_updated", *ACTOR_KEYS, "train/old_kl_k3", *CRITIC_KEYS]
    assert 0.0 < m["train/clipfrac"] < 1.0  # later epochs move the ratio off 1
    assert 1e-3 < m["train/old_kl_k3"] < 1.0  # and π_θ off π_old: k3 of KL(π_old‖π_θ), ≥ 0 per token (0.19 here)
    assert m["critic/lr"] == LR and m["critic/grad_norm"] > 0 and m["critic/value_loss"] > 0


def test_critic_warm_up_skips_the_actor(results: dict) -> None:
    """Step 0 of critic.warmup_steps = 2: the actor takes no step (no train/* loss terms), the
    critic takes one; its terms at V = V_old: value_mse = Σ (V_old − R)² m / Σ m, value_mean =
    Σ V_old m / Σ m, and the value loss 0.5·(V − R)² (unclipped at V = V_old) is half the mse."""
    r = results["warmup"]
    assert r["actor_steps"] == 0 and not r["actor_moved"]
    assert r["critic_steps"] == 1 and r["critic_moved"]
    assert [k for k, _ in r["metrics"]] == ["train/lr", "train/actor_updated", *CRITIC_KEYS]
    m = dict(r["metrics"])
    assert m["train/actor_updated"] == 0.0
    values, returns, mask = (torch.tensor(r[k], dtype=torch.float64) for k in ("old_values", "returns", "mask"))
    n = mask.sum()
    assert m["critic/value_mse"] == pytest.approx(float(((values - returns) ** 2 * mask).sum() / n), rel=1e-5)
    assert m["critic/value_mean"] == pytest.approx(float((values * mask).sum() / n), rel=1e-5, abs=1e-6)
    assert m["critic/value_loss"] == pytest.approx(0.5 * m["critic/value_mse"], rel=1e-5)
