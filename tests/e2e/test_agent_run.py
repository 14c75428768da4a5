"""``env.agent`` in a real run: a user's agent function, written against the OpenAI client, talks
to the run's endpoint for two calls per episode (its second request carries its own first answer
back as an assistant turn plus a user turn); megarl trains on the ids the engine generated.

Checks: the run completes; every episode made its calls (turns per episode ≥ 1, from the
recorded calls, no failures); the agent's own return value is each sample's reward; and the
trainer's log-probs of the generated ids equal the engine's within the integrity tolerance —
the recorded prompts, completions and observations line up id for id."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import megarl_train, read_json, tiny_hf_model, tiny_hf_tokenizer

AGENT = """
def agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="megarl", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "sure?"}]
    second = client.chat.completions.create(model="megarl", messages=messages, max_tokens=6)
    return 1.0 if (second.choices[0].message.content or "").strip() == row["answer"] else 0.25
"""


def test_agent_code_through_the_endpoint_trains_on_engine_ids(tmp_path: Path) -> None:
    model = tiny_hf_model(tmp_path / "model", arch="qwen2", vocab=300, extra={"max_position_embeddings": 128})
    tiny_hf_tokenizer(model, "chatml", vocab=300)
    with (tmp_path / "rows.jsonl").open("w") as fh:
        for i in range(48):
            fh.write(json.dumps({"prompt": f"add {i % 7}+{i % 5}=", "answer": str(i % 7 + i % 5)}) + "\n")
    (tmp_path / "my_agent.py").write_text(AGENT)
    run = tmp_path / "run"
    sets = [
        f"model.init_from={model}",
        "model.tokenizer=hf",
        f"data.source={tmp_path / 'rows.jsonl'}",
        "data.num_val=8",
        f"env.agent={tmp_path / 'my_agent.py'}:agent",
        "env.max_tokens=64",
        "rollout.max_prompt_len=40",
        "rollout.max_response_len=6",
        "rollout.num_prompts=4",
        "rollout.samples_per_prompt=4",
        "rollout.engine_logprobs_every=1",
        "rollout.dump_rollouts=true",
        "algo.mini_batches=2",  # π_old computed: the mismatch against the engine's log-probs is logged
        "parallel.micro_batch_size=8",
        "warm_start.steps=0",
        "train.steps=2",
        "train.eval_every=0",
        "coordinator.enabled=false",
        f"train.run_dir={run}",
    ]
    megarl_train("grpo_cpu.yaml", sets)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward_mean" in m]
    assert len(steps) == 2
    tol = read_json(run / "config.json")["weight_sync"]["integrity_tol"]
    for m in steps:
        assert m["env/failures"] == 0 and m["env/turns_mean"] >= 1.0
        assert m["rollout/mismatch_abs_logp_mean"] < tol
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4
    for row in rows:
        assert all(r in (0.25, 1.0) for r in row["rewards"]), row["rewards"]  # the agent's own reward
        for turns in row["turns"]:
            assert 1 <= len(turns) <= 2 and all(t["generated"] for t in turns)
