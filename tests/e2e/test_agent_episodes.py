"""Multi-turn episodes in a real run (``env.fn``: megatron trainer ranks + a vLLM engine):

* token identity, from ``rollouts.jsonl``: every episode's trained ids are the prompt, then
  turn by turn the engine's ids and the observation rendered alone (here the environment's
  text turn ``=<n>`` and a newline, through the run's own tokenizer); episodes run several turns;
* the trainer's log-probs of the generated ids, over the packed episode with its observations,
  equal the engine's within the integrity tolerance (``rollout/mismatch_abs_logp_mean``) —
  the alignment of ids, masks and log-probs checked by the models themselves;
* the environment's metrics and rewards reach the step log;
* a user environment that raises or hangs (in its worker process, killed at ``env.timeout_s``)
  ends only its episodes: the run completes, the failures counted by kind in the step's metrics,
  each failed episode rewarded ``env.failed_reward``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from megarl.data.tokenizer import Tokenizer
from tests.helpers import megarl_train, read_json

ENV = """
class Count:
    \"\"\"Answers every turn with '=<turn>' for two turns, then ends the episode (reward 0.25 a step).\"\"\"

    def reset(self, row):
        self.turn = 0

    def step(self, action):
        self.turn += 1
        done = self.turn >= 3
        return ("" if done else f"={self.turn}"), 0.25, done, {"tool_calls": 1}
"""


def test_multi_turn_episodes_are_token_exact(tmp_path: Path) -> None:
    env = tmp_path / "count_env.py"
    env.write_text(textwrap.dedent(ENV))
    run = tmp_path / "run"
    sets = [
        f"train.run_dir={run}",
        "train.steps=2",
        "train.eval_every=0",
        "warm_start.steps=20",
        "rollout.num_prompts=4",
        "rollout.samples_per_prompt=4",
        "parallel.micro_batch_size=8",
        "rollout.dump_rollouts=true",
        "rollout.engine_logprobs_every=1",
        "algo.mini_batches=2",  # π_old computed: the mismatch against the engine's log-probs is logged
        "coordinator.enabled=false",
        f"env.fn={env}:Count",
        "env.max_turns=4",
        "env.max_tokens=40",
    ]
    megarl_train("grpo_cpu.yaml", sets)
    tok = Tokenizer(run / "tokenizer" / "tokenizer.model")
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4  # steps × prompts
    turns_seen = []
    for row in rows:
        for response, turns in zip(row["response_ids"], row["turns"], strict=True):
            assert response == [x for t in turns for x in (*t["generated"], *t["observation"])]
            for i, t in enumerate(turns[:-1]):  # every turn but the last is followed by its observation
                assert t["observation"] == tok.encode(f"={i + 1}\n", bos=False)
            assert turns[-1]["observation"] == []
            turns_seen.append(len(turns))
        # the environment's three step rewards + the final answer's arithmetic score (0 or 1)
        assert all(r in (0.75, 1.75) for r in row["rewards"]), row["rewards"]
    assert max(turns_seen) == 3 and min(turns_seen) >= 1  # (a turn cut at its limit ends the episode)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward_mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/mismatch_abs_logp_mean"] < read_json(run / "config.json")["weight_sync"]["integrity_tol"]
        assert m["env/turns_mean"] > 1.5 and m["env/failures"] == 0
        assert m["env/tool_calls_mean"] == m["env/turns_mean"]  # one per step() call


FAULTY = """
import os, time

CLAIMS, FIRST = {claims!r}, {first}


class Faulty:
    \"\"\"Count's turns; of the training episodes, the first to reset hangs at its first step and
    the next three raise there (episodes are numbered as they reset, over the whole run).\"\"\"

    def reset(self, row):
        self.turn, self.n = 0, _claim()

    def step(self, action):
        if self.n == FIRST:
            time.sleep(600)
        if FIRST < self.n <= FIRST + 3:
            raise RuntimeError(f"tool backend down (episode {{self.n}})")
        self.turn += 1
        done = self.turn >= 3
        return ("" if done else f"={{self.turn}}"), 0.25, done, {{"tool_calls": 1}}


def _claim():
    \"\"\"The next number over the whole run, across worker processes.\"\"\"
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(CLAIMS, str(n)), os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1
"""


def test_a_faulty_environment_ends_only_its_episodes(tmp_path: Path) -> None:
    """User environments in worker processes: one hangs (killed at env.timeout_s), three raise;
    the run completes, the failures counted in the step's metrics and logged, the failed
    episodes rewarded env.failed_reward, the others unaffected."""
    claims = tmp_path / "claims"
    claims.mkdir()
    env = tmp_path / "faulty_env.py"
    env.write_text(textwrap.dedent(FAULTY.format(claims=str(claims), first=8)))  # after the 8 validation episodes
    run = tmp_path / "run"
    sets = [
        f"train.run_dir={run}",
        "train.steps=2",
        "train.eval_every=0",
        "warm_start.steps=5",
        "data.num_val=8",
        "rollout.num_prompts=4",
        "rollout.samples_per_prompt=4",
        "parallel.micro_batch_size=8",
        "rollout.dump_rollouts=true",
        "coordinator.enabled=false",
        f"env.fn={env}:Faulty",
        "env.max_turns=4",
        "env.max_tokens=40",
        "env.timeout_s=3",
        "env.workers=16",  # one episode per worker: no episode shares the hung one's worker
        "env.failed_reward=-1",
    ]
    proc = megarl_train("grpo_cpu.yaml", sets)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward_mean" in m]
    assert len(steps) == 2
    kinds = ("failures", "timeouts", "crashes", "errors")
    assert [[m[f"env/{k}"] for k in kinds] for m in steps] == [[4.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]]
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    rewards = [[r for row in rows if row["step"] == s for r in row["rewards"]] for s in (1, 2)]
    assert [sum(r == -1.0 for r in step) for step in rewards] == [4, 0]  # a failed episode's whole reward
    assert all(r >= 0.25 for step in rewards for r in step if r != -1.0)  # the others: their step rewards
    log = proc.stdout + proc.stderr
    assert (
        "step 1: 4 of 16 episodes failed in their environment and got env.failed_reward=-1 "
        "(1 timed out, 0 lost their worker, 3 raised or returned something unusable); e.g." in log
    )
    assert "RuntimeError: tool backend down" in log
    assert 3.0 <= steps[0]["timing/step/generate"] < 60  # the hung environment cost its 3 s, not its 600
