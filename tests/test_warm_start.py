"""The warm start's exact count (``megarl.warm_start.exact_rows``, what ``warm_start.stop_at_exact``
stops on): a row counts when every learned id is the model's top choice; rows with nothing
learned do not count."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megarl.warm_start import exact_rows
from tests.helpers import one_rank_group

_one_rank = pytest.fixture(scope="module", autouse=True)(
    one_rank_group
)  # The argmax is vocab-parallel (all-reduces over the TP group): a one-rank gloo group.


@dataclass
class _Dims:
    tp_rank: int = 0
    tp_group: Any = None  # the default (one-rank) group


def _logits(top: list[list[int]], vocab: int = 6) -> torch.Tensor:
    """(B, S, vocab) logits whose argmax is ``top`` (B, S), the runner-up 1 below it."""
    t = torch.tensor(top)
    logits = torch.zeros(*t.shape, vocab)
    logits.scatter_(-1, t[..., None], 2.0)
    logits.scatter_(-1, ((t + 1) % vocab)[..., None], 1.0)
    return logits


def test_exact_rows_counts_rows_with_every_learned_id_on_top() -> None:
    top = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    labels = torch.tensor([
        [1, 2, 3, 4],  # all right
        [5, 2, 3, 5],  # wrong only where not learned
        [1, 2, 0, 4],  # one learned id wrong (the runner-up would not do)
        [5, 5, 5, 5],  # nothing learned: not counted
        [1, 2, 3, 0],  # wrong at the last learned id
    ])  # fmt: skip
    mask = torch.tensor([
        [0, 1, 1, 1],
        [0, 1, 1, 0],
        [0, 1, 1, 1],
        [0, 0, 0, 0],
        [1, 1, 1, 1],
    ], dtype=torch.float32)  # fmt: skip
    assert int(exact_rows(_logits(top), labels, mask, _Dims())) == 2  # type: ignore[arg-type]
    assert int(exact_rows(_logits(top), labels, torch.zeros_like(mask), _Dims())) == 0  # type: ignore[arg-type]


def test_exact_rows_ties_go_to_the_lowest_id() -> None:
    logits = torch.zeros(1, 2, 4)  # every id tied: the top choice is id 0, as greedy decoding's
    mask = torch.ones(1, 2)
    assert int(exact_rows(logits, torch.tensor([[0, 0]]), mask, _Dims())) == 1  # type: ignore[arg-type]
    assert int(exact_rows(logits, torch.tensor([[0, 1]]), mask, _Dims())) == 0  # type: ignore[arg-type]
