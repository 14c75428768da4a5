"""Packed sequences on CUDA (``parallel.pack_sequences``): the local spec's per-sequence SDPA in
fp32 (exact), and Transformer Engine's ``thd`` varlen attention in bf16 (the GPU point of
packing), each against the same model's padded token-budget pass. Skips without CUDA (and the
TE test without transformer_engine); the CPU parity of packing is ``tests/model/test_parity.py``."""

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _setup(impl: str, dtype: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    from megarl.config import RunConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt

    cfg = RunConfig()
    cfg.model.vocab_size = 64
    cfg.model.transformer_impl = impl  # type: ignore[assignment]
    cfg.model.dtype = dtype  # type: ignore[assignment]
    dims = init_distributed(1, 1, seed=0)
    model = build_gpt(cfg.model, cfg.parallel, dims, optim=cfg.optim)
    g = torch.Generator().manual_seed(0)
    B, S = 12, 48
    tokens = torch.randint(3, 64, (B, S), generator=g)
    mask = torch.zeros(B, S)
    for i, r in enumerate(torch.randint(1, 40, (B,), generator=g).tolist()):
        mask[i, 5 : 5 + r] = 1.0
    return model, tokens.to(dims.device), mask.to(dims.device)


def _both_ways(model: Any, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Log-probs, loss and gradients of the padded and the packed token-budget passes (lr = 0)."""
    from megarl import algo
    from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs
    from megarl.model.microbatch import row_lengths, token_budget_split
    from megarl.model.train import train_step

    lengths, budget = row_lengths(mask), 4 * tokens.shape[1]
    denom = algo.global_denominator("seq-mean-token-mean", mask)

    def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        loss = algo.aggregate(-lp, mb["mask"], mode="seq-mean-token-mean", global_denominator=denom)
        return loss, {"loss": loss.detach()}

    out: dict[str, dict[str, Any]] = {}
    for name, pack in (("padded", False), ("packed", True)):
        lp = forward_logprobs(
            model, tokens, micro_batch_size=4, temperature=1.0, lengths=lengths, max_tokens=budget, pack=pack
        )["logprobs"]
        groups = token_budget_split(lengths, budget, packed=pack)
        stats, gnorm = train_step(
            model, {"tokens": tokens, "mask": mask}, loss_fn, micro_batch_size=4, lr=0.0, groups=groups
        )
        grads = {k: p.main_grad.detach().float().clone() for k, p in model.core.named_parameters()}
        out[name] = {"logprobs": lp, "loss": stats["loss"], "grad_norm": gnorm, "grads": grads}
    return out


def test_local_spec_packed_matches_padded_fp32() -> None:
    model, tokens, mask = _setup("local", "fp32")
    r = _both_ways(model, tokens, mask)
    a, b = r["padded"], r["packed"]
    m = mask.bool()
    assert (a["logprobs"] - b["logprobs"])[m].abs().max().item() < 1e-5
    assert abs(a["loss"] - b["loss"]) < 1e-6 and a["grad_norm"] > 0
    worst = max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in a["grads"])
    assert worst < 1e-5, worst


def test_transformer_engine_thd_matches_padded_bf16() -> None:
    pytest.importorskip("transformer_engine")
    model, tokens, mask = _setup("transformer_engine", "bf16")
    seen: list[str] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        p = kwargs.get("packed_seq_params")
        seen.append(p.qkv_format if p is not None else "sbhd")

    hooks = [
        mod.register_forward_pre_hook(record, with_kwargs=True)
        for name, mod in model.core.named_modules()
        if name.endswith("core_attention")
    ]
    assert hooks, "no core_attention module in the TE spec"
    r = _both_ways(model, tokens, mask)
    for h in hooks:
        h.remove()
    assert "thd" in seen and "sbhd" in seen  # the packed pass really ran TE's varlen (thd) attention
    a, b = r["padded"], r["packed"]
    m = mask.bool()
    d = (a["logprobs"] - b["logprobs"])[m].abs()
    assert d.mean().item() < 2e-2 and d.max().item() < 0.25, (d.mean().item(), d.max().item())  # bf16 kernels
    assert abs(a["loss"] - b["loss"]) < 1e-2 * abs(a["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) < 5e-2 * a["grad_norm"]
