"""Make the three things "train your own model" needs, locally and deterministically, so
``examples/byo_chat_math.yaml`` runs on a machine with no network:

1. ``problems.jsonl`` — word problems ("Tom has 7 apples and buys 5 more. How many apples
   does Tom have?") as chat rows: ``messages`` (one user turn), ``answer`` (``\\boxed{12}``,
   what the ``math`` reward compares the response's last ``\\boxed{}`` with and what the warm
   start teaches as the assistant turn) and an extra ``number`` field. Operands are < 20,
   differences are never negative. The train/validation split is by problem: every
   validation problem text is absent from the training rows (the same number pair may occur
   in training under another wording or name). The LAST ``NUM_VAL`` rows are the validation
   set, as ``data.num_val`` reads a file.
2. a byte-level BPE tokenizer trained with ``tokenizers`` on those problems (digits split one
   per token, ChatML special tokens), saved by transformers with a Qwen2-style chat template
   and a ``generation_config.json`` — the files a hub model ships;
3. a small random Qwen2 (4 layers, width 128, head_dim 32: vLLM's CPU build needs head_dim
   in {32, 64, ...}) saved with ``save_pretrained`` into the same folder.

Same seed, same files (byte for byte for the data and tokenizer; the weights come from
``torch.manual_seed``).

    python examples/make_byo_model.py --out runs/byo     # → runs/byo/model/, runs/byo/problems.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

NUM_VAL = 128
"""Validation rows at the end of problems.jsonl (``data.num_val`` in byo_chat_math.yaml)."""
NUM_TRAIN = 4000
"""Training rows (drawn with replacement from the problems not held out)."""
MAX_OPERAND = 20
"""Operands are drawn from [0, MAX_OPERAND)."""

NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Zoe", "Max", "Eva"]
ITEMS = ["apples", "pears", "cookies", "marbles", "books", "pens", "cards", "shells"]
TEMPLATES: list[tuple[str, str]] = [  # (operation, text)
    ("+", "{n} has {a} {i} and buys {b} more. How many {i} does {n} have?"),
    ("+", "There are {a} {i} in a box. {n} puts in {b} more. How many {i} are in the box now?"),
    ("+", "{n} found {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} find?"),
    ("-", "{n} has {a} {i} and gives {b} to a friend. How many {i} does {n} have left?"),
    ("-", "There are {a} {i} on the table. {n} takes {b} of them. How many {i} are still on the table?"),
    ("-", "{n} had {a} {i} and lost {b}. How many {i} does {n} have now?"),
]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nSolve the problem. Put the answer in \\\\boxed{}.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2-Instruct's template, shortened: a default system turn, ChatML markers."""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def problem(rng: random.Random) -> dict[str, Any]:
    """One random word problem as a chat row (the answer is never negative)."""
    op, text = rng.choice(TEMPLATES)
    a, b = rng.randrange(MAX_OPERAND), rng.randrange(MAX_OPERAND)
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b
    content = text.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
    return {"messages": [{"role": "user", "content": content}], "answer": f"\\boxed{{{value}}}", "number": value}


def make_rows(seed: int) -> list[dict[str, Any]]:
    """NUM_TRAIN training rows, then NUM_VAL validation rows whose texts never occur in training."""
    rng = random.Random(seed)
    val: dict[str, dict[str, Any]] = {}
    while len(val) < NUM_VAL:
        row = problem(rng)
        val.setdefault(row["messages"][0]["content"], row)
    train = []
    while len(train) < NUM_TRAIN:
        row = problem(rng)
        if row["messages"][0]["content"] not in val:
            train.append(row)
    return train + list(val.values())


def make_tokenizer(rows: list[dict[str, Any]], out: Path, vocab: int) -> dict[str, int]:
    """Byte-level BPE on the problems + answers, saved with the chat template; returns the
    special token ids and the vocabulary size reached (at most ``vocab``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits one per token (as Qwen2/Llama-3 pre-tokenizers split numbers), then byte-level
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the conversations as the template writes them (markers aside), so role names and the
    # system turn become a few tokens each
    system = "system\nSolve the problem. Put the answer in \\boxed{}.\n"
    corpus = [f"{system}user\n{r['messages'][0]['content']}\nassistant\n{r['answer']}" for r in rows]
    tok.train_from_iterator(corpus, trainer)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )
    fast.save_pretrained(str(out))
    return {**ids, "vocab_size": tok.get_vocab_size()}


def make_model(out: Path, ids: dict[str, int], seed: int) -> None:
    """A random Qwen2 sized for a 2-core CPU (~0.9M parameters), saved by transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=ids["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,  # head_dim 32
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    Qwen2ForCausalLM(config).save_pretrained(str(out), safe_serialization=True)
    # generation stops at the end of the assistant turn or of the text, as hub chat models ship it
    # (written after save_pretrained, which writes one from the model config)
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_all(out: Path, seed: int = 0, vocab: int = 384) -> tuple[Path, Path]:
    """Write ``out/problems.jsonl`` and the HF folder ``out/model``; return both paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(seed)
    data = out / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = out / "model"
    model.mkdir(exist_ok=True)
    ids = make_tokenizer(rows[:-NUM_VAL], model, vocab)
    make_model(model, ids, seed)
    return model, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/byo"), help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="data, tokenizer and weight seed")
    ap.add_argument("--vocab", type=int, default=384, help="BPE vocabulary size (= the model's vocab_size)")
    args = ap.parse_args()
    model, data = make_all(args.out, args.seed, args.vocab)
    print(f"model: {model}\ndata: {data} ({NUM_TRAIN} train rows, then {NUM_VAL} validation rows)")


if __name__ == "__main__":
    main()
