"""An HF folder's tensors against the ones its config.json implies: a missing, unexpected or
misshapen tensor is refused by name (pure; the end-to-end checks are in test_convert.py)."""

import pytest

from megarl.checkpoint.hf_config import check_hf_tensors
from megarl.errors import UnsupportedHFModel


def test_tensor_check() -> None:
    expected = {"a": [2, 3], "b": [4]}
    check_hf_tensors(expected, {"a": [2, 3], "b": [4], "x.rotary_emb.inv_freq": [8]}, tied=False, where="m")
    check_hf_tensors(expected, {"a": [2, 3], "b": [4], "lm_head.weight": [9, 9]}, tied=True, where="m")
    with pytest.raises(UnsupportedHFModel, match=r"m: tensor 'lm_head.weight' \[9, 9\] is not part"):
        check_hf_tensors(expected, {"a": [2, 3], "b": [4], "lm_head.weight": [9, 9]}, tied=False, where="m")
    with pytest.raises(UnsupportedHFModel, match=r"m: tensor 'b' \[4\] is missing \(and 0 more\)"):
        check_hf_tensors(expected, {"a": [2, 3]}, tied=False, where="m")
    with pytest.raises(UnsupportedHFModel, match=r"m: tensor 'a' has shape \[3, 2\], its config.json implies \[2, 3\]"):
        check_hf_tensors(expected, {"a": [3, 2], "b": [4]}, tied=False, where="m")
