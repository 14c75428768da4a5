"""The "train your own model" examples: ``examples/make_byo_model.py`` makes what
``examples/byo_chat_math.yaml`` reads (deterministic, split by problem, rows the ``math``
reward and the config's length limits accept), ``examples/qwen_math_gpu.yaml`` is
consistent for Qwen2.5-1.5B-Instruct apart from the GPU-only settings a CPU refuses, and
``examples/grpo_qwen3_30b_a3b_gpu.yaml`` builds exactly the model of Qwen3-30B-A3B's config.json
and fits its stated memory per GPU.
(The byo run itself is ``benchmarks/byo_learning.py``; ``tests/e2e/test_hf_chat_cli.py``
drives the same path end to end.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, RunConfig, load_config, validate
from tests.config.test_hf import QWEN3_06B

ROOT = Path(__file__).resolve().parents[2]

QWEN25_15B_INSTRUCT = {  # config.json of Qwen/Qwen2.5-1.5B-Instruct on the hub
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


QWEN3_17B = {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144}
"""config.json of Qwen/Qwen3-1.7B on the hub: Qwen3-0.6B's with a wider trunk."""


def qwen_folder(tmp_path: Path) -> Path:
    """Qwen2.5-1.5B-Instruct's config.json beside an empty weights file: enough for config
    validation, which reads the shape and checks that weights exist (not their tensors)."""
    folder = tmp_path / "qwen2.5-1.5b-instruct"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN25_15B_INSTRUCT))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


QWEN3_30B_A3B_JSON = ROOT / "tests/config/fixtures/qwen3_30b_a3b_config.json"
"""config.json of Qwen/Qwen3-30B-A3B on the hub (transformers_version 4.51.0), key for key and
value for value as reproduced in github.com/citsjtu2020/LLM-Prof, sglang/Model_Config.md (its
"Qwen3-30B-A3B" block); tests/config/test_moe.py's QWEN3_30B_A3B is the same file's subset."""


def qwen3_30b_a3b_folder(tmp_path: Path) -> Path:
    """Qwen3-30B-A3B's config.json beside an empty weights file (config validation reads the
    shape and checks that weights exist, not their tensors)."""
    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_bytes(QWEN3_30B_A3B_JSON.read_bytes())
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def local_stand_ins(name: str, cfg: RunConfig, tmp_path: Path) -> None:
    """Point an example at local files it expects the user to have made or downloaded, and put
    GPU-only settings at their CPU values (test_gpu_recipe_... shows those are the only
    refusals)."""
    if name == "byo_chat_math.yaml":
        from examples.make_byo_model import make_all

        cfg.model.init_from, data = (str(p) for p in make_all(tmp_path / "byo"))
        cfg.data.source = data
    elif name == "qwen_math_gpu.yaml":
        cfg.model.init_from = str(qwen_folder(tmp_path))
        cfg.rollout.colocate, cfg.model.dtype, cfg.model.transformer_impl = False, "fp32", "local"
    elif name == "grpo_qwen3_30b_a3b_gpu.yaml":
        cfg.model.init_from = str(qwen3_30b_a3b_folder(tmp_path))
        cfg.model.dtype, cfg.model.transformer_impl, cfg.model.moe_grouped_gemm = "fp32", "local", False
    elif name == "agent_python_qwen3_gpu.yaml":
        folder = tmp_path / "qwen3-1.7b"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(QWEN3_17B))
        (folder / "model.safetensors").write_bytes(b"")
        cfg.model.init_from = str(folder)
        cfg.rollout.colocate, cfg.model.dtype, cfg.model.transformer_impl = False, "fp32", "local"


def test_gpu_recipe_refuses_only_gpu_only_fields_on_cpu(tmp_path: Path) -> None:
    import torch

    from megarl.config.cross import check_kv_cache
    from megarl.config.hf import resolved_model

    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusals")
    path = ROOT / "examples/qwen_math_gpu.yaml"
    src = f"model.init_from={qwen_folder(tmp_path)}"
    with pytest.raises(ConfigError, match=r"^rollout.colocate=True needs CUDA"):
        validate(load_config(path, [src]), 8)
    with pytest.raises(ConfigError, match=r"^model.dtype/transformer_impl='bf16/transformer_engine' needs CUDA"):
        validate(load_config(path, [src, "rollout.colocate=false"]), 8)
    cpu = ["rollout.colocate=false", "model.dtype=fp32", "model.transformer_impl=local"]
    cfg = load_config(path, [src, *cpu])
    validate(cfg, 8)  # TP 2 × DP 4 on one 8-GPU node
    m = resolved_model(cfg.model)
    assert (m.arch, m.num_layers, m.hidden_size, m.num_query_groups, m.tie_embeddings) == ("qwen2", 28, 1536, 2, True)
    assert m.rotary_base == 1e6 and m.max_position_embeddings == 32768
    check_kv_cache(cfg, m)  # each engine's KV cache holds a whole 32k-token sequence
    with pytest.raises(ConfigError, match="parallel.tensor_parallel=4"):
        validate(load_config(path, [src, *cpu, "parallel.tensor_parallel=4", "parallel.data_parallel=2"]), 8)


