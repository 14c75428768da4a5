"""``algo.router_replay: rollout`` end to end on one GPU (run by test_router_replay_rollout_gpu.py,
a subprocess: vLLM's global state stays out of pytest). A tiny Qwen3-MoE (4 layers, 4 experts,
top-2) is written into a real ``VllmEngine`` started with ``return_routes`` (vLLM's V2 runner),
which samples 2 responses to each of 3 prompts; its reply frame is decoded and packed into a
``RolloutBatch`` exactly as a run does (``megarl.rollout.sampling.pack_groups``); the trainer's
megatron model of the same weights then runs phase 2 (``megarl.update.evaluate``) replaying the
engine's routes, with each router's routing map hooked. Prints one JSON line:

  rows_ok          every sample's routes have prompt + response - 1 rows
  replayed_equal   the routers' replayed choices equal the engine's on every routed token
  routed_tokens    tokens compared
  engine_vs_old    ``moe/engine_route_mismatch`` (the trainer's live experts vs the engine's)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from safetensors.torch import load_file, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.helpers import tiny_hf_model  # noqa: E402
from tests.weight_sync.moe_engine_script import trainer_model  # noqa: E402

PROMPTS = [[1, 5 + i, 9, 13, 17, 21, 25] for i in range(3)]
EXPERTS = 4


def sample(work: Path, hf: Path) -> tuple[Any, Any]:
    """The engine's generation of PROMPTS as a packed batch, and the HF tensors it served."""
    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
    from megarl.config import ModelConfig
    from megarl.data.prompts import PromptRecord
    from megarl.engine.staging import MANIFEST
    from megarl.engine.vllm_engine import VllmEngine
    from megarl.engine.wire import decode_generation
    from megarl.rollout.sampling import Group, pack_groups

    tensors = load_file(str(hf / "model.safetensors"))
    adapter = LlamaQwen2Adapter(model_config_from_hf(json.loads((hf / "config.json").read_text()), ModelConfig()))
    engine_dir = work / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))
    engine = VllmEngine(str(engine_dir), tp=1, kv_cache_gb=0.25, seed=0, max_len=64, return_routes=True)
    engine.begin({"version": 1})
    engine.load_bytes(1, save(tensors))
    engine.commit({"version": 1})
    frame = engine.generate({"prompts": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 1.0, "seeds": [1, 2, 3]})
    _, outputs, _ = decode_generation(frame)
    groups = [
        Group(PromptRecord("q", "a", f"p:{i}"), p, [(s["token_ids"], s["logprobs"], False) for s in out],
              [""] * len(out), [0.0] * len(out), routes=[s["routes"] for s in out])
        for i, (p, out) in enumerate(zip(PROMPTS, outputs))
    ]  # fmt: skip
    rows_ok = all(
        s["routes"].shape[0] == len(p) + len(s["token_ids"]) - 1 for p, out in zip(PROMPTS, outputs) for s in out
    )
    return pack_groups(groups, pad_id=0, version=1), rows_ok


def main(work: Path) -> dict[str, Any]:
    from megarl.config import AlgoConfig, ParallelConfig, RolloutConfig
    from megarl.model.routes import attach
    from megarl.update.evaluate import evaluate

    hf = tiny_hf_model(work / "hf", arch="qwen3_moe", vocab=64, seed=1, qk_gain=4.0)
    model, adapter = trainer_model(hf)  # (megatron before vLLM starts)
    from megarl.checkpoint.hf_io import load_hf_tensors

    load_hf_tensors(model, adapter, load_file(str(hf / "model.safetensors")))
    attach(model)
    batch, rows_ok = sample(work, hf)
    seen: list[torch.Tensor] = []
    routers = [layer.mlp.router for layer in model.core.decoder.layers]
    hooks = [r.register_forward_hook(lambda mod, inp, o: seen.append(o[1].detach().cpu())) for r in routers]
    B, S = batch.tokens.shape
    ev = evaluate(AlgoConfig(router_replay="rollout", kl_coef=0.0), RolloutConfig(),
                  ParallelConfig(micro_batch_size=B), batch, model, None, None)  # fmt: skip
    for h in hooks:
        h.remove()
    replayed = torch.stack([m.reshape(S, B, -1).transpose(0, 1) for m in seen], dim=2)  # (B, S, L, E)
    assert batch.routes is not None
    engine = batch.routes.long()
    known = engine[..., 0] >= 0  # (B, S, L)
    want = torch.zeros(*engine.shape[:-1], EXPERTS, dtype=torch.bool).scatter(-1, engine.clamp(min=0), True)
    return {
        "rows_ok": rows_ok,
        "replayed_equal": bool(torch.equal(replayed[known], want[known])),
        "routed_tokens": int(known[..., 0].sum()),
        "engine_vs_old": ev.route_mismatch,
    }


if __name__ == "__main__":
    result = main(Path(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's teardown and a full GC at exit take seconds
