"""The engines' NaN/Inf check on incoming weights (``staging.all_finite``): a float64 sum, which
must flag exactly the tensors ``isfinite().all()`` flags, including cases a sum could hide."""

import pytest
import torch

from megarl.engine.staging import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    cases = {
        "normal": torch.randn(1000),
        "nan": torch.tensor([0.0, float("nan"), 1.0]),
        "+inf": torch.tensor([1.0, float("inf")]),
        "-inf": torch.tensor([float("-inf"), 2.0]),
        "+inf and -inf (sum would be nan, not inf)": torch.tensor([float("inf"), float("-inf")]),
        "nan among large finite": torch.tensor([big, float("nan"), -big]),
        "the dtype's max, many times (no overflow in float64)": torch.full((100_000,), big),
        "max and -max": torch.tensor([big, -big] * 1000),
        "empty": torch.zeros(0),
    }
    for what, t in cases.items():
        t = t.to(dtype)
        assert all_finite(t) == bool(t.isfinite().all()), what
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=dtype))
    assert all_finite(torch.full((100_000,), big, dtype=dtype))
