"""Shared test helpers: run a worker script under torchrun, run ``megarl train`` end to end,
make a tiny HF model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
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
    """A random tiny Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral model saved by transformers itself (the
    independent oracle).

    ``extra``: more config keys (rope_scaling, attention_bias, norm_topk_prob, ...); ``dtype``:
    the saved tensors' dtype; ``qk_gain`` scales q/k projections so attention is sharp and
    position (RoPE) visibly changes the logits (random init attends almost uniformly).
    qwen3_moe: 4 experts of width 64, top-2, renormalised; its routers are scaled up so that
    routing margins stand far above fp32 noise (at init the routing probabilities are almost
    uniform, and a 1e-7 difference could swap an expert). mixtral: the same experts (width 64 =
    its intermediate_size), Llama attention, always renormalised.
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
    elif arch == "qwen3":  # head_dim × heads = 256 ≠ hidden_size 128, as in Qwen3-0.6B (128 × 16 ≠ 1024)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 64, **common}))
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        moe = dict(head_dim=32, num_experts=4, moe_intermediate_size=64, num_experts_per_tok=2, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**moe, **common}))
    elif arch == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        moe = dict(head_dim=32, num_local_experts=4, intermediate_size=64, num_experts_per_tok=2)
        model = MixtralForCausalLM(MixtralConfig(**{**common, **moe}))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(head_dim=32, **common))
    # transformers inits norms (Qwen3's q/k norms too) to 1 and biases to 0: perturb them so
    # the mapping is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_gain)
            if name.endswith("mlp.gate.weight"):  # a MoE router (std 0.02 at init; Mixtral's too, in memory)
                p.mul_(50.0)
    model.to(getattr(torch, dtype)).save_pretrained(str(path), safe_serialization=True)
    return path


def one_rank_group(tmp_path_factory: Any) -> Iterator[None]:
    """A one-rank gloo process group for a test module (``pytest.fixture``-wrapped by the module:
    code that broadcasts or all-reduces over it runs in the test process); kept if one exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


_CONVERT_PROBE = """
import json, sys
from megarl.convert import main
from megarl.errors import ConvertError
out = {}
for case, argv in json.loads(sys.argv[1]).items():
    try:
        main(argv)
        out[case] = "exit 0"
    except ConvertError as e:
        out[case] = str(e)
out["_megatron_imported"] = any(m.startswith("megatron") for m in sys.modules)
print(json.dumps(out))
"""


def convert_outcomes(argvs: dict[str, list[str]]) -> tuple[dict[str, str], bool]:
    """``megarl convert`` with each case's arguments, in one fresh interpreter: per case its
    ConvertError's text (or 'exit 0'), and whether megatron was imported by any of them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CONVERT_PROBE, json.dumps(argvs)], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got, bool(got.pop("_megatron_imported"))


def read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2-Instruct's template, shortened (default system turn, ChatML markers)."""
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama-3-Instruct's template, shortened (BOS first, header markers, <|eot_id|> ends a turn)."""


def tiny_hf_tokenizer(path: Path, style: str = "chatml", vocab: int = 300) -> Path:
    """A byte-level BPE trained with ``tokenizers`` on a synthetic corpus, saved with
    ``save_pretrained`` with a chat template and a ``generation_config.json`` as hub models
    ship them. ``chatml``: Qwen2-style, pad = <|endoftext|>, stop on [<|im_end|>, <|endoftext|>].
    ``llama3``: BOS <|begin_of_text|>, no pad token, stop on [<|end_of_text|>, <|eot_id|>]."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if style == "chatml":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    rng = random.Random(0)
    words = ["what", "is", "the", "sum", "of", "and", "answer", "user", "assistant", "system", "please", "add"]
    corpus = [" ".join(rng.choice(words) for _ in range(8)) + f" {rng.randrange(100)}+{rng.randrange(100)}="
              for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    if style == "chatml":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       chat_template=CHATML_TEMPLATE)
        gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
               "pad_token_id": tok.token_to_id("<|endoftext|>")}
    else:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
        ])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                       eos_token="<|end_of_text|>", chat_template=LLAMA3_TEMPLATE)
        gen = {"bos_token_id": bos,
               "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


def alive_processes(procs: list[Any]) -> list[Any]:
    """The psutil processes of ``procs`` still running (zombies count as gone)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
