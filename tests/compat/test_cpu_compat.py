"""Each CPU compatibility patch, tested on its own (megarl.compat.cpu)."""

import pytest
import torch

from megarl.compat import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patches")


@pytest.fixture()
def installed():
    was = cpu.is_installed()
    cpu.install()
    yield
    if not was:
        cpu.uninstall()


def test_cuda_devices_map_to_cpu(installed) -> None:
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu"


def test_current_device_and_synchronize() -> None:
    """Unpatched, a CPU torch build refuses both calls; patched, megatron's RoPE (which places
    its frequencies on ``torch.cuda.current_device()``) runs and matches the formula."""
    was = cpu.is_installed()
    if was:
        cpu.uninstall()
    try:
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.synchronize()
        cpu.install()
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
        freqs = rope(5)  # (seq, 1, 1, dim)
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        expected = torch.outer(torch.arange(5, dtype=torch.float32), inv)
        assert freqs.device.type == "cpu" and freqs.shape == (5, 1, 1, 8)
        assert torch.allclose(freqs[:, 0, 0, :4], expected) and torch.allclose(freqs[:, 0, 0, 4:], expected)
    finally:
        if not was:
            cpu.uninstall()
        elif not cpu.is_installed():
            cpu.install()


def test_type_names_report_cuda_for_float(installed) -> None:
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.long).type() == "torch.LongTensor"


def test_uninstall_restores() -> None:
    was = cpu.is_installed()
    cpu.install()
    cpu.uninstall()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"
    if was:
        cpu.install()


def test_rng_tracker_forks_and_restores() -> None:
    tracker = cpu.CpuRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("tp", 123)
    before = torch.get_rng_state()
    with tracker.fork("tp"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # outer stream untouched
    with tracker.fork("tp"):
        b = torch.rand(3)
    torch.manual_seed(123)
    expected = torch.rand(6)
    assert torch.equal(torch.cat([a, b]), expected)  # the forked stream continues
    with pytest.raises(ValueError, match="seed 123 already exists"):
        tracker.add("other", 123)
    with pytest.raises(KeyError):
        with tracker.fork("missing"):
            pass
