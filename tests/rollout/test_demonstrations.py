"""Demonstrated episodes for the warm start (``megarl.rollout.demonstrations``), on the built-in
``multiply`` task with the calculator: the built-in tokenizer learns the tool-call syntax from
the demonstrations; a demonstrated episode is the expert's call (learned), the calculator's real
answer rendered as in a rollout (given), then the answer (learned); packed, the mask is 1
exactly on the learned ids."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.data.prompts import multiplication_rows
from megarl.data.tokenizer import UNK, train_tokenizer
from megarl.data.turns import PlainTurns
from megarl.rewards.tool_calls import HermesParser
from megarl.rewards.tool_env import CalculatorEnv
from megarl.rollout.demonstrations import demonstrated, tokenizer_texts
from megarl.rollout.sampling import pack_trained


def test_demonstrated_episode_of_a_product(tmp_path: Path) -> None:
    rows = multiplication_rows(200, 1000, seed=0)
    assert all(100 <= int(a) < 1000 for r in rows for a in r.prompt.rstrip("=").split("*"))
    tok = train_tokenizer(tokenizer_texts("calculator", rows), tmp_path)
    turns = PlainTurns(tok)
    prompt, ids, trained = demonstrated(CalculatorEnv, turns, tok, rows[0])
    assert prompt == tok.encode_prompt(rows[0])
    # learned: the call (+ stop id), given: the tool's answer, learned: the answer (+ stop id)
    call = [i for i, t in zip(ids, trained, strict=True) if t][: ids.index(tok.eos_id) + 1]
    calls = HermesParser().parse(turns.action_text(call)).calls
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": rows[0].prompt.rstrip("=")})]
    observation = ids[len(call) : trained.index(1, len(call))]
    assert observation == tok.encode(f"<tool_response>\n{rows[0].answer}\n</tool_response>\n", bos=False)
    assert set(trained[len(call) : len(call) + len(observation)]) == {0}
    answer = ids[len(call) + len(observation) :]
    assert answer == [*tok.encode(rows[0].answer, bos=False), tok.eos_id] and set(trained[-len(answer) :]) == {1}
    assert UNK not in ids  # the tool-call syntax is in the vocabulary
    tokens, mask = pack_trained([(prompt, ids, trained)], tok.pad_id)
    learned = torch.nonzero(mask[0]).flatten() + 1  # the position each learned id is predicted at
    assert tokens[0, learned].tolist() == [i for i, t in zip(ids, trained, strict=True) if t]
