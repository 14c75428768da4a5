"""The model folder's HF tokenizer (megarl.data.hf_tokenizer) against transformers itself,
on locally built tokenizer folders (byte-level BPE + Qwen2-style ChatML / Llama-3-style
templates), and chat rows read from JSONL and from an HF ``save_to_disk`` folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, DataConfig
from megarl.data.hf_tokenizer import HFTokenizer
from megarl.data.prompts import PromptRecord, RolloutError, load_prompts
from tests.helpers import tiny_hf_tokenizer

ROWS = [
    PromptRecord("", "5", "r0", messages=[{"role": "user", "content": "what is 2+3="}]),
    PromptRecord(
        "",
        "7",
        "r1",
        messages=[
            {"role": "system", "content": "add the numbers"},
            {"role": "user", "content": "what is 3+3="},
            {"role": "assistant", "content": "6"},
            {"role": "user", "content": "and 3+4="},
        ],
    ),
    PromptRecord("please add 40+2=", "42", "r2"),  # a plain prompt becomes one user turn
]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def _template_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("system", ["", "be brief"])
def test_prompt_ids_equal_transformers_chat_template(folder: Path, system: str) -> None:
    tok = HFTokenizer(folder, "auto", system)
    for rec in ROWS:
        msgs = rec.messages or [{"role": "user", "content": rec.prompt}]
        if system and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": system}, *msgs]
        want = _template_ids(folder, msgs)
        assert tok.encode_prompt(rec) == want, rec.where
        assert len(want) > 8
    # the exact text the model was tuned on (independent of transformers' template machinery)
    text = tok.hf.decode(tok.encode_prompt(ROWS[0]))
    if folder.name.startswith("chatml"):
        sys_turn = system or "You are a helpful assistant."
        assert text == (
            f"<|im_start|>system\n{sys_turn}<|im_end|>\n<|im_start|>user\nwhat is 2+3=<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        sys_turn = f"<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>" if system else ""
        assert text == (
            f"<|begin_of_text|>{sys_turn}<|start_header_id|>user<|end_header_id|>\n\nwhat is 2+3=<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )


def test_special_ids_from_tokenizer_and_generation_config(folder: Path) -> None:
    tok = HFTokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    if folder.name.startswith("chatml"):
        assert tok.eos_ids == [ids["<|im_end|>"], ids["<|endoftext|>"]]
        assert tok.pad_id == ids["<|endoftext|>"] and tok.bos_id is None
    else:  # Llama-3 has no pad token: pad with the first EOS (only ever under loss mask 0)
        assert tok.eos_ids == [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        assert tok.bos_id == ids["<|begin_of_text|>"]
        assert tok.pad_id == tok.eos_ids[0]
    assert tok.vocab_size == 300


def test_answer_continuation_ends_at_the_turn_stop(folder: Path) -> None:
    tok = HFTokenizer(folder)
    rec = ROWS[0]
    ans = tok.encode_answer(rec)
    stop = "<|im_end|>" if folder.name.startswith("chatml") else "<|eot_id|>"
    assert tok.hf.convert_ids_to_tokens(ans[-1]) == stop and ans[-1] in tok.eos_ids
    assert tok.decode(ans) == "5"  # special tokens stripped from decoded responses
    # prompt + answer is exactly the templated conversation, up to the stop id
    full = tok.hf.apply_chat_template(
        [*rec.messages, {"role": "assistant", "content": "5"}],
        tokenize=True,
        return_dict=False,  # type: ignore[misc]
    )
    assert list(full[: len(tok.encode_prompt(rec)) + len(ans)]) == tok.encode_prompt(rec) + ans


def test_chat_template_none_and_file(folder: Path, tmp_path: Path) -> None:
    tok = HFTokenizer(folder, "none")
    ids = tok.encode_prompt(ROWS[2])
    assert tok.hf.decode(ids, skip_special_tokens=True) == "please add 40+2="
    with pytest.raises(RolloutError, match="r0: row has messages but no chat template"):
        tok.encode_prompt(ROWS[0])
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    tok = HFTokenizer(folder, str(tpl))
    assert tok.hf.decode(tok.encode_prompt(ROWS[0])) == "[user]what is 2+3=[assistant]"
    with pytest.raises(ConfigError, match="data.chat_template=nope.jinja"):
        HFTokenizer(folder, "nope.jinja")
    strict = tmp_path / "strict.jinja"  # like Gemma's / Mistral's: no system turn
    strict.write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    )
    tok = HFTokenizer(folder, str(strict), system_prompt="Be brief.")
    with pytest.raises(RolloutError, match=r"r0: the chat template .* refused this row's turns \['system', 'user'\]: "
                       "TemplateError: System role not supported"):
        tok.encode_prompt(ROWS[0])
    with pytest.raises(RolloutError, match="r0: the chat template") as refused:
        tok.encode_answer(ROWS[0])
    # the template that refused is the file in use, not the model folder's own
    assert f"r0: the chat template data.chat_template={strict} refused" in str(refused.value)
    assert str(folder) not in str(refused.value)
    with pytest.raises(ConfigError, match=f"model.tokenizer: {tmp_path}/none has no tokenizer.json.*no such folder"):
        HFTokenizer(tmp_path / "none")
    (tmp_path / "gen").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "gen" / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "gen/generation_config.json").write_text('{"eos_token_id": 2,')
    with pytest.raises(ConfigError, match="gen/generation_config.json: not valid JSON"):
        HFTokenizer(tmp_path / "gen")


def _chat_rows() -> list[dict[str, object]]:
    return [
        {
            "messages": [{"role": "user", "content": f"what is {i}+1="}],
            "answer": str(i + 1),
            "tests": [{"in": i, "out": i + 1}],
            "meta": {"id": f"q{i}"},
        }
        for i in range(6)
    ]


def _check_rows(train: list[PromptRecord]) -> None:
    assert len(train) == 4
    assert train[1].messages == [{"role": "user", "content": "what is 1+1="}]
    assert train[1].answer == "2" and train[1].prompt == "what is 1+1="  # the question, for rewards
    assert train[1].extra == {"answer": "2", "tests": [{"in": 1, "out": 2}], "meta": {"id": "q1"}}


def test_chat_rows_from_jsonl_keep_extra_fields(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _chat_rows()))
    train, val = load_prompts(DataConfig(source=str(path), num_val=2), 0)
    _check_rows(train)
    assert val[0].where == f"{path}:5"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(RolloutError, match=rf"{bad}:1: messages\[0\] must be an object with string 'role' and"):
        load_prompts(DataConfig(source=str(bad), num_val=0), 0)


def test_rows_from_datasets_save_to_disk_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(_chat_rows())
    ds.save_to_disk(str(tmp_path / "ds"))
    train, _ = load_prompts(DataConfig(source=str(tmp_path / "ds"), num_val=2), 0)
    _check_rows(train)
    assert train[1].where == f"{tmp_path / 'ds'}:row 1"
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    train, _ = load_prompts(DataConfig(source=str(tmp_path / "dd"), num_val=2), 0)
    _check_rows(train)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "only_test"))
    with pytest.raises(RolloutError, match="DatasetDict has splits \\['test'\\], no 'train' split"):
        load_prompts(DataConfig(source=str(tmp_path / "only_test"), num_val=2), 0)


def test_sentencepiece_tokenizer_model_folder(tmp_path: Path) -> None:
    """A Llama-2-style folder (``tokenizer.model`` only, no ``tokenizer.json``): ids equal
    SentencePiece's own; no pad token (pads with EOS); the template applies."""
    import io
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    words = ["what", "is", "the", "sum", "of", "and", "please", "add"]
    texts = [
        " ".join(rng.choice(words) for _ in range(8)) + f" {rng.randrange(100)}+{rng.randrange(100)}="
        for _ in range(400)
    ]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "chat_template": template,
            }
        )
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    plain = HFTokenizer(tmp_path, "none")
    for text in ("what is 3+4=", "please add the sum of 12+7=", "ünïcode ok"):
        assert plain.encode_prompt(PromptRecord(text, "", "x")) == [1, *sp.encode(text)]
    tok = HFTokenizer(tmp_path)
    assert (tok.eos_ids, tok.bos_id, tok.pad_id, tok.vocab_size) == ([2], 1, 2, 300)
    assert tok.encode_prompt(ROWS[0]) == _template_ids(tmp_path, ROWS[0].messages or [])
    assert tok.hf.decode(tok.encode_prompt(ROWS[0])) == "<s>[INST] what is 2+3= [/INST]"
    assert [f.name for f in tok.files()] == ["tokenizer.model", "tokenizer_config.json"]


