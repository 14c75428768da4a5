"""KL as a reward penalty (``algo.kl_mode: reward``) acts on every advantage estimator.

The bug this guards: the trainer built per-token ``r_t - β·KL_t`` but the outcome
estimators (grpo, drgrpo, rloo, reinforce_pp_baseline) read only the sequence rewards, so
no KL acted anywhere. Here the trainer's own advantage phase (``rollout_advantages``) runs
on a hand-built batch and every estimator's advantages are checked against numbers derived
by hand from the penalised rewards.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from megarl import algo
from megarl.algo.advantages import compute_advantages, kl_penalized_rewards
from megarl.config import AlgoConfig
from megarl.types import Advantages, PolicyEval, RolloutBatch
from megarl.update.advantages import rollout_advantages

BETA = 0.5
GARBAGE = 9.0  # log-prob difference outside the mask: must never reach a reward

# Four responses, two prompts (groups [0, 0, 1, 1]); position t=0 is the prompt.
MASK = torch.tensor(
    [
        [0, 1, 1, 0],
        [0, 1, 0, 0],
        [0, 1, 1, 1],
        [0, 1, 1, 0],
    ],
    dtype=torch.float32,
)
# k1 KL per token = old - ref logprob; row sums over the mask: 0.6, 1.0, 0.4, 0.8
KL = torch.tensor(
    [
        [GARBAGE, 0.2, 0.4, GARBAGE],
        [GARBAGE, 1.0, GARBAGE, GARBAGE],
        [GARBAGE, 0.1, 0.1, 0.2],
        [GARBAGE, 0.3, 0.5, GARBAGE],
    ]
)
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])
# r - β Σ_t KL_t, by hand: 1 - 0.3, 0 - 0.5, 1 - 0.2, 1 - 0.4
SEQ_PENALISED = [0.7, -0.5, 0.8, 0.6]
# Returns-to-go (γ = 1) of the penalised token rewards [t last]·r - β·KL_t, by hand:
# row 0: tokens -0.1, 0.8 → 0.7, 0.8;  row 1: -0.5;  row 2: -0.05, -0.05, 0.9 → 0.8, 0.85, 0.9;
# row 3: -0.15, 0.75 → 0.6, 0.75
RTG_PENALISED = [[0.0, 0.7, 0.8, 0], [0, -0.5, 0, 0], [0, 0.8, 0.85, 0.9], [0, 0.6, 0.75, 0]]
RTG_PLAIN = [[0.0, 1, 1, 0], [0.0, 0, 0, 0], [0.0, 1, 1, 1], [0.0, 1, 1, 0]]


def _batch(truncated: list[bool] | None = None) -> RolloutBatch:
    b, s = MASK.shape
    return RolloutBatch(
        tokens=torch.zeros(b, s, dtype=torch.long),
        mask=MASK.clone(),
        engine_logprobs=torch.zeros(b, s),
        rewards=REWARDS.clone(),
        group_ids=GROUPS.clone(),
        response_lens=MASK.sum(1).long(),
        truncated=torch.tensor(truncated or [False] * b),
        version=0,
    )


def _run(
    advantage: str, beta: float, **algo_overrides: object
) -> tuple[torch.Tensor, Advantages, dict[str, float], float]:
    cfg = AlgoConfig(
        advantage=advantage,
        kl_mode="reward",
        kl_coef=beta,
        kl_estimator="k1",
        gamma=1.0,
        lam=1.0,
        whiten_advantages=False,
        **algo_overrides,  # type: ignore[arg-type]
    )
    ctl = algo.make_kl_controller(cfg.kl_controller, kl_coef=beta, target_kl=cfg.kl_target, horizon=int(cfg.kl_horizon))
    lps = {"old_logprobs": KL.clone(), "ref_logprobs": torch.zeros_like(KL)}
    if advantage == "gae":
        lps["old_values"] = torch.zeros_like(KL)
    adv, stats = rollout_advantages(cfg, ctl, _batch(), PolicyEval(**lps))
    return adv.adv, adv, stats, ctl.value


def _per_seq(adv: list[float]) -> list[list[float]]:
    return [[a * float(m) for m in MASK[i]] for i, a in enumerate(adv)]


def _group_mean(seq: list[float]) -> list[float]:
    return [(seq[0] + seq[1]) / 2] * 2 + [(seq[2] + seq[3]) / 2] * 2


def _whiten(x: list[list[float]]) -> list[list[float]]:
    vals = [x[i][t] for i in range(4) for t in range(4) if MASK[i, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals) + 1e-8)
    return [[(x[i][t] - mean) / std if MASK[i, t] else 0.0 for t in range(4)] for i in range(4)]


def _expected(name: str, seq: list[float], rtg: list[list[float]]) -> list[list[float]]:
    """Each estimator's formula written out on the hand-derived rewards (groups of two)."""
    mean = _group_mean(seq)
    centred = [r - m for r, m in zip(seq, mean, strict=True)]
    if name == "drgrpo":
        return _per_seq(centred)
    if name == "grpo":  # unbiased std of a pair: |a - b| / √2
        std = [abs(seq[0] - seq[1]) / math.sqrt(2)] * 2 + [abs(seq[2] - seq[3]) / math.sqrt(2)] * 2
        return _per_seq([c / (s + 1e-6) for c, s in zip(centred, std, strict=True)])
    if name == "rloo":  # leave-one-out of a pair: r_i - r_other
        return _per_seq([seq[0] - seq[1], seq[1] - seq[0], seq[2] - seq[3], seq[3] - seq[2]])
    if name == "reinforce_pp_baseline":
        return _whiten(_per_seq(centred))
    if name == "reinforce_pp":
        return _whiten(rtg)
    assert name == "gae"  # V = 0, γ = λ = 1, no whitening: A_t = return-to-go
    return rtg