def test_byo_files_are_deterministic_split_by_problem_and_fit_the_config(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from examples.make_byo_model import NUM_VAL, make_all
    from megarl.rewards.builtin import math

    model, data = make_all(tmp_path / "a")
    model_b, data_b = make_all(tmp_path / "b")
    assert data.read_bytes() == data_b.read_bytes()
    for f in sorted(model.iterdir()):
        assert f.read_bytes() == (model_b / f.name).read_bytes(), f.name
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    cfg = load_config(ROOT / "examples/byo_chat_math.yaml")
    assert cfg.data.num_val == NUM_VAL
    train, val = rows[:-NUM_VAL], rows[-NUM_VAL:]
    texts = {r["messages"][0]["content"] for r in train}
    assert not texts & {r["messages"][0]["content"] for r in val}  # held-out problems
    assert len({r["messages"][0]["content"] for r in val}) == NUM_VAL
    for r in rows[:200] + val:
        assert r["answer"] == f"\\boxed{{{r['number']}}}" and r["number"] >= 0
        assert math("", r["answer"], r["answer"]) == 1.0
        assert math("", f"\\boxed{{{r['number'] + 1}}}", r["answer"]) == 0.0
    tok = AutoTokenizer.from_pretrained(str(model))
    hf = AutoConfig.from_pretrained(str(model))
    assert hf.vocab_size == len(tok) and hf.hidden_size // hf.num_attention_heads == 32  # vLLM CPU head_dim
    prompts = [
        tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for r in rows
    ]
    assert max(len(p) for p in prompts) <= cfg.rollout.max_prompt_len
    answers = [tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    assert max(len(a) for a in answers) <= cfg.rollout.max_response_len
    assert tok.decode(answers[0][:-1]) == rows[0]["answer"]


# ModelConfig field -> the config.json key it must equal (megarl.config.hf maps them; here read
# directly, as a second statement of the mapping)
QWEN3_MOE_KEYS = {
    "arch": "model_type",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",  # head_dim × heads = 4096 ≠ hidden 2048: explicit
    "ffn_hidden_size": "intermediate_size",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_router_topk": "num_experts_per_tok",
    "moe_norm_topk_prob": "norm_topk_prob",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rotary_base": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "linear_bias": "attention_bias",
}
# fields config.json does not hold: the recipe's (or megarl's) own choices
NOT_IN_CONFIG_JSON = {
    "init_from", "tokenizer", "dtype", "transformer_impl", "attention", "init_std", "moe_router_fp32",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_dead_expert_steps", "moe_grouped_gemm", "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
}  # fmt: skip


def _per_gpu_static_gb(hf: dict, tp: int, dp: int, ep: int) -> tuple[float, float]:
    """(total parameters in billions, static GB per trainer GPU) of a Qwen3-MoE config at TP 1:
    bf16 weights (2 B), fp32 gradients (4 B), Adam's fp32 master + 2 moments (12 B) sharded by the
    distributed optimizer — experts over their data-parallel group (DP / EP), the rest over DP."""
    assert tp == 1
    layers, h, e, moe_i = hf["num_hidden_layers"], hf["hidden_size"], hf["num_experts"], hf["moe_intermediate_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    experts = layers * e * 3 * h * moe_i
    per_layer = 2 * h * q + 2 * h * kv + 2 * hf["head_dim"] + 2 * h + e * h  # q/o, k/v, q/k norms, 2 norms, router
    rest = layers * per_layer + 2 * hf["vocab_size"] * h + h  # untied embedding and output layer, final norm
    local_experts = experts / ep
    static = (local_experts + rest) * (2 + 4) + local_experts * 12 / (dp // ep) + rest * 12 / dp
    return (experts + rest) / 1e9, static / 1e9


def test_qwen3_30b_a3b_recipe_builds_the_config_json_model_and_fits_80gb(tmp_path: Path) -> None:
    """The recipe through megarl's own config path (load, validate at its 16 ranks, the model
    ``init_from``'s config.json resolves to): every model field equals config.json's value or is
    one config.json does not hold; the layout's static memory is the header's 43.0 GB."""
    import dataclasses

    from megarl.config import ModelConfig
    from megarl.config.hf import resolved_model

    path = ROOT / "examples/grpo_qwen3_30b_a3b_gpu.yaml"
    hf = json.loads(QWEN3_30B_A3B_JSON.read_text())
    src = f"model.init_from={qwen3_30b_a3b_folder(tmp_path)}"
    with pytest.raises(ConfigError, match=r"^model.dtype/transformer_impl='bf16/transformer_engine' needs CUDA"):
        validate(load_config(path, [src]), 16)
    cfg = load_config(path, [src, "model.dtype=fp32", "model.transformer_impl=local",
                                "model.moe_grouped_gemm=false"])  # (TE's grouped GEMM with TE only)
    validate(cfg, 16)  # 2 trainer nodes × 8 GPUs (the fleet node is the third)
    m = resolved_model(cfg.model)
    assert set(QWEN3_MOE_KEYS) | NOT_IN_CONFIG_JSON == {f.name for f in dataclasses.fields(ModelConfig)}
    for field, key in QWEN3_MOE_KEYS.items():
        assert getattr(m, field) == hf[key], (field, getattr(m, field), key, hf[key])
    assert hf["rope_scaling"] is None and m.rope_scaling == "none"
    assert (hf["decoder_sparse_step"], hf["mlp_only_layers"], hf["hidden_act"]) == (1, [], "silu")  # MoE everywhere
    p = cfg.parallel
    total, static = _per_gpu_static_gb(hf, p.tensor_parallel, p.data_parallel, p.expert_parallel)
    print(f"Qwen3-30B-A3B: {total:.2f}B parameters; static {static:.1f} GB per trainer GPU at EP {p.expert_parallel}")
    assert round(total, 1) == 30.5 and round(static, 1) == 43.0
    assert _per_gpu_static_gb(hf, 1, 16, 8)[1] > 53  # the header's "EP 8 would hold 54 GB"
    # an engine GPU: fp32 weights (megarl.engine.vllm_engine loads dtype float32) over engine TP, + KV cache
    engine_gb = total * 4 / cfg.rollout.engine_tp + cfg.rollout.kv_cache_gb * (1 << 30) / 1e9
    assert engine_gb < 70, engine_gb