def test_tokenizer_setting_picks_the_model_folders_own(folder: Path, tmp_path: Path) -> None:
    from megarl.config import ConfigError, RunConfig
    from megarl.data.hf_tokenizer import open_tokenizer
    from megarl.data.tokenizer import Tokenizer

    cfg = RunConfig()
    cfg.train.run_dir = str(tmp_path / "run")
    cfg.model.init_from = str(folder)  # model.tokenizer=auto: the folder has tokenizer files
    tok = open_tokenizer(cfg, [], train=False)
    assert isinstance(tok, HFTokenizer) and tok.folder == folder
    cfg.model.init_from, cfg.model.tokenizer = "", "hf"
    with pytest.raises(ConfigError, match="model.tokenizer=hf needs model.init_from"):
        open_tokenizer(cfg, [], train=False)
    cfg.model.tokenizer = str(folder)  # an explicit tokenizer folder
    assert open_tokenizer(cfg, [], train=False).eos_ids == HFTokenizer(folder).eos_ids
    cfg.model.tokenizer = "builtin"  # the demo's SentencePiece model, trained on the texts once
    texts = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    built = open_tokenizer(cfg, texts, train=True)
    assert isinstance(built, Tokenizer) and (tmp_path / "run" / "tokenizer" / "tokenizer.model").exists()


