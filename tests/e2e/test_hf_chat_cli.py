"""Train your own model, end to end through `megarl train`: a tiny Qwen2 saved by
transformers with a locally trained byte-level BPE tokenizer, ChatML template and
generation config (as hub models ship them), chat-format JSONL data.

Checks: the prompt ids megarl sent to vLLM equal transformers' ``apply_chat_template``
ids; responses end at the tokenizer's EOS; ``hf_final/`` and ``megarl convert
megarl-to-hf`` carry the source tokenizer files byte for byte, and the export loads in
transformers and in vLLM (with its own tokenizer and chat template) with identical greedy
outputs and identical prompt ids."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import ROOT, megarl_train, tiny_hf_model, tiny_hf_tokenizer

SYSTEM = "please add"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hfchat")
    model = tiny_hf_model(base / "model", arch="qwen2", vocab=300)
    tiny_hf_tokenizer(model, "chatml", vocab=300)  # tokenizer files + generation_config.json
    rng = random.Random(0)
    data = base / "chat.jsonl"
    rows = []
    for i in range(64):
        a, b = rng.randrange(20), rng.randrange(20)
        rows.append({"messages": [{"role": "user", "content": f"what is {a}+{b}="}], "answer": str(a + b), "id": i})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = base / "run"
    sets = [
        f"model.init_from={model}",
        "model.tokenizer=hf",
        f"data.source={data}",
        "data.num_val=8",
        f"data.system_prompt={SYSTEM}",
        "rollout.max_prompt_len=40",
        "rollout.max_response_len=8",
        "rollout.num_prompts=4",
        "rollout.samples_per_prompt=4",
        "rollout.dump_rollouts=true",
        "parallel.micro_batch_size=16",
        "warm_start.steps=60",
        "warm_start.batch_size=32",
        "train.steps=2",
        "train.eval_every=0",
        "coordinator.enabled=false",
        "train.tensorboard=false",
        f"train.run_dir={out}",
    ]
    proc = megarl_train("grpo_cpu.yaml", sets)
    (out / "stdout.log").write_text(proc.stdout + proc.stderr)
    return {"model": model, "run": out, "data": data}


def _template_ids(model: Path, row: dict[str, object]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    msgs = [{"role": "system", "content": SYSTEM}, *row["messages"]]  # type: ignore[misc]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_prompt_ids_sent_to_vllm_equal_chat_template_ids(run: dict[str, Path]) -> None:
    rows = [json.loads(line) for line in run["data"].read_text().splitlines()]
    dumped = [json.loads(line) for line in (run["run"] / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({d["step"] for d in dumped}) == [1, 2] and len(dumped) == 8
    for d in dumped:
        line = int(d["where"].rsplit(":", 1)[1])
        assert d["prompt_ids"] == _template_ids(run["model"], rows[line - 1]), d["where"]
    assert [r["step"] for r in read_metrics(run["run"]) if "rollout/reward_mean" in r] == [1, 2]


def test_responses_end_at_the_tokenizer_eos(run: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run["model"]))
    eos = set(json.loads((run["model"] / "generation_config.json").read_text())["eos_token_id"])
    assert tok.convert_ids_to_tokens(sorted(eos)) == ["<|endoftext|>", "<|im_end|>"]
    dumped = [json.loads(line) for line in (run["run"] / "rollouts.jsonl").read_text().splitlines()]
    finished = 0
    for d in dumped:
        for ids, truncated, text in zip(d["response_ids"], d["truncated"], d["texts"]):
            assert not eos & set(ids[:-1])  # generation stopped at the first EOS
            assert "<|im_end|>" not in text and "<|endoftext|>" not in text  # stripped for the reward
            if not truncated:
                assert ids[-1] in eos
                finished += 1
    # the warm start taught the assistant turn's end (<|im_end|>): most responses finish
    assert finished >= len(dumped) * 4 // 2, finished


def test_export_carries_the_tokenizer_files_unchanged(run: dict[str, Path]) -> None:
    hf = run["run"] / "hf_final"
    for name in COPIED:
        assert (hf / name).read_bytes() == (run["model"] / name).read_bytes(), name
    src, out = (json.loads((p / "config.json").read_text()) for p in (run["model"], hf))
    for key in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "model_type"):
        assert out[key] == src[key], key
    conv = run["run"] / "hf_converted"
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "convert",
        "megarl-to-hf",
        "--ckpt",
        str(run["run"] / "checkpoints"),
        "--out",
        str(conv),
    ]
    proc = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in COPIED:
        assert (conv / name).read_bytes() == (run["model"] / name).read_bytes(), name


def test_export_loads_in_transformers_and_vllm_with_identical_greedy_output(run: dict[str, Path]) -> None:
    rows = [json.loads(line) for line in run["data"].read_text().splitlines()][-8:]
    convs = [[{"role": "system", "content": SYSTEM}, *r["messages"]] for r in rows]
    script = f"""
import os, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["TORCHDYNAMO_DISABLE"] = "1"
import torch
from vllm import LLM, SamplingParams
from transformers import AutoModelForCausalLM, AutoTokenizer
hf = "{run["run"] / "hf_final"}"
convs = json.loads({json.dumps(json.dumps(convs))})
llm = LLM(model=hf, enforce_eager=True, dtype="float32", distributed_executor_backend="uni",
          kv_cache_memory_bytes=1 << 27)
outs = llm.chat(convs, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
tok = AutoTokenizer.from_pretrained(hf)
m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
res = []
for conv, o in zip(convs, outs):
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    g = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    res.append({{"vllm_prompt": list(o.prompt_token_ids), "prompt": list(ids), "vllm": list(o.outputs[0].token_ids),
                 "hf": g, "text": o.outputs[0].text}})
print("RESULT", json.dumps(res))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    eos = set(json.loads((run["model"] / "generation_config.json").read_text())["eos_token_id"])
    for r, row in zip(res, rows):
        assert r["vllm_prompt"] == r["prompt"] == _template_ids(run["model"], row)
        assert r["vllm"] == r["hf"], r  # transformers stops on generation_config's EOS list too
        assert "<|im_end|>" not in r["text"]
    assert sum(r["vllm"][-1] in eos for r in res) >= 4  # greedy answers end at EOS
