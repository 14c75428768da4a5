"""The update phase's pure pieces: how one model's loss statistics reduce over updates
(``LossStats``) and which rows each DP rank trains on (``dp_rows``)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megarl.types import Advantages, LossStats, PolicyEval
from megarl.update.rows import dp_rows


def test_loss_stats_sums_maxima_and_means() -> None:
    s = LossStats()
    s.add({"loss": 0.5, "tokens": 10.0, "clipfrac_sum": 2.0, "kl_sum": 1.0, "engine_prob_ratio_max": 1.02}, 3.0)
    s.add({"loss": 0.25, "tokens": 30.0, "clipfrac_sum": 6.0, "kl_sum": 3.0, "engine_prob_ratio_max": 1.01}, 1.0)
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


def test_records_expose_only_present_tensors() -> None:
    t = torch.zeros(2, 3)
    assert set(PolicyEval(old_logprobs=t).rows()) == {"old_logprobs"}
    assert set(PolicyEval(old_logprobs=t, ref_logprobs=t, old_values=t).rows()) == {
        "old_logprobs", "ref_logprobs", "old_values"}
    assert set(Advantages(adv=t, mask=t).rows()) == {"adv", "mask"}
    assert set(Advantages(adv=t, mask=t, returns=t).rows()) == {"adv", "mask", "returns"}


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
