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
        assert torch.cuda.current_device() == torch.device("cpu")
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


def _hf_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """transformers' Llama RoPE (an independent implementation) on megatron's [s, b, n, d] layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rot = freqs.shape[-1]
    cos = (freqs.cos() * mscale)[:, 0, 0][None]  # (1, s, rot)
    sin = (freqs.sin() * mscale)[:, 0, 0][None]
    x = t[..., :rot].permute(1, 2, 0, 3)  # (b, n, s, rot)
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return torch.cat((out.permute(2, 0, 1, 3), t[..., rot:]), dim=-1)


@pytest.mark.parametrize("rot_dim,mscale", [(16, 1.0), (8, 1.0), (16, 0.7)])
def test_rope_patch_matches_megatron_and_transformers(installed, rot_dim: int, mscale: float) -> None:
    """Patch 5: megatron's RoPE entry point now runs :class:`RotateHalfRoPE`; its output and input
    gradient equal megatron's own unfused code and transformers' (full and partial rotary,
    mscale), and the interleaved layout still goes to megatron's code."""
    from megatron.core.models.common.embeddings import rope_utils

    assert rope_utils._apply_rotary_pos_emb_bshd is cpu._rope_bshd
    megatron_rope = cpu._installed["rope_bshd"]
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=g, dtype=torch.float64)
    freqs = torch.randn(7, 1, 1, rot_dim, generator=g, dtype=torch.float64)
    upstream = torch.randn(7, 2, 3, 16, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for fn in (rope_utils._apply_rotary_pos_emb_bshd, megatron_rope, _hf_rope):
        x = t.clone().requires_grad_()
        y = fn(x, freqs, mscale=mscale) if fn is not _hf_rope else fn(x, freqs, mscale)
        y.backward(upstream)
        outs.append(y.detach())
        grads.append(x.grad)
    for other in (1, 2):
        torch.testing.assert_close(outs[0], outs[other], rtol=0, atol=1e-12)
        torch.testing.assert_close(grads[0], grads[other], rtol=0, atol=1e-12)
    assert not torch.allclose(outs[0], t)  # the rotation did something
    # interleaved: megatron's own code, same values
    a = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    torch.testing.assert_close(a, megatron_rope(t, freqs, rotary_interleaved=True), rtol=0, atol=0)


_FAULTS = """
import resource, sys, torch
from megarl.compat import cpu
if sys.argv[1] == "keep":
    assert cpu.keep_freed_memory()
for _ in range(12):  # glibc's aligned blocks settle into a cycle of reused addresses
    torch.ones(16 << 20).sum()  # 64 MiB, over glibc's largest mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    torch.ones(16 << 20).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_keep_freed_memory_stops_page_faults_of_reallocated_tensors() -> None:
    """Patch 6, measured on this machine's glibc: 64 MiB tensors allocated and freed in turn
    fault their 16k pages in each time by default, and (after a few to settle) never once
    freed memory is kept. Each variant in its own process: the setting is process-wide."""
    import subprocess
    import sys

    faults = {}
    for variant in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, variant], capture_output=True, text=True, check=True)
        faults[variant] = int(out.stdout.strip().splitlines()[-1])
    assert faults["default"] > 8 * 16_000 * 0.9, faults  # 4 KiB pages: 16k per tensor
    assert faults["keep"] < faults["default"] / 20, faults


def test_backward_passes_allocate_on_the_current_device(installed) -> None:
    """The device mode is off inside a backward pass (torch dispatches ``torch.autograd.backward``
    through it); megatron's autograd functions allocate there on
    ``torch.cuda.current_device()``, which is the CPU itself (patch 2)."""

    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            out = g.new_empty(g.shape, device=torch.cuda.current_device())  # as megatron's _AllToAll
            return out.copy_(g * 2)

    x = torch.ones(3, requires_grad=True)
    AllocatesInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_cuda_streams_and_events_are_ordered_no_ops(installed) -> None:
    """Patch 7: the MoE alltoall dispatcher's side stream, its context and its event."""
    side = torch.cuda.Stream()
    assert torch.cuda.current_stream() != side
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t = torch.arange(4) * 2
    side.record_event().synchronize()
    assert t.tolist() == [0, 2, 4, 6]


def test_moe_split_sizes_become_host_arrays(installed) -> None:
    """Patch 8: the dispatcher's split sizes reach ``all_to_all_single`` as numpy arrays (what
    its gloo binding accepts); other tensors stay tensors."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    counts = torch.tensor([2, 2])
    assert token_dispatcher.maybe_move_tensor_to_cpu(counts) is counts


def test_moe_router_gemm_without_transformer_engine() -> None:
    """megarl.compat.megatron_moe: without TE, megatron's router GEMM needs the name it only
    imports with TE; patched, it is torch's fp32 matmul, forward and backward."""
    from megatron.core.transformer.moe import moe_utils

    from megarl.compat import megatron_moe

    megatron_moe.install()
    assert moe_utils.te_general_gemm is None
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert torch.allclose(out, x @ w.t())
    out.square().sum().backward()
    assert torch.allclose(w.grad, 2 * (x @ w.t()).t() @ x, atol=1e-5)
