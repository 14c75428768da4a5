"""The noise split by prompt on a real megatron model (gloo, one rank): the probe's readings of
one update — each GRPO group's |g|² and its halves' |Δ_1 - Δ_2|², read from megatron's grad
buffer at micro-batch boundaries — against brute force (each response's own backward, summed by
group and half in float64), and the (σ_b², σ_w²) they give (``worker_noise_split.py``)."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.coordinator.noise_split import prompt_split
from megarl.grad_parts import grad_stats
from tests.helpers import ROOT, tiny_hf_model, torchrun

GROUP = 4


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    base = tmp_path_factory.mktemp("noise_split")
    hf = tiny_hf_model(base / "hf")
    torchrun(ROOT / "tests/model/worker_noise_split.py", 1, ["--hf", str(hf), "--out", str(base)])
    return load_file(str(base / "result.safetensors"))


def _split(r: dict[str, torch.Tensor], source: str) -> tuple[float, float]:
    units = r["units"]
    rows = [slice(i, i + GROUP) for i in range(0, len(units), GROUP)]
    stats = grad_stats(
        "actor",
        r[f"{source}/part_sq"].tolist(),
        rows,
        units,
        torch.ones(len(units), dtype=torch.bool),
        float(r[f"{source}/global_sq"]) ** 0.5,
        "tokens",
        "microbatch",
        split=r[f"{source}/split_sq"].tolist(),
    )
    assert stats is not None and stats.split_sq_norms is not None and stats.split_halves is not None
    halves = [(a, b) for a, b in stats.split_halves]
    assert any(a != b for a, b in halves)  # token halves of unequal size: the (n_1 - n_2)² term is exercised
    return prompt_split(stats.local_sq_norms, stats.local_batches, stats.global_sq_norm, stats.split_sq_norms, halves)


def test_probe_split_matches_per_sample_gradients(result: dict[str, torch.Tensor]) -> None:
    """Tolerances: the probe differences fp32 buffer states (Δ = cur - prev, then 2·Δ_1 - (Δ_1 +
    Δ_2)), each losing ~1e-7 of the buffer's size per element, while brute force sums float64
    copies of each row's fp32 gradient; on squared norms of parts that carry most of the buffer
    that is ~1e-7 relative at worst (seen: 3e-9), so 1e-6. |G|² is the optimizer's fp32 grad
    norm (seen 7e-7 off the float64 sum): 1e-5, the parity tests' tolerance."""
    r = result
    assert torch.allclose(r["probe/part_sq"], r["brute/part_sq"], rtol=1e-6, atol=0)
    assert torch.allclose(r["probe/split_sq"], r["brute/split_sq"], rtol=1e-6, atol=0)
    assert torch.allclose(r["probe/global_sq"], r["brute/global_sq"], rtol=1e-5, atol=0)
    # the halves' differences are not the parts' norms again (a reading of the wrong buffer state would be)
    assert ((r["probe/split_sq"] / r["probe/part_sq"] - 1).abs() > 1e-3).all()
    probe, brute = _split(r, "probe"), _split(r, "brute")
    assert probe == pytest.approx(brute, rel=1e-4), (probe, brute)
    assert brute[1] > 0  # σ_w² of 16 responses' policy gradients: resolved (σ_b² may come out either sign)