def test_builtin_tokenizer_exports_as_transformers_reads_it(tmp_path: Path) -> None:
    """A megarl export of a built-in-tokenizer run: transformers encodes every text as the
    built-in SentencePiece model does (BOS first, its whitespace rules) and decodes it back the
    same; ``model.tokenizer=auto`` on the folder gives the ids the model was trained on, also
    for an older export that holds only ``tokenizer.model`` (transformers alone drops the BOS)."""
    import random

    from transformers import AutoTokenizer

    from megarl.config import RunConfig
    from megarl.data.hf_tokenizer import open_tokenizer
    from megarl.data.tokenizer import Tokenizer, export_tokenizer_files, train_tokenizer

    rng = random.Random(0)
    words = "the cat sat on a mat what is plus minus times answer seven eleven apples".split()
    corpus = [" ".join(rng.choice(words) for _ in range(8)) + f" {rng.randint(0, 999)}+{rng.randint(0, 99)}=" for _ in range(300)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 9))) for _ in range(300)]
    texts += ["Q: 12+7= A:", "  two  spaces\tand a tab\n", "", "ünïcode ½ Ａ 42"]
    texts += ["".join(rng.choice("abcxyz0123 +=?\n\t é") for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for vocab in (48, 200):
        builtin = train_tokenizer(corpus, tmp_path / f"sp{vocab}", vocab_size=vocab)
        out = tmp_path / f"export{vocab}"
        out.mkdir()
        (out / "tokenizer.model").write_bytes(builtin.path.read_bytes())
        cfg = RunConfig()
        cfg.train.run_dir, cfg.model.init_from = str(tmp_path / "run"), str(out)
        old = open_tokenizer(cfg, [], train=False)  # a bare tokenizer.model: the built-in reading
        assert isinstance(old, Tokenizer)
        export_tokenizer_files([builtin.path], out)  # what hf_final/ and `convert megarl-to-hf` do
        hf = AutoTokenizer.from_pretrained(str(out))
        auto = open_tokenizer(cfg, [], train=False)
        assert isinstance(auto, HFTokenizer)
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf)) == (1, 2, 0, builtin.vocab_size)
        for text in texts:
            ids = builtin.encode(text)
            assert ids[0] == 1 and hf(text)["input_ids"] == ids, text
            assert auto.encode_prompt(PromptRecord(text, "", "x")) == ids == old.encode(text)
            assert auto.encode_answer(PromptRecord("p", text, "x")) == builtin.encode_answer(PromptRecord("p", text, "x"))
            if ids[1:2] != [3]:  # (a response that opens with <unk>: transformers keeps a space)
                assert hf.decode(ids, skip_special_tokens=True) == builtin.decode(ids), text


def test_auto_without_tokenizer_files_warns_and_an_untrainable_builtin_names_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An init_from folder with weights but no tokenizer: auto falls back to the built-in
    tokenizer, loudly; prompts the 48-piece built-in cannot cover give a config error naming
    model.tokenizer instead of sentencepiece's internal error."""
    import logging

    from megarl.config import ConfigError, RunConfig
    from megarl.data.hf_tokenizer import open_tokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    cfg = RunConfig()
    cfg.train.run_dir, cfg.model.init_from = str(tmp_path / "run"), str(bare)
    texts = [f"{a}+{b}={a + b}" for a in range(20) for b in range(20)]
    with caplog.at_level(logging.WARNING, logger="megarl"):
        open_tokenizer(cfg, texts, train=True)
    assert f"model.init_from={bare} has no tokenizer files" in caplog.text
    cfg.train.run_dir = str(tmp_path / "run2")
    words = ["".join(chr(0x4E00 + 7 * i + j) for j in range(3)) for i in range(40)]  # 120 distinct characters
    with pytest.raises(ConfigError, match="model.tokenizer='auto': the built-in tokenizer .48 pieces, for the "
                       "arithmetic demo. cannot be trained on these prompts .*give a tokenizer folder"):
        open_tokenizer(cfg, words * 5, train=True)


def test_decode_many_equals_one_decode_each(folder: Path, tmp_path: Path) -> None:
    """A round's responses are decoded in one call: the texts are those of one call per
    response, for the built-in SentencePiece model and HF tokenizers alike (special tokens,
    empty responses and ids past the text included)."""
    import random

    from megarl.data.tokenizer import train_tokenizer

    corpus = [f"{a}+{b}={a + b} and {a}-{b}={a - b}" for a in range(30) for b in range(30)]
    for tok in (HFTokenizer(folder, "auto"), train_tokenizer(corpus, tmp_path / "sp")):
        rng = random.Random(0)
        batch = [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))] for _ in range(200)]
        batch += [[], [tok.eos_id], [*tok.encode_prompt(PromptRecord("1+2=", "3", "x")), tok.eos_id]]
        texts = tok.decode_many(batch)
        assert texts == [tok.decode(ids) for ids in batch]
        assert len(set(texts)) > 100 and "" in texts
    assert train_tokenizer(corpus, tmp_path / "sp").decode_many([]) == []
