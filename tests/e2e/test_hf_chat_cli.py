"""Train your own model, end to end through `megarl train`: a tiny Qwen2 saved by
transformers with a locally trained byte-level BPE tokenizer, ChatML template and
generation config (as hub models ship them), chat and plain rows mixed in one schema in
each of JSONL, Parquet and a ``datasets`` ``save_to_disk`` folder (a chat row's ``prompt`` and
a plain row's ``messages`` are null there, as are the fields only the other kind has).

Checks: the prompt ids megarl sent to vLLM equal transformers' ``apply_chat_template``
ids; a user reward gets each row's question as ``prompt`` (never the text 'None') and no
null field in ``extra`` or ``messages``, from all three formats; responses end at the tokenizer's EOS; ``hf_final/`` and ``megarl convert
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
from typing import Any

import pytest

from megarl.metrics import read_metrics
from tests.helpers import ROOT, megarl_train, tiny_hf_model, tiny_hf_tokenizer

SYSTEM = "please add"
NUM_VAL = 16
REWARD = """
import json
from pathlib import Path


def reward(response, prompt, answer, messages, extra):
    with open(Path(__file__).parent / "seen.jsonl", "a") as fh:
        fh.write(json.dumps(dict(prompt=prompt, answer=answer, messages=messages, extra=extra)) + "\\n")
    return 1.0 if response.strip() == answer else 0.0
"""
"""The run's reward: ``exact_match`` (the default for a data file), recording what it was given."""
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("hfchat")
    model = tiny_hf_model(base / "model", arch="qwen2", vocab=300)
    tiny_hf_tokenizer(model, "chatml", vocab=300)  # tokenizer files + generation_config.json
    rows, where = _mixed_data(base)
    (base / "score.py").write_text(REWARD)
    out = base / "run"
    sets = [
        f"model.init_from={model}",
        "model.tokenizer=hf",
        f"data.source={','.join(str(base / n) for n in ('rows.jsonl', 'rows.parquet', 'rows_ds'))}",
        f"data.num_val={NUM_VAL}",
        f"reward.fn={base / 'score.py'}:reward",
        "reward.workers=1",
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
    return {"model": model, "run": out, "rows": rows, "where": where, "seen": base / "seen.jsonl"}


def _mixed_data(base: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """64 rows, chat and plain alternating, each with an ``id``; chat rows also have ``source``,
    plain rows ``difficulty``. Rows 0-39 go to JSONL (with the nulls written out, as a Parquet
    export to JSONL has them), 40-51 to Parquet, 52-63 to a ``save_to_disk`` folder; the last
    NUM_VAL rows (Parquet and the folder) are the validation set. Returns the rows as written
    without their nulls, and each row by its ``where`` (as megarl names it)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    for i in range(64):
        a, b = rng.randrange(20), rng.randrange(20)
        question, row = f"what is {a}+{b}=", {"answer": str(a + b), "id": i}
        if i % 2 == 0:
            row.update(messages=[{"role": "user", "content": question}], source="chat")
        else:
            row.update(prompt=question, difficulty="hard" if a + b > 20 else "easy")
        rows.append(row)
    table = pa.Table.from_struct_array(pa.array(rows))  # one schema: what a row lacks is null
    assert table.slice(0, 1).to_pylist()[0]["prompt"] is None
    full = table.to_pylist()
    (base / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:40]))
    pq.write_table(table.slice(40, 12), base / "rows.parquet")
    datasets.Dataset(table.slice(52, 12)).save_to_disk(str(base / "rows_ds"))
    where = {f"{base / 'rows.jsonl'}:{i + 1}": rows[i] for i in range(40)}
    where.update({f"{base / 'rows.parquet'}:row {i}": rows[40 + i] for i in range(12)})
    where.update({f"{base / 'rows_ds'}:row {i}": rows[52 + i] for i in range(12)})
    return rows, where


def _turns(row: dict[str, Any]) -> list[dict[str, str]]:
    """The row's conversation: its messages, or its prompt as one user turn."""
    return list(row["messages"]) if "messages" in row else [{"role": "user", "content": row["prompt"]}]


def _template_ids(model: Path, row: dict[str, Any]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    msgs = [{"role": "system", "content": SYSTEM}, *_turns(row)]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_prompt_ids_sent_to_vllm_equal_chat_template_ids(run: dict[str, Any]) -> None:
    dumped = [json.loads(line) for line in (run["run"] / "rollouts.jsonl").read_text().splitlines()]
    assert sorted({d["step"] for d in dumped}) == [1, 2] and len(dumped) == 8
    for d in dumped:
        assert d["prompt_ids"] == _template_ids(run["model"], run["where"][d["where"]]), d["where"]
    assert [r["step"] for r in read_metrics(run["run"]) if "rollout/reward_mean" in r] == [1, 2]


def test_reward_gets_mixed_schema_rows_without_nulls(run: dict[str, Any]) -> None:
    """What the user reward received for every sample of the run (validation at start and end,
    2 steps × 4 prompts × 4 samples): each row's question as ``prompt``, its messages or None,
    and its other fields with none of the nulls the shared schema gave it."""
    seen = [json.loads(line) for line in run["seen"].read_text().splitlines()]
    assert len(seen) == 2 * NUM_VAL + 2 * 4 * 4
    for s in seen:
        row = run["rows"][s["extra"]["id"]]
        assert s["prompt"] == _turns(row)[-1]["content"] and s["prompt"].startswith("what is "), s
        assert s["answer"] == row["answer"] and s["messages"] == row.get("messages"), s
        assert s["extra"] == {k: v for k, v in row.items() if k not in ("prompt", "messages")}, s
    ids = {s["extra"]["id"] for s in seen}
    assert {i for i in ids if i % 2 == 0} and {i for i in ids if i % 2}  # chat and plain rows
    assert {"jsonl" if i < 40 else "parquet" if i < 52 else "folder" for i in ids} == {"jsonl", "parquet", "folder"}


def test_responses_end_at_the_tokenizer_eos(run: dict[str, Any]) -> None:
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


def test_export_carries_the_tokenizer_files_unchanged(run: dict[str, Any]) -> None:
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


def test_export_loads_in_transformers_and_vllm_with_identical_greedy_output(run: dict[str, Any]) -> None:
    rows = run["rows"][-8:]
    convs = [[{"role": "system", "content": SYSTEM}, *_turns(r)] for r in rows]
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
