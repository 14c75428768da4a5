"""One real vLLM engine (megarl's ``VllmEngine``, in this process) through a sequence of
weight updates, printing one JSON line of measurements for tests/weight_sync/test_moe_engine.py
(a subprocess each: vLLM's global state stays out of pytest).

Usage: ``python moe_engine_script.py WORKDIR ARCH CPU_GEMM [TP [trainer]]`` with ARCH ``qwen3_moe``,
``mixtral`` or ``qwen3`` (dense, tied embeddings); TP 2: two vLLM worker processes, each holding half of every
expert's intermediate dimension (their coverage records are joined). Steps, each with the engine's prompt log-probs against
transformers' on the model it was given:
  sync_a / sync_b   model A, then model B (changed weights) through begin/load/commit
  reload_b          vLLM's own layer-wise ``reload_weights`` of B's identical tensors (MoE: the
                    path megarl never takes; it corrupts the experts on CPU, vLLM 0.32; TP 1 only)
  resync_b          B again through megarl: the engine is exact again
  integrity_a/_b    with ``trainer``: megarl's own integrity check (``check_integrity``: engine vs
                    the trainer's megatron model of A, then B, built in this process first)
  missing_expert / missing_dense / unknown   the coverage check's refusals (messages)
  unknown_module    (mixtral) a name under no module of vLLM's layer: vLLM's own refusal
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
from megarl.config import ModelConfig, WeightSyncConfig  # noqa: E402
from megarl.engine.staging import MANIFEST  # noqa: E402
from tests.helpers import tiny_hf_model  # noqa: E402

# the HF names of one layer's MoE block and its experts' gate, up and down projections, as
# save_pretrained writes them (transformers 5 fuses both families' experts in memory only, under
# mlp.experts.gate_up_proj / down_proj)
EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
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


class OneEngineFleet:
    """The in-process engine where ``check_integrity`` takes the trainer's fleet: one answer per engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        return [self.engine.logprobs({"sequences": sequences, "temperature": temperature})["logprobs"]]


def trainer_model(hf: Path) -> tuple[Any, LlamaQwen2Adapter]:
    """megarl's model of ``hf`` as the trainer builds it (megatron-core, one gloo rank), and its adapter."""
    from megarl.config import ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt

    mcfg = model_config_from_hf(json.loads((hf / "config.json").read_text()), ModelConfig())
    model = build_gpt(mcfg, ParallelConfig(), init_distributed(1, 1, seed=0), trainable=False)
    return model, LlamaQwen2Adapter(mcfg)


def main(work: Path, arch: str, cpu_gemm: str, tp: int, trainer: bool) -> dict[str, Any]:
    from megarl.engine.vllm_engine import VllmEngine

    moe = arch in EXPERT_NAMES
    models = [tiny_hf_model(work / f"hf{k}", arch=arch, vocab=64, tie=not moe, seed=k, qk_gain=4.0) for k in (1, 2)]
    refs = [reference(hf) for hf in models]
    tensors = [load_file(str(hf / "model.safetensors")) for hf in models]
    adapter = LlamaQwen2Adapter(
        model_config_from_hf(json.loads((models[0] / "config.json").read_text()), ModelConfig())
    )
    actor = trainer_model(models[0]) if trainer else None  # (megatron before vLLM starts)
    engine_dir = work / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))
    engine = VllmEngine(str(engine_dir), tp=tp, kv_cache_gb=0.25, seed=0, max_len=64, cpu_gemm=cpu_gemm)
    try:
        return steps(engine, refs, tensors, arch, actor)
    finally:
        engine.close()


