"""Sampling seeds (:mod:`megarl.rollout.seeds`): ``round`` is the formula of every earlier run,
``prompt`` depends on (train.seed, stream position) only. That the engines then sample alike is
tests/fleet/test_fleet.py::test_prompt_keyed_seeds_couple_runs_of_different_batch_sizes."""

from megarl.data.prompts import PromptSampler
from megarl.rollout.seeds import POSITION_SEED_BITS, prompt_seeds


def test_round_seeds_are_the_earlier_formula() -> None:
    assert prompt_seeds("round", 1234, 3, 2, [40, 41, 99]) == [(1234 + 7919 * 3 + 2) * 100_003 + i for i in range(3)]


def test_prompt_seeds_depend_on_the_seed_and_position_only() -> None:
    a = prompt_seeds("prompt", 7, 0, 1, [0, 1, 2, 3, 4, 5, 6, 7])
    assert prompt_seeds("prompt", 7, 5, 3, [4, 5, 6, 7]) == a[4:]  # another step and round
    assert len(set(a)) == 8 and all(0 <= s < 2**POSITION_SEED_BITS for s in a)
    assert min(abs(x - y) for x in a for y in a if x != y) > 1_000  # sample seeds s + j do not meet
    assert set(prompt_seeds("prompt", 8, 0, 1, list(range(8)))).isdisjoint(a)


def test_the_sampler_counts_draws_over_epochs() -> None:
    s = PromptSampler(5, 0)
    s.next(3)
    assert s.drawn == 3
    s.next(4)  # across the epoch boundary
    assert s.drawn == 7 and (s.epoch, s.pos) == (1, 2)


def test_a_resumed_sampler_continues_the_stream_positions() -> None:
    """Exact resume: the positions (and so the ``prompt`` seeds) come from the checkpointed
    (epoch, pos), so a resumed run seeds its next prompts as the uninterrupted one does."""
    whole = PromptSampler(5, 3)
    whole.next(4)
    at, idx = whole.drawn, whole.next(4)
    first = PromptSampler(5, 3)
    first.next(4)
    resumed = PromptSampler(5, 3)
    resumed.load_state_dict(first.state_dict())
    assert (resumed.drawn, resumed.next(4)) == (at, idx) == (4, idx)