@pytest.mark.parametrize("name", sorted(algo.ADVANTAGE_ESTIMATORS))
def test_kl_in_reward_changes_every_estimator(name: str) -> None:
    """β = 0.5 gives the advantages of the penalised rewards, β = 0 those of the plain ones."""
    adv, out, stats, _ = _run(name, BETA)
    torch.testing.assert_close(adv, torch.tensor(_expected(name, SEQ_PENALISED, RTG_PENALISED)), atol=1e-5, rtol=1e-5)
    plain, _, _, _ = _run(name, 0.0)
    torch.testing.assert_close(plain, torch.tensor(_expected(name, REWARDS.tolist(), RTG_PLAIN)), atol=1e-5, rtol=1e-5)
    assert (adv - plain).abs().max() > 0.05, f"{name}: the KL penalty did not change the advantages"
    # the logged KL is the per-token mean over the mask: (0.6 + 1.0 + 0.4 + 0.8) / 8 tokens
    assert stats["train/kl_reward"] == pytest.approx(0.35)
    assert stats["train/kl_coef"] == BETA
    if name == "gae":  # critic targets are the penalised returns (V = 0)
        torch.testing.assert_close(out.returns, torch.tensor(RTG_PENALISED), atol=1e-6, rtol=1e-6)


def test_adaptive_controller_sees_the_kl_that_acts() -> None:
    """The adaptive β moves from the same per-token KL that was charged (0.35 < target 1 → β shrinks)."""
    _, _, stats, beta_after = _run("grpo", BETA, kl_controller="adaptive", kl_target=1.0, kl_horizon=40.0)
    assert stats["train/kl_coef"] == BETA
    assert beta_after == pytest.approx(BETA * (1 - 0.2 * 4 / 40))


def test_overlong_filtered_rows_keep_their_outcome_reward() -> None:
    """A masked-out (truncated) response pays no KL and keeps r in its group's baseline."""
    cfg = AlgoConfig(advantage="drgrpo", kl_mode="reward", kl_coef=BETA, kl_estimator="k1", overlong_filter=True)
    lps = {"old_logprobs": KL.clone(), "ref_logprobs": torch.zeros_like(KL)}
    adv, _ = rollout_advantages(
        cfg, algo.make_kl_controller("fixed", kl_coef=BETA), _batch([False, True] + [False] * 2), PolicyEval(**lps)
    )
    # group 0 sequence rewards: 0.7 and 0 (row 1 truncated: no tokens, no KL) → mean 0.35
    assert adv.adv[0, 1].item() == pytest.approx(0.7 - 0.35)
    assert adv.mask[1].sum() == 0 and adv.adv[1].abs().sum() == 0


# --------------------------------------------------------------- the equivalence, pure


