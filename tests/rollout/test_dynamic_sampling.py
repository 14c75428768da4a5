"""DAPO dynamic sampling in the collector (``RolloutCollector.collect``), one process: groups whose
rewards are all equal are dropped and refilled with fresh prompts, round after round, up to
``algo.max_sampling_rounds``; when the rounds run out the batch is filled with the dropped
groups (zero advantage) and the shortfall counted.

The fleet and the reward function are stand-ins that isolate the refill rule: prompt ``i`` of
the data yields rewards with signal (one right answer of two) when ``i`` is even and without
(both wrong) when it is odd, so every round's outcome is known in advance. The real fleet and
rewards are driven by the end-to-end runs (tests/e2e/test_grpo_cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megarl.config import load_config
from megarl.data.prompts import PromptRecord
from megarl.rollout.collector import RewardReport, RolloutCollector
from megarl.rollout.sampling import CollectSettings
from tests.helpers import one_rank_group

SAMPLES = 2


_one_rank = pytest.fixture(scope="module", autouse=True)(
    one_rank_group
)  # ``collect`` broadcasts rank 0's counts and batch: a one-rank gloo group.


@dataclass
class _Dims:
    is_rank0: bool = True


class _Tok:
    """Prompt i is the one token [i + 10]; response token 1 decodes to "right", 2 to "wrong"."""

    pad_id = 0
    eos_ids = [3]

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        return [int(rec.where.split(":")[1]) + 10]

    def decode_many(self, ids: list[list[int]]) -> list[str]:
        return ["right" if x[0] == 1 else "wrong" for x in ids]


class _Fleet:
    """Answers prompt i with ("right", "wrong") for even i, ("wrong", "wrong") for odd i."""

    restarts = reissued_prompts = 0

    def __init__(self) -> None:
        self.rounds: list[list[int]] = []  # the prompt indices each generate call was given

    def generate(self, prompts: list[list[int]], n: int, **kw: object) -> tuple[list[list[dict]], int]:
        assert n == SAMPLES
        self.rounds.append([p[0] - 10 for p in prompts])
        outs = []
        for p in prompts:
            first = 1 if (p[0] - 10) % 2 == 0 else 2
            outs.append([{"token_ids": [t, 3], "logprobs": [-0.5, -0.1], "finish_reason": "stop"} for t in (first, 2)])
        return outs, 1

    def ready(self) -> float:
        return 0.0

    def serving(self) -> list[int]:
        return [0]

    def pop_timings(self) -> dict[str, float]:
        return {}


class _Rewards:
    def score(self, samples: list) -> tuple[list[float], RewardReport]:
        return [1.0 if s.response == "right" else 0.0 for s in samples], RewardReport(samples=len(samples))


def _collector(rounds: int, dynamic: bool = True) -> tuple[RolloutCollector, _Fleet]:
    cfg = load_config(
        None,
        [
            f"algo.dynamic_sampling={str(dynamic).lower()}",
            f"algo.max_sampling_rounds={rounds}",
            "data.shuffle=false",
            "rollout.max_prompt_len=4",
        ],
    )
    rows = [PromptRecord(f"q{i}", "right", f"rows:{i}") for i in range(40)]
    fleet = _Fleet()
    col = RolloutCollector(CollectSettings.of(cfg), _Dims(), _Tok(), fleet, rows, rows[:2], _Rewards())  # type: ignore[arg-type]
    return col, fleet


def _group_prompts(batch) -> list[int]:
    """The prompt index of each kept group, in batch order (one row per sample)."""
    first = batch.tokens[::SAMPLES, 0]
    return [int(t) - 10 for t in first]


def test_groups_without_signal_are_refilled_with_fresh_prompts() -> None:
    col, fleet = _collector(rounds=4)
    batch, m = col.collect(0, 4, SAMPLES)
    # round 1: prompts 0-3 keep 0, 2; round 2: the next two (4, 5) keep 4; round 3: one (6) keeps it
    assert fleet.rounds == [[0, 1, 2, 3], [4, 5], [6]]
    assert _group_prompts(batch) == [0, 2, 4, 6]
    assert m["rollout/sampling_rounds"] == 3.0
    assert m["rollout/dropped_groups"] == 3.0  # prompts 1, 3, 5
    assert m["rollout/filled_without_signal"] == 0.0
    assert batch.size == 4 * SAMPLES
    assert torch.equal(batch.rewards, torch.tensor([1.0, 0.0] * 4))
    # the sampler moved past every prompt taken: the next step starts at prompt 7 (no signal), then 8
    col.collect(1, 1, SAMPLES)
    assert fleet.rounds[3:] == [[7], [8]]


def test_rounds_running_out_fill_the_batch_with_dropped_groups() -> None:
    col, fleet = _collector(rounds=2)
    batch, m = col.collect(0, 4, SAMPLES)
    # round 1 keeps 0, 2 of 0-3; round 2 keeps 4 of (4, 5); one group short: the first dropped one (1)
    assert fleet.rounds == [[0, 1, 2, 3], [4, 5]]
    assert _group_prompts(batch) == [0, 2, 4, 1]
    assert m["rollout/sampling_rounds"] == 2.0
    assert m["rollout/filled_without_signal"] == 1.0
    assert m["rollout/dropped_groups"] == 3.0
    assert torch.equal(batch.rewards, torch.tensor([1.0, 0.0] * 3 + [0.0, 0.0]))


def test_without_dynamic_sampling_one_round_keeps_every_group() -> None:
    col, fleet = _collector(rounds=4, dynamic=False)
    batch, m = col.collect(0, 4, SAMPLES)
    assert fleet.rounds == [[0, 1, 2, 3]]
    assert _group_prompts(batch) == [0, 1, 2, 3]
    assert (m["rollout/sampling_rounds"], m["rollout/dropped_groups"], m["rollout/filled_without_signal"]) == (
        1.0,
        0.0,
        0.0,
    )
