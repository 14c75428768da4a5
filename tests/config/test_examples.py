"""The "train your own model" examples: ``examples/make_byo_model.py`` makes what
``examples/byo_chat_math.yaml`` reads (deterministic, split by problem, rows the ``math``
reward and the config's length limits accept), and ``examples/qwen_math_gpu.yaml`` is
consistent for Qwen2.5-1.5B-Instruct apart from the GPU-only settings a CPU refuses.
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
