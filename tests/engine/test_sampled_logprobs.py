"""The engine reads sampled-token log-probs from vLLM's FlatLogprobs (``flat_logprobs=True``)
as one list, and falls back to the per-position lookup for any other layout; both give the
log-prob of the sampled token at every position."""

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from megarl.engine.vllm_engine import sampled_logprobs


def _flat(entries: list[dict[int, float]]) -> FlatLogprobs:
    flat = FlatLogprobs()
    for e in entries:
        flat.append({t: Logprob(lp, rank=1) for t, lp in e.items()})
    return flat


def test_flat_one_entry_per_position_is_read_as_a_list() -> None:
    tokens = [5, 9, 2]
    assert sampled_logprobs(_flat([{5: -0.5}, {9: -1.25}, {2: -3.0}]), tokens) == [-0.5, -1.25, -3.0]


def test_positions_with_several_entries_pick_the_sampled_token() -> None:
    tokens = [5, 9]
    entries = [{7: -0.1, 5: -2.5}, {9: -0.75, 1: -4.0}]  # top-k beside the sampled token, any order
    assert sampled_logprobs(_flat(entries), tokens) == [-2.5, -0.75]
    as_dicts = [{t: Logprob(lp) for t, lp in e.items()} for e in entries]
    assert sampled_logprobs(as_dicts, tokens) == [-2.5, -0.75]


def test_flat_entries_of_other_tokens_are_not_taken_for_the_sampled_ones() -> None:
    # one entry per position, but not the sampled token's: a lookup, which fails loudly
    with pytest.raises(KeyError):
        sampled_logprobs(_flat([{5: -0.5}, {8: -1.0}]), [5, 9])


def test_no_logprobs_gives_an_empty_list() -> None:
    assert sampled_logprobs(None, [1, 2]) == []
    assert sampled_logprobs(FlatLogprobs(), []) == []
