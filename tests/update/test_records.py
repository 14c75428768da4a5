"""The update phase's pure pieces: how one model's loss terms reduce over updates
(``LossStats``), the rows an update trains on (``UpdateRows``) and which rows each DP rank
trains on (``dp_rows``)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.types import Advantages, LossStats, PolicyEval, PolicyTerms, RolloutBatch, UpdateRows
from megarl.update.rows import dp_rows


def _terms(loss: float, tokens: float, clipped: float, kl: float, ratio_max: float) -> PolicyTerms:
    t = torch.tensor
    return PolicyTerms(
        loss=t(loss), tokens=t(tokens), clipfrac=t(clipped), kl=t(kl), engine_prob_ratio_max=t(ratio_max)
    )


def test_loss_stats_sums_maxima_and_means() -> None:
    s = LossStats()
    s.add(_terms(loss=0.5, tokens=10.0, clipped=2.0, kl=1.0, ratio_max=1.02), 3.0)
    s.add(_terms(loss=0.25, tokens=30.0, clipped=6.0, kl=3.0, ratio_max=1.01), 1.0)
    assert s.updates == 2 and s.tokens == 40.0
    m = s.means()
    assert m["loss"] == pytest.approx(0.375) and m["grad_norm"] == pytest.approx(2.0)
    assert m["clipfrac"] == pytest.approx(8.0 / 40.0) and m["kl"] == pytest.approx(4.0 / 40.0)
    assert m["engine_prob_ratio_max"] == pytest.approx(1.02)  # a maximum, never averaged
    assert set(m) == {"loss", "grad_norm", "clipfrac", "kl", "engine_prob_ratio_max"}


def test_loss_stats_empty_is_finite() -> None:
    m = LossStats().means()
    assert m == {"loss": 0.0, "grad_norm": 0.0} and all(math.isfinite(v) for v in m.values())


def _dims(dp: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(dp=dp, dp_rank=rank)


@pytest.mark.parametrize("shares", [None, [0.5, 0.5], [0.75, 0.25], [0.25, 0.75]])
def test_dp_rows_cover_the_batch_in_whole_micro_batches(shares: list[float] | None) -> None:
    n, mbs = 64, 8
    every = dp_rows(n, mbs, _dims(2, 0), shares)[1]  # type: ignore[arg-type]
    assert every[0].start == 0 and every[-1].stop == n and every[0].stop == every[1].start
    sizes = [sl.stop - sl.start for sl in every]
    assert all(s % mbs == 0 and s >= mbs for s in sizes)
    expected = [32, 32] if shares is None else [round(x * n / mbs) * mbs for x in shares]
    assert sizes == expected
    for rank in range(2):
        assert dp_rows(n, mbs, _dims(2, rank), shares)[0] == every[rank]  # type: ignore[arg-type]


def test_dp_rows_fall_back_to_equal_when_a_share_is_below_one_micro_batch() -> None:
    every = dp_rows(32, 8, _dims(2, 0), [0.99, 0.01])[1]  # type: ignore[arg-type]
    assert [sl.stop - sl.start for sl in every] == [16, 16]


def _present(rows: UpdateRows) -> set[str]:
    return {f.name for f in dataclasses.fields(rows) if getattr(rows, f.name) is not None}


def _rollout(engine: torch.Tensor | None) -> RolloutBatch:
    z = torch.zeros(2)
    return RolloutBatch(
        torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), engine, z, z.long(), z.long(), z.bool(), 0
    )


def test_records_expose_only_present_tensors() -> None:
    t = torch.zeros(2, 3)
    batch = _rollout(None)
    base = {"tokens", "adv", "mask"}
    assert _present(UpdateRows.of(batch, Advantages(adv=t, mask=t), PolicyEval(old_logprobs=t))) == base | {
        "old_logprobs"
    }
    assert _present(
        UpdateRows.of(batch, Advantages(adv=t, mask=t), PolicyEval(old_logprobs=t, ref_logprobs=t, old_values=t))
    ) == base | {"old_logprobs", "ref_logprobs", "old_values"}
    assert _present(UpdateRows.of(batch, Advantages(adv=t, mask=t), PolicyEval())) == base
    assert _present(UpdateRows.of(batch, Advantages(adv=t, mask=t, returns=t), PolicyEval())) == base | {"returns"}
    assert _present(UpdateRows.of(_rollout(t), Advantages(adv=t, mask=t), PolicyEval())) == base | {"engine_logprobs"}


def test_update_rows_cut_every_field_alike() -> None:
    """select picks the same rows of every field (slices and index tensors), narrow cuts only
    per-token fields, and absent fields stay absent."""
    n, S = 4, 5
    tokens = torch.arange(n * S).reshape(n, S)
    rows = UpdateRows(tokens=tokens, mask=tokens.float() / 10, adv=torch.arange(n).float(), returns=tokens.float() * 2)
    part = rows.select(torch.tensor([1, 3]))
    assert part.tokens.tolist() == [tokens[1].tolist(), tokens[3].tolist()] and part.adv.tolist() == [1.0, 3.0]
    assert torch.equal(part.returns, tokens[[1, 3]].float() * 2) and part.old_logprobs is None
    assert rows.select(slice(2, 4)).adv.tolist() == [2.0, 3.0] and rows.select(slice(2, 4)).size == 2
    cut = part.narrow(2)
    assert cut.tokens.tolist() == [[5, 6], [15, 16]] and cut.mask.shape == (2, 2) and cut.adv.tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="old_values"):
        rows.critic_targets()


def test_update_rows_token_budget() -> None:
    """Budget off: today's rows and fixed micro-batches. On: rows balanced over DP by tokens and
    grouped by length — unless a grad probe measures the update, which keeps the plan's
    contiguous DP rows (its noise estimate needs them to be samples of the batch)."""
    from megarl.update.rows import update_rows

    lengths = torch.tensor([30, 4, 5, 28, 6, 29, 7, 3])
    off = update_rows(lengths, 2, 0, _dims(2, 0))  # type: ignore[arg-type]
    assert off == (slice(0, 4), [slice(0, 4), slice(4, 8)], None)
    mine, every, groups = update_rows(lengths, 2, 60, _dims(2, 1))  # type: ignore[arg-type]
    assert [int(lengths[r].sum()) for r in every] == [55, 57]  # contiguous halves: 67 / 45
    assert torch.equal(mine, every[1]) and groups is not None
    assert sorted(int(mine[r]) for g in groups for r in g.rows) == sorted(mine.tolist())
    assert all(g.rows.numel() * g.width <= 60 for g in groups)
    mine, every, groups = update_rows(lengths, 2, 60, _dims(2, 1), probed=True)  # type: ignore[arg-type]
    assert mine == slice(4, 8) and every == [slice(0, 4), slice(4, 8)]
    assert groups is not None and [(g.rows.tolist(), g.width) for g in groups] == [([1], 29), ([0, 2, 3], 7)]


def test_a_probed_update_splits_ranks_at_whole_groups() -> None:
    """Micro-batches of 4, groups of 8, DP shares 0.6 / 0.4 of 32 rows: cut in micro-batches the
    ranks get 20 / 12 rows, and the group of rows 16-23 lies on both (a probe part would split
    it). A probed update cuts the shares in whole probe parts (8 rows: 16 / 16); an unprobed one
    keeps micro-batch granularity (issue #41 D.4)."""
    from megarl.update.rows import update_rows

    lengths = torch.full((32,), 5)
    _, every, _ = update_rows(lengths, 4, 0, _dims(2, 0), [0.6, 0.4])  # type: ignore[arg-type]
    assert every == [slice(0, 20), slice(20, 32)]  # group 16-23 on both ranks
    _, every, _ = update_rows(lengths, 4, 0, _dims(2, 0), [0.6, 0.4], probed=True, part_rows=8)  # type: ignore[arg-type]
    assert every == [slice(0, 16), slice(16, 32)]
    _, every, _ = update_rows(lengths, 4, 0, _dims(2, 0), [0.6, 0.4], probed=True)  # type: ignore[arg-type]
    assert every == [slice(0, 20), slice(20, 32)]  # (part_rows 0: micro-batches, as before)
