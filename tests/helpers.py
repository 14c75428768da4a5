"""Shared test helpers: run a worker script under torchrun, run ``megarl train`` end to end,
make a tiny HF model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str | Path, nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` gloo ranks; raise with the output on failure."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def train_cmd(config: str, sets: list[str]) -> list[str]:
    """``megarl train --config examples/CONFIG --set ...`` as the real entry point runs it."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "examples" / config)]
    return cmd + [a for s in sets for a in ("--set", s)]


def train_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def megarl_train(config: str, sets: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``megarl train`` to completion (torchrun ranks + engines, as a user would); by
    default assert it exited 0, showing the tail of its output when it did not."""
    proc = subprocess.run(train_cmd(config, sets), env=train_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def tiny_hf_model(
    path: Path,
    arch: str = "llama",
    vocab: int = 61,
    tie: bool = False,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
    dtype: str = "float32",
    qk_gain: float = 1.0,
) -> Path:
    """A random tiny Llama/Qwen2 model saved by transformers itself (the independent oracle).

    ``extra``: more config keys (rope_scaling, attention_bias, ...); ``dtype``: the saved
    tensors' dtype; ``qk_gain`` scales q/k projections so attention is sharp and position
    (RoPE) visibly changes the logits (random init attends almost uniformly).
    """
    import torch

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, rope_theta=10000.0)
    common.update(extra or {})
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(head_dim=32, **common))
    # transformers inits norms to 1 and biases to 0: perturb them so the mapping is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
    model.to(getattr(torch, dtype)).save_pretrained(str(path), safe_serialization=True)
    return path


def read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))