def test_kl_penalized_rewards_by_hand() -> None:
    seq, tok = kl_penalized_rewards(REWARDS, KL, MASK, coef=BETA)
    torch.testing.assert_close(seq, torch.tensor(SEQ_PENALISED))
    expect_tok = torch.tensor(
        [[0, -0.1, 0.8, 0], [0, -0.5, 0, 0], [0, -0.05, -0.05, 0.9], [0, -0.15, 0.75, 0]], dtype=torch.float32
    )
    torch.testing.assert_close(tok, expect_tok)
    torch.testing.assert_close(tok.sum(dim=1), seq)  # the documented equivalence
    empty = torch.zeros(1, 3)
    s1, t1 = kl_penalized_rewards(torch.tensor([2.0]), torch.ones(1, 3), empty, coef=BETA)
    assert s1.item() == 2.0 and t1.abs().sum() == 0  # no tokens: no KL to pay


def _verl_outcome(name: str, token_level_rewards: torch.Tensor, index: list[int]) -> list[float]:
    """verl's convention written as a loop: score = token_level_rewards.sum(-1), then the group formula."""
    scores = [float(x) for x in token_level_rewards.sum(dim=-1)]
    groups: dict[int, list[float]] = defaultdict(list)
    for s, g in zip(scores, index, strict=True):
        groups[g].append(s)
    out = []
    for s, g in zip(scores, index, strict=True):
        xs, n = groups[g], len(groups[g])
        mean = sum(xs) / n
        if name == "rloo":
            out.append(s - (sum(xs) - s) / (n - 1))
        elif name == "drgrpo":
            out.append(s - mean)
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
            out.append((s - mean) / (std + 1e-6))
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"])
def test_outcome_estimators_read_the_sum_of_token_rewards(name: str, seed: int) -> None:
    """token_rewards alone ≡ rewards = their sum ≡ both from kl_penalized_rewards ≡ verl's loop."""
    g = torch.Generator().manual_seed(seed)
    b, t = 12, 7
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (b,), generator=g).to(torch.float64)
    kl = torch.rand(b, t, generator=g, dtype=torch.float64)
    gid = torch.arange(b) // 4
    seq, tok = kl_penalized_rewards(rewards, kl, mask, coef=0.3)
    from_tokens = compute_advantages(name, mask=mask, token_rewards=tok, group_ids=gid).advantages
    from_seq = compute_advantages(name, mask=mask, rewards=seq, group_ids=gid).advantages
    from_both = compute_advantages(name, mask=mask, rewards=seq, token_rewards=tok, group_ids=gid).advantages
    torch.testing.assert_close(from_tokens, from_seq)
    torch.testing.assert_close(from_both, from_seq)
    verl_seq = torch.tensor(_verl_outcome("drgrpo" if name == "reinforce_pp_baseline" else name, tok, gid.tolist()))
    verl = algo.sequence_to_token(verl_seq.to(torch.float64), mask)
    if name == "reinforce_pp_baseline":  # verl: masked_whiten of the broadcast drgrpo score
        verl = algo.masked_whiten(verl, mask)
    torch.testing.assert_close(from_seq, verl)
    unpenalised = compute_advantages(name, mask=mask, rewards=rewards, group_ids=gid).advantages
    assert (from_seq - unpenalised).abs().max() > 1e-3


def test_disagreeing_rewards_are_refused() -> None:
    """A penalty in the token rewards only (the old trainer's input) is an error, not a no-op."""
    tok = algo.sequence_to_last_token(REWARDS, MASK) - BETA * KL * MASK
    with pytest.raises(ValueError, match=r"'grpo': rewards and token_rewards disagree on 4 row\(s\), first row 0: "):
        compute_advantages("grpo", mask=MASK, rewards=REWARDS, token_rewards=tok, group_ids=GROUPS)


def test_float32_rounding_of_a_cancelling_sum_is_not_a_disagreement() -> None:
    """Long responses: r ≈ β Σ KL, so the sequence reward is ~0 while the summands are large."""
    g = torch.Generator().manual_seed(0)
    kl = torch.rand(4, 4000, generator=g) * 3.0
    mask = torch.ones(4, 4000)
    rewards = (0.7 * kl.to(torch.float64).sum(dim=1)).to(torch.float32) + torch.tensor([0.0, 1e-3, -1e-3, 0.0])
    seq, tok = kl_penalized_rewards(rewards, kl, mask, coef=0.7)
    assert seq.abs().max() < 0.01 < tok.abs().sum(dim=1).min()
    adv = compute_advantages(
        "drgrpo", mask=mask, rewards=seq, token_rewards=tok, group_ids=torch.zeros(4, dtype=torch.long)
    )
    torch.testing.assert_close(adv.advantages[:, 0], seq - seq.mean())
