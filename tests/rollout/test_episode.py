"""Episodes as trained ids (``megarl.rollout.episode``) and their packing: a one-turn episode is
bitwise today's sample; in a multi-turn episode the mask is 1 exactly on the positions that
predict generated ids, and the engine log-probs sit there, turn by turn."""

from __future__ import annotations

import random

import torch

from megarl.data.prompts import PromptRecord
from megarl.rollout.episode import Episode, Turn
from megarl.rollout.sampling import Group, pack_groups

REC = PromptRecord("q", "a", "f:1")


def _episode(rng: random.Random, turns: int) -> Episode:
    ep = Episode([rng.randrange(5, 300) for _ in range(rng.randrange(1, 8))])
    for i in range(turns):
        n = rng.randrange(0, 6)
        obs = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 5))] if i < turns - 1 else []
        ep.turns.append(Turn([rng.randrange(5, 300) for _ in range(n)], [-rng.random() for _ in range(n)], False, obs))
    return ep


def test_one_turn_episode_packs_bitwise_as_a_sample() -> None:
    rng = random.Random(0)
    for _ in range(20):
        eps = [_episode(rng, 1) for _ in range(3)]
        for e in eps[1:]:  # one prompt's samples
            e.prompt_ids = eps[0].prompt_ids
        assert all(e.single_turn() for e in eps)
        plain = Group(REC, eps[0].prompt_ids, [e.sample() for e in eps], ["t"] * 3, [1.0, 0.0, 0.5])
        marked = Group(REC, eps[0].prompt_ids, [e.sample() for e in eps], ["t"] * 3, [1.0, 0.0, 0.5])
        marked.episodes = eps
        a, b = pack_groups([plain], 0, 1), pack_groups([marked], 0, 1)
        for name in ("tokens", "mask", "engine_logprobs", "response_lens", "truncated"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_multi_turn_mask_and_logprobs_follow_the_generated_ids() -> None:
    rng = random.Random(1)
    for _ in range(30):
        g = Group(REC, [1, 2, 3], [], [], [])
        eps = []
        for _ in range(rng.randrange(1, 4)):
            ep = _episode(rng, rng.randrange(1, 4))
            ep.prompt_ids = g.prompt_ids
            eps.append(ep)
        g.samples, g.texts, g.rewards = [e.sample() for e in eps], ["t"] * len(eps), [0.0] * len(eps)
        g.episodes = eps
        batch = pack_groups([g], 0, 1)
        for b, ep in enumerate(eps):
            # the obvious reference, turn by turn: each generated id's position is where the model predicts it
            tokens, mask, lp = list(ep.prompt_ids), {}, {}
            for t in ep.turns:
                for x, logp in zip(t.ids, t.logprobs, strict=True):
                    mask[len(tokens) - 1], lp[len(tokens) - 1] = 1.0, logp
                    tokens.append(x)
                tokens.extend(t.observation)
            assert batch.tokens[b, : len(tokens)].tolist() == tokens == ep.context()
            got = {i: 1.0 for i in torch.nonzero(batch.mask[b]).flatten().tolist()}
            assert got == mask and float(batch.mask[b].sum()) == ep.generated()
            assert batch.engine_logprobs is not None
            assert {i: float(batch.engine_logprobs[b, i]) for i in mask} == pytest_approx(lp)
            assert float(batch.engine_logprobs[b][batch.mask[b] == 0].abs().sum()) == 0.0


def pytest_approx(d: dict[int, float]) -> dict[int, float]:
    """Engine log-probs travel as float32."""
    return {k: float(torch.tensor(v, dtype=torch.float32)) for k, v in d.items()}


def test_step_rewards_sit_at_their_turn_and_rows_sum_to_the_reward() -> None:
    """turn_rewards: each step reward at its turn's last generated id, the rest (the final
    answer's score) at the episode's last generated id; a failed episode's reward all at its
    end; single-turn batches carry none (their reward sits at the last token, as before)."""
    ep = Episode([1, 2], [Turn([5, 6], [-0.1, -0.2], False, [9]), Turn([7], [-0.3], False, [8, 8]), Turn([4, 3], [-0.1, -0.1])])
    ep.rewards = [0.25, 0.5, 0.0]
    failed = Episode([1, 2], [Turn([5], [-0.1], False, [9]), Turn([6], [-0.2])], rewards=[0.25], failed=True)
    g = Group(REC, [1, 2], [ep.sample(), failed.sample()], ["t", "t"], [1.75, -1.0], episodes=[ep, failed])
    batch = pack_groups([g], 0, 1)
    assert batch.turn_rewards is not None
    # response ids: 5 6 | 9 | 7 | 8 8 | 4 3 → turn ends at response positions 1, 3, 7; column = prompt_len - 1 + j
    want = torch.zeros(2, batch.tokens.shape[1])
    want[0, 1 + 1], want[0, 1 + 3], want[0, 1 + 7] = 0.25, 0.5, 1.75 - 0.25 - 0.5
    want[1, 1 + 2] = -1.0  # failed: its environment's reward does not count; all at its last generated id
    assert torch.allclose(batch.turn_rewards, want)
    assert torch.allclose(batch.turn_rewards.sum(dim=1), batch.rewards)
    assert float((batch.turn_rewards * (1 - batch.mask)).abs().sum()) == 0.0  # only where the mask is 1
    plain = Group(REC, [1, 2], [([5, 6], [-0.1, -0.2], False)], ["t"], [1.0])
    assert pack_groups([plain], 0, 1).turn_rewards is None
