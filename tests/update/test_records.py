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
