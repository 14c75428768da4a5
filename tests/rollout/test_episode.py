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
