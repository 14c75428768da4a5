"""GPU-only paths: Transformer Engine layer spec and bf16. They are selected by config and
refused with a clear error on a machine without CUDA; with CUDA they build and run."""

import pytest
import torch

from megarl.config import ConfigError, load_config, validate

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("override", ["model.transformer_impl=transformer_engine", "model.dtype=bf16"])
def test_gpu_only_options_refused_on_cpu(override: str) -> None:
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match="needs CUDA"):
        validate(cfg, 1)


@pytest.mark.gpu
@GPU
def test_transformer_engine_spec_bf16_forward(tmp_path) -> None:
    pytest.importorskip("transformer_engine")
    from megarl.config import RunConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt
    from megarl.model.forward import forward_logprobs

    cfg = RunConfig()
    cfg.model.vocab_size = 64
    cfg.model.transformer_impl = "transformer_engine"
    cfg.model.dtype = "bf16"
    dims = init_distributed(1, 1, seed=0)
    model = build_gpt(cfg.model, cfg.parallel, dims, optim=cfg.optim)
    tokens = torch.randint(3, 64, (4, 16), device=dims.device)
    lp = forward_logprobs(model, tokens, micro_batch_size=4, temperature=1.0)["logprobs"]
    assert torch.isfinite(lp).all() and (lp[:, :-1] < 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("weight_sync.transport=nccl", "weight_sync.transport='nccl' needs CUDA; use 'auto', 'shm' or 'http' on CPU"),
        ("weight_sync.transport=cuda_ipc", "weight_sync.transport='cuda_ipc' needs CUDA"),
        ("rollout.colocate=true", r"rollout.colocate=True needs CUDA \(vLLM sleep mode\)"),
    ],
)
def test_gpu_transports_and_colocation_refused_on_cpu(override: str, message: str) -> None:
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)
