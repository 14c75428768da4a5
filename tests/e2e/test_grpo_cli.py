"""A short end-to-end GRPO run through the real entry point (`megarl train`): TP=2 trainer
ranks under torchrun, a real vLLM engine, weight sync every step, metrics in JSONL and
TensorBoard, and an exported HF folder that transformers loads."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.metrics import read_metrics
from tests.helpers import ROOT, megarl_train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("grpo") / "run"
    # validation every 64 responses (steps 2 and 4); the sample budget stops the run after step 4
    sets = ["train.steps=6", "train.eval_every=0", "train.eval_every_samples=64", "train.max_samples=128",
            "warm_start.steps=20", "rollout.num_prompts=8",
            "coordinator.min_prompts=4",  # the demo's coordinator stays on (4 steps < its warm-up)
            # it measures the noise split by prompt (micro-batches of 2: each group's halves) and
            # plans prompts and samples, but holds them (min_dof out of reach in 4 steps)
            "coordinator.choose=prompts_and_samples", "coordinator.min_dof=1000",
            "rollout.samples_per_prompt=4", "parallel.micro_batch_size=2", "data.num_train=2000",
            "data.num_val=32", "weight_sync.integrity_every=2",
            "rollout.engine_logprobs_every=3",  # steps 1 and 4 ask the engine for log-probs, 2 and 3 do not
            f"train.run_dir={run}"]
    proc = megarl_train("grpo_cpu.yaml", sets)
    (run / "stdout.log").write_text(proc.stdout + proc.stderr)
    return run


def test_loop_ran_synced_and_logged(run_dir: Path) -> None:
    recs = read_metrics(run_dir)
    steps = [r for r in recs if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # every step sampled with the weights pushed after the previous step
    assert [r["rollout/policy_version"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        for key in ("timing/step/generate", "timing/step/logprobs", "timing/step/update", "timing/step/sync",
                    "train/kl", "train/lr", "train/loss", "train/grad_norm",
                    "rollout/responses", "rollout/reward_failures"):
            assert key in r, key
        assert r["rollout/responses"] == 32
        assert r["train/grad_norm"] >= 0
        # engine log-probs of the sampled tokens on steps 1 and 4 only (rollout.engine_logprobs_every=3):
        # the train/inference mismatch on those steps, and no mismatch metric on the others
        if r["step"] in (1, 4):
            assert 0 < r["train/engine_logprob_absdiff"] < 2e-3
            assert 1.0 <= r["train/engine_prob_ratio_max"] < 1.01
        else:
            assert not any(k.startswith(("train/engine_", "rollout/mismatch_")) for k in r), r["step"]
    # step s pushes version s + 1; integrity_every=2 checks the even versions (and version 1 at start)
    assert [r["step"] for r in steps if "sync/integrity_max_abs_diff" in r] == [1, 3]
    assert all(r["sync/integrity_max_abs_diff"] < 1e-3 for r in steps if "sync/integrity_max_abs_diff" in r)
    # (a step whose groups all have equal rewards, with the actor still at the reference, has
    # zero gradient; some step must have had signal)
    assert any(r["train/grad_norm"] > 0 for r in steps)
    # the noise split by prompt, from the probe's halves of each group (coordinator.choose=prompts_and_samples)
    split = [r for r in steps if "coord/noise_within/actor" in r]
    assert split and all(r["coord/samples_per_prompt"] == 4 for r in steps), [r.get("coord/samples_per_prompt") for r in steps]
    for r in split:
        assert math.isfinite(r["coord/noise_between/actor"]) and r["coord/noise_within/actor"] > 0
        assert 0 <= r["coord/noise_within_share/actor"] <= 1
        assert r["coord/effective_batch"] > 0
    vals = [r for r in recs if "val/reward" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    assert list((run_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    log = (run_dir / "stdout.log").read_text()
    assert "step 4/6" in log and "summary" in log and "128 responses trained (train.max_samples=128)" in log
    # rollout.engine_threads=0 (auto), staleness 0: the one engine generates on every core the
    # trainer may use (it waits meanwhile); torch in the engine process says how many it got
    assert f"torch threads {len(os.sched_getaffinity(0))}" in (run_dir / "logs" / "engine0.log").read_text()


def test_exported_actor_loads_in_transformers(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenizer import Tokenizer

    hf = run_dir / "hf_final"
    cfg = json.loads((hf / "config.json").read_text())
    tok = Tokenizer(hf / "tokenizer.model")
    assert cfg["vocab_size"] == tok.vocab_size and cfg["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    ids = torch.tensor([tok.encode("3+4=")])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.shape == (1, ids.shape[1], tok.vocab_size)


def test_dapo_options_through_the_loop(tmp_path: Path) -> None:
    """Dynamic sampling (refill to the planned batch), overlong soft penalty + filter, TIS,
    clip-higher, Dr.GRPO advantages and aggregation, all wired through one real run."""
    run = tmp_path / "run"
    sets = ["train.steps=3", "train.eval_every=0", "warm_start.steps=40", "rollout.num_prompts=8",
            "coordinator.enabled=false",
            "rollout.samples_per_prompt=4", "parallel.micro_batch_size=16", "data.num_train=2000",
            "data.num_val=16", "algo.dynamic_sampling=true", "algo.max_sampling_rounds=3",
            "algo.overlong_buffer_len=2", "algo.overlong_filter=true", "algo.tis_cap=2.0", "algo.clip_high=0.28",
            "algo.advantage=drgrpo", "algo.loss_agg=seq-mean-token-sum-norm", "train.tensorboard=false",
            f"train.run_dir={run}"]
    megarl_train("grpo_cpu.yaml", sets)
    steps = [r for r in read_metrics(run) if "rollout/reward_mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["rollout/responses"] == 32  # always the planned batch
        assert 1 <= r["rollout/sampling_rounds"] <= 3
        # dropped groups trigger another round unless the rounds ran out (then filled, counted)
        if r["rollout/dropped_groups"] > 0:
            assert r["rollout/sampling_rounds"] > 1 or r["rollout/filled_without_signal"] > 0
        # train/inference mismatch on the sampled tokens, every step (first update = old policy)
        # (algo.tis_cap > 0: the loss reads the engine's log-probs, so every step asks for them)
        assert 0 < r["train/engine_logprob_absdiff"] < 2e-3
        assert 1.0 <= r["train/engine_prob_ratio_max"] < 1.01


def test_exported_actor_loads_in_vllm_directly(run_dir: Path) -> None:
    """vLLM (CPU build) loads the exported folder with its own loader (no megarl sync) and
    its greedy continuation equals transformers' on the same prompt."""
    script = f"""
import os, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["TORCHDYNAMO_DISABLE"] = "1"
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from transformers import AutoModelForCausalLM
from megarl.data.tokenizer import Tokenizer
hf = "{run_dir / 'hf_final'}"
tok = Tokenizer(hf + "/tokenizer.model")
ids = tok.encode("7+5=")
llm = LLM(model=hf, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
          distributed_executor_backend="uni", kv_cache_memory_bytes=1 << 27)
out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                   SamplingParams(max_tokens=6, temperature=0.0, detokenize=False), use_tqdm=False)
v = list(out[0].outputs[0].token_ids)
m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
g = m.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_id,
               pad_token_id=tok.pad_id)[0, len(ids):].tolist()
print("RESULT", json.dumps({{"vllm": v, "hf": g}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    n = len(res["vllm"])
    assert n >= 1 and res["vllm"] == res["hf"][:n]