def steps(
    engine: Any, refs: list[torch.Tensor], tensors: list[dict[str, torch.Tensor]], arch: str, actor: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu_gemm": engine.cpu_gemm, "models_differ": (refs[0] - refs[1]).abs().max().item()}
    moe = arch in EXPERT_NAMES

    def update(version: int, named: dict[str, torch.Tensor]) -> None:
        engine.begin({"version": version})
        engine.load_bytes(version, save(named))
        engine.commit({"version": version})

    def diff(k: int) -> float:
        got = torch.tensor(engine.logprobs({"sequences": SEQS, "temperature": 1.0})["logprobs"])
        return (got - refs[k]).abs().max().item()

    def integrity(k: int) -> None:
        if actor is None:
            return
        from megarl.checkpoint.hf_io import load_hf_tensors
        from megarl.weight_sync.sync import check_integrity

        model, adapter = actor
        load_hf_tensors(model, adapter, tensors[k])  # the trainer at that version
        tol = WeightSyncConfig().integrity_tol  # a run's default
        out["integrity_" + "ab"[k]] = check_integrity(model, OneEngineFleet(engine), SEQS[0], tol=tol)

    update(1, tensors[0])
    out["sync_a"] = diff(0)
    integrity(0)
    update(2, tensors[1])
    out["sync_b"] = diff(1)
    integrity(1)
    if moe and engine.tp == 1:

        def vllm_reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(tensors[1].items()), is_checkpoint_format=True)

        engine.llm.collective_rpc(vllm_reload)
        engine.llm.reset_prefix_cache()
        out["reload_b"] = diff(1)
    update(3, tensors[1])
    out["resync_b"] = diff(1)
    out.update(coverage_refusals(engine, tensors[1], arch, update))
    return out


def coverage_refusals(engine: Any, named: dict[str, torch.Tensor], arch: str, update: Any) -> dict[str, str]:
    """Updates whose names disagree with the engine's model. The engine's manifest is edited
    as a trainer with those names would have written it (staging then lets them through).
    Mixtral last: transformers 5's in-memory name ``model.layers.0.mlp.experts.gate_up_proj``
    names no module of vLLM's Mixtral layer (its MoE block is ``block_sparse_moe``), so vLLM's
    loader raises in the middle of its layer-wise reload; the engine reports itself failed and
    is not used again (a run restarts it)."""
    out = {}
    manifest = dict(engine.manifest)

    def send(version: int, drop: str = "", extra: str = "", value: Any = None) -> str:
        engine.manifest = {k: v for k, v in manifest.items() if k != drop}
        tensors = {k: v for k, v in named.items() if k != drop}
        if extra:
            engine.manifest[extra], tensors[extra] = list(value.shape), value
        message = refused(lambda: update(version, tensors))
        engine.manifest = manifest
        return message

    if arch in EXPERT_NAMES:
        block, gate, up, down = EXPERT_NAMES[arch]
        out["missing_expert"] = send(4, drop=f"model.layers.1.{block}.experts.3.{down}.weight")
        out["failed_after_missing_expert"] = engine.failed
        # a layer's fused experts [E, 2F, H] as transformers 5 holds them in memory, under the
        # engine's expert layer (vLLM's expert loader skips the name silently)
        extra = f"model.layers.0.{block}.experts.gate_up_proj"
        value = torch.cat(
            [named[f"model.layers.0.{block}.experts.{e}.{p}.weight"] for e in range(4) for p in (gate, up)]
        )
        value = value.reshape(4, -1, value.shape[-1])
    else:  # an untied head sent to a tied engine: vLLM skips it silently
        extra, value = "lm_head.weight", named["model.embed_tokens.weight"].clone()
    out["missing_dense"] = send(5, drop="model.layers.1.post_attention_layernorm.weight")
    engine.failed = ""
    out["unknown"] = send(6, extra=extra, value=value)
    out["failed_after_unknown"] = engine.failed
    engine.failed = ""
    if arch == "mixtral":
        out["unknown_module"] = send(7, extra="model.layers.0.mlp.experts.gate_up_proj", value=value)
        out["failed_after_unknown_module"] = engine.failed
    return out


if __name__ == "__main__":
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if tp == 1:  # as the engine server does: one worker in this process, tensors handed over
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (else NUMA nodes)
    result = main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], tp, sys.argv[5:] == ["trainer"])
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's teardown and a full GC at exit take seconds
