"""One real vLLM engine (megarl's ``VllmEngine``, in this process) through a sequence of
weight updates, printing one JSON line of measurements for tests/weight_sync/test_moe_engine.py
(a subprocess each: vLLM's global state stays out of pytest).

Usage: ``python moe_engine_script.py WORKDIR ARCH CPU_GEMM [TP]`` with ARCH ``qwen3_moe`` or
``qwen3`` (dense, tied embeddings); TP 2: two vLLM worker processes, each holding half of every
expert's intermediate dimension (their coverage records are joined). Steps, each with the engine's prompt log-probs against
transformers' on the model it was given:
  sync_a / sync_b   model A, then model B (changed weights) through begin/load/commit
  reload_b          vLLM's own layer-wise ``reload_weights`` of B's identical tensors (MoE: the
                    path megarl never takes; it corrupts the experts on CPU, vLLM 0.32; TP 1 only)
  resync_b          B again through megarl: the engine is exact again
  missing_expert / unknown / missing_dense   the coverage check's refusals (messages)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.config import ModelConfig  # noqa: E402
from megarl.engine.staging import MANIFEST  # noqa: E402
from tests.helpers import tiny_hf_model  # noqa: E402

SEQS = [[1, 5 + i, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 3, 7, 11, 15] for i in range(3)]


def reference(hf: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tokens = torch.tensor(SEQS)
    with torch.no_grad():
        return model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def refused(fn: Any) -> str:
    try:
        fn()
    except Exception as err:  # the engine's refusal, whatever its type: the test reads the message
        return f"{type(err).__name__}: {err}"
    return ""


def main(work: Path, arch: str, cpu_gemm: str, tp: int) -> dict[str, Any]:
    from megarl.engine.vllm_engine import VllmEngine

    moe = arch == "qwen3_moe"
    models = [tiny_hf_model(work / f"hf{k}", arch=arch, vocab=64, tie=not moe, seed=k, qk_gain=4.0) for k in (1, 2)]
    refs = [reference(hf) for hf in models]
    tensors = [load_file(str(hf / "model.safetensors")) for hf in models]
    adapter = LlamaQwen2Adapter(
        model_config_from_hf(json.loads((models[0] / "config.json").read_text()), ModelConfig())
    )
    engine_dir = work / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))
    engine = VllmEngine(str(engine_dir), tp=tp, kv_cache_gb=0.25, seed=0, max_len=64, cpu_gemm=cpu_gemm)
    try:
        return steps(engine, refs, tensors, moe)
    finally:
        engine.close()


def steps(engine: Any, refs: list[torch.Tensor], tensors: list[dict[str, torch.Tensor]], moe: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_gemm": engine.cpu_gemm, "models_differ": (refs[0] - refs[1]).abs().max().item()}

    def update(version: int, named: dict[str, torch.Tensor]) -> None:
        engine.begin({"version": version})
        engine.load_bytes(version, save(named))
        engine.commit({"version": version})

    def diff(k: int) -> float:
        got = torch.tensor(engine.logprobs({"sequences": SEQS, "temperature": 1.0})["logprobs"])
        return (got - refs[k]).abs().max().item()

    update(1, tensors[0])
    out["sync_a"] = diff(0)
    update(2, tensors[1])
    out["sync_b"] = diff(1)
    if moe and engine.tp == 1:

        def vllm_reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(tensors[1].items()), is_checkpoint_format=True)

        engine.llm.collective_rpc(vllm_reload)
        engine.llm.reset_prefix_cache()
        out["reload_b"] = diff(1)
    update(3, tensors[1])
    out["resync_b"] = diff(1)
    out.update(coverage_refusals(engine, tensors[1], moe, update))
    return out


def coverage_refusals(engine: Any, named: dict[str, torch.Tensor], moe: bool, update: Any) -> dict[str, str]:
    """Updates whose names disagree with the engine's model. The engine's manifest is edited
    as a trainer with those names would have written it (staging then lets them through)."""
    out = {}
    manifest = dict(engine.manifest)
    if moe:
        drop = "model.layers.1.mlp.experts.3.down_proj.weight"
        engine.manifest = {k: v for k, v in manifest.items() if k != drop}
        out["missing_expert"] = refused(lambda: update(4, {k: v for k, v in named.items() if k != drop}))
        out["failed_after_missing_expert"] = engine.failed
        # transformers 5's in-memory name of a layer's fused experts [E, 2F, H]
        extra = "model.layers.0.mlp.experts.gate_up_proj"
        value = torch.cat(
            [named[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for e in range(4) for p in ("gate_proj", "up_proj")]
        )
        value = value.reshape(4, -1, value.shape[-1])
    else:  # an untied head sent to a tied engine: vLLM skips it silently
        extra, value = "lm_head.weight", named["model.embed_tokens.weight"].clone()
    engine.manifest = {**manifest, extra: list(value.shape)}
    out["unknown"] = refused(lambda: update(5, {**named, extra: value}))
    out["failed_after_unknown"] = engine.failed
    engine.failed = ""
    drop = "model.layers.1.post_attention_layernorm.weight"
    engine.manifest = {k: v for k, v in manifest.items() if k != drop}
    out["missing_dense"] = refused(lambda: update(6, {k: v for k, v in named.items() if k != drop}))
    engine.manifest = manifest
    return out


if __name__ == "__main__":
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if tp == 1:  # as the engine server does: one worker in this process, tensors handed over
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (else NUMA nodes)
    result = main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], tp)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's teardown and a full GC at exit take seconds
