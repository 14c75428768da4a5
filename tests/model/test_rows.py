"""``megarl.model.rows``: a typed row record and a dict of the same tensors are cut into the
same micro-batches (fixed rows, and token-budget groups cut to their width)."""

import pytest
import torch

from megarl.model.microbatch import MicroBatch
from megarl.model.rows import micro_batches, select_rows, take_rows, tokens_of
from megarl.types import UpdateRows

N, S = 6, 5


def _both() -> tuple[UpdateRows, dict[str, torch.Tensor]]:
    tokens = torch.arange(N * S).reshape(N, S)
    mask = (tokens % 3 > 0).float()
    adv = torch.linspace(-1, 1, N)  # per-row
    rec = UpdateRows(tokens=tokens, mask=mask, adv=adv)
    return rec, {"tokens": tokens, "mask": mask, "adv": adv}


def _same(rec: UpdateRows, d: dict[str, torch.Tensor]) -> None:
    assert torch.equal(rec.tokens, d["tokens"]) and torch.equal(rec.mask, d["mask"]) and torch.equal(rec.adv, d["adv"])


def test_fixed_micro_batches_agree() -> None:
    rec, d = _both()
    recs, dicts = micro_batches(rec, 2), micro_batches(d, 2)
    assert len(recs) == len(dicts) == 3 and all(isinstance(r, UpdateRows) for r in recs)
    for r, x in zip(recs, dicts, strict=True):
        _same(r, x)
    assert tokens_of(recs[1]).tolist() == [list(range(10, 15)), list(range(15, 20))]
    with pytest.raises(ValueError, match="not divisible by micro_batch_size=4"):
        micro_batches(rec, 4)


def test_token_budget_groups_agree() -> None:
    rec, d = _both()
    mb = MicroBatch(torch.tensor([0, 3, 4]), width=3)
    r, x = take_rows(rec, mb), take_rows(d, mb)
    _same(r, x)
    assert r.tokens.shape == (3, 3) and r.adv.tolist() == rec.adv[[0, 3, 4]].tolist()  # per-row kept whole
    _same(select_rows(rec, slice(1, 3)), select_rows(d, slice(1, 3)))
