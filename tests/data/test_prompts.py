"""Prompt files, overlong prompts, the resumable sampler and the built-in rewards (failing
rewards: tests/rewards/test_runner.py)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import DataConfig, RunConfig
from megarl.data.prompts import (
    DataError,
    PromptRecord,
    PromptSampler,
    RolloutError,
    arithmetic_rows,
    load_prompts,
)
from megarl.data.tokenizer import train_tokenizer
from megarl.rollout.sampling import CollectSettings, PromptStats, overlong_summary, take_prompts


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_and_parquet_give_the_same_records(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    j = _jsonl(tmp_path / "p.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    tj, vj = load_prompts(DataConfig(source=str(j), num_val=3), seed=0)
    tp, vp = load_prompts(DataConfig(source=str(tmp_path / "p.parquet"), num_val=3), seed=0)
    assert [(r.prompt, r.answer) for r in tj + vj] == [(r.prompt, r.answer) for r in tp + vp]
    assert len(tj) == 7 and vj[-1].prompt == "9+1=" and tj[0].where.endswith("p.jsonl:1")


MIXED = [  # chat and plain rows, as one mixed-schema table holds them
    {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "what is 1+1="}],
     "answer": "2", "meta": {"id": "c0", "level": 3}},
    {"prompt": "2+2=", "answer": "4", "meta": {"id": "p1"}, "tests": [{"in": 2, "out": 4}]},
    {"messages": [{"role": "user", "content": "what is 3+3=", "name": "ann"}], "answer": "6"},
    {"prompt": "4+4=", "answer": "8"},
]  # fmt: skip


def _mixed_sources(tmp_path: Path) -> dict[str, Path]:
    """MIXED as JSONL (keys absent) and as Parquet and a ``save_to_disk`` folder (one schema:
    what a row lacks is null there, e.g. a chat row's ``prompt``, a plain row's ``messages``)."""
    import datasets

    table = pa.Table.from_struct_array(pa.array(MIXED))  # the union of the rows' fields
    assert table.to_pylist()[0]["prompt"] is None and table.to_pylist()[1]["messages"] is None
    assert table.to_pylist()[0]["messages"][0]["name"] is None
    pq.write_table(table, tmp_path / "m.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "m_ds"))
    return {"jsonl": _jsonl(tmp_path / "m.jsonl", MIXED), "parquet": tmp_path / "m.parquet", "disk": tmp_path / "m_ds"}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "disk"])
def test_null_fields_of_mixed_schema_rows_read_as_absent(tmp_path: Path, fmt: str) -> None:
    """A chat row's null ``prompt`` gives the reward its last user turn (not the text 'None'),
    and no field the reward gets (prompt, answer, messages, extra) holds a null another row's
    schema put there: every format gives the same records."""
    rows, _ = load_prompts(DataConfig(source=str(_mixed_sources(tmp_path)[fmt]), num_val=0), 0)
    assert [r.prompt for r in rows] == ["what is 1+1=", "2+2=", "what is 3+3=", "4+4="]
    assert [r.answer for r in rows] == ["2", "4", "6", "8"]
    assert [r.messages for r in rows] == [
        MIXED[0]["messages"],
        None,
        [{"role": "user", "content": "what is 3+3=", "name": "ann"}],
        None,
    ]
    assert [r.extra for r in rows] == [
        {"answer": "2", "meta": {"id": "c0", "level": 3}},
        {"answer": "4", "meta": {"id": "p1"}, "tests": [{"in": 2, "out": 4}]},
        {"answer": "6"},
        {"answer": "8"},
    ]
    (tmp_path / "null_answer.jsonl").write_text('{"prompt": "1+1=", "answer": null}\n')
    with pytest.raises(RolloutError, match=r"null_answer.jsonl:1: missing field 'answer' \(data.answer_key"):
        load_prompts(DataConfig(source=str(tmp_path / "null_answer.jsonl"), num_val=0), 0)


def test_custom_keys_and_several_files(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"q": "x", "a": "1"}] * 3)
    b = _jsonl(tmp_path / "b.jsonl", [{"q": "y", "a": "2"}] * 3)
    train, val = load_prompts(DataConfig(source=f"{a},{b}", prompt_key="q", answer_key="a", num_val=2), 0)
    assert [r.prompt for r in train] == ["x", "x", "x", "y"] and [r.answer for r in val] == ["2", "2"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2=", "answer": '], r"p.jsonl:2: invalid JSON"),
        (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2="}'], r"p.jsonl:2: missing field 'answer'"),
        (['["a", "b"]'], r"p.jsonl:1: row must be an object"),
        (['{"prompt": ["x"], "answer": "2"}'], r"p.jsonl:1: field 'prompt' must be a string"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(RolloutError, match=message):
        load_prompts(DataConfig(source=str(path), num_val=0), 0)


def test_unsupported_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(RolloutError, match="does not exist"):
        load_prompts(DataConfig(source=str(tmp_path / "none.jsonl")), 0)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(RolloutError, match="unsupported prompt file type"):
        load_prompts(DataConfig(source=str(tmp_path / "x.csv")), 0)


@pytest.mark.parametrize("mode", ["skip", "truncate"])
def test_overlong_prompts_are_counted(tmp_path: Path, mode: str) -> None:
    records = arithmetic_rows(20, 20, 0)
    long = [PromptRecord(prompt="1+" * 10 + "1=", answer="11", where=f"long:{i}") for i in range(5)]
    records = long + records
    tok = train_tokenizer([r.prompt + r.answer for r in records], tmp_path / "tok")
    cfg = RunConfig()
    cfg.rollout.max_prompt_len = 8
    cfg.data.overlong_prompt = mode  # type: ignore[assignment]
    stats = PromptStats()
    out = take_prompts(PromptSampler(len(records), 0, shuffle=False), records, tok, 10, CollectSettings.of(cfg), stats)
    assert len(out) == 10 and all(len(ids) <= 8 for _, ids in out)
    if mode == "skip":
        assert stats.skipped_overlong == 5 and stats.truncated_overlong == 0
        assert not any(rec.where.startswith("long") for rec, _ in out)
    else:
        assert stats.truncated_overlong == 5 and stats.skipped_overlong == 0
        assert out[0][1][0] == tok.bos_id and tok.decode(out[0][1]).endswith("1=")


def test_sampler_resume_replays_nothing() -> None:
    a = PromptSampler(7, seed=3)
    first = a.next(5)
    b = PromptSampler(7, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.next(12) == b.next(12)
    whole = PromptSampler(7, seed=3).next(17)
    assert whole[:5] == first
    assert sorted(whole[:7]) == list(range(7)) and sorted(whole[7:14]) == list(range(7))  # epochs are permutations


def test_answer_prefix_reward_ignores_the_tail() -> None:
    from megarl.rewards.builtin import answer_prefix

    cases = [("12 junk 7", 1.0), (" 12+3", 1.0), ("123", 1.0), ("x12", 0.0), ("1 2", 0.0), ("", 0.0), ("-4", 0.0)]
    assert [answer_prefix("5+7=", r, "12") for r, _ in cases] == [v for _, v in cases]
    assert answer_prefix("3-7=", "-4abc", "-4") == 1.0


def test_overlong_prompts_summarised_not_logged_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = [PromptRecord(prompt="1+" * 10 + "1=", answer="11", where=f"f.jsonl:{i}") for i in range(1, 4)]
    records += arithmetic_rows(20, 20, 0)
    tok = train_tokenizer([r.prompt + r.answer for r in records], tmp_path / "tok")
    cfg = RunConfig()
    cfg.rollout.max_prompt_len = 8
    stats = PromptStats()
    with caplog.at_level("WARNING"):
        take_prompts(PromptSampler(len(records), 0, shuffle=False), records, tok, 10, CollectSettings.of(cfg), stats)
    assert caplog.records == [] and stats.skipped_overlong == 3
    line = overlong_summary(stats.drain(), CollectSettings.of(cfg))
    assert line.startswith("skipped 3 prompts longer than rollout.max_prompt_len=8: f.jsonl:1 (")
    assert line.endswith("and 1 more") and stats.drain() == []


def test_answer_sequences_mask_each_answer_and_refuse_an_empty_one(tmp_path: Path) -> None:
    """``train.val_metric: answer_prob``: prompt ids then the answer's ids + EOS, the mask on
    exactly those; a row with an empty answer is named (file:line and data.answer_key)."""
    from megarl.rollout.sampling import answer_sequences

    records = arithmetic_rows(6, 20, 0)
    tok = train_tokenizer([r.prompt + r.answer for r in records], tmp_path / "tok")
    settings = CollectSettings.of(RunConfig())
    tokens, mask = answer_sequences(records, tok, settings)
    for b, r in enumerate(records):
        p, a = tok.encode_prompt(r), tok.encode_answer(r)
        assert tokens[b, : len(p) + len(a)].tolist() == p + a
        assert mask[b].nonzero()[:, 0].tolist() == list(range(len(p) - 1, len(p) + len(a) - 1))
    empty = PromptRecord(prompt="3+4=", answer=" ", where="val.jsonl:7")
    with pytest.raises(DataError, match=r"val.jsonl:7: field 'answer' \(data.answer_key\) is empty"):
        answer_sequences([*records, empty], tok, settings)
