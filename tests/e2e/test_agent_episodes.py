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

import pytest
from safetensors.torch import load_file

from megarl.data.tokenizer import Tokenizer
from tests.e2e.test_resume import _steps
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


SETS = [
    "train.eval_every=0",
    "warm_start.steps=20",
    "rollout.num_prompts=4",
    "rollout.samples_per_prompt=4",
    "rollout.num_engines=2",  # an episode's turns stay on its engine
    "parallel.micro_batch_size=8",
    "parallel.max_tokens_per_micro_batch=256",  # token-budget micro-batches of multi-turn episodes,
    "parallel.pack_sequences=true",  # packed padding-free (observation ids inside, masked)
    "rollout.dump_rollouts=true",
    "rollout.engine_logprobs_every=1",
    "algo.mini_batches=2",  # π_old computed: the mismatch against the engine's log-probs is logged
    "coordinator.enabled=false",
    "env.max_turns=4",
    "env.max_tokens=40",
]
PIPELINED = ["rollout.max_staleness=1", "algo.tis_cap=2"]
# wall-clock figures differ between two runs by design; so do the engine's log-prob values, in
# their last bits: which episodes share a generation call follows the environments' timing, and
# a batch of other shape rounds the engine's fp32 logits differently (the sampled ids do not
# change: each request's noise depends on its seed only). Everything else must not differ.
SKIP_PREFIXES = ("time", "timing/", "fleet/", "pipeline/trainer_wait", "pipeline/fleet_wait", "env/time",
                 "rollout/mismatch", "train/engine_")  # fmt: skip
SKIP_SUFFIXES = ("_s",)


def _env(folder: Path) -> str:
    env = folder / "count_env.py"
    if not env.exists():
        env.write_text(textwrap.dedent(ENV))
    return f"{env}:Count"


def _train(run: Path, steps: int, extra: list[str] | None = None) -> str:
    proc = megarl_train(
        "grpo_cpu.yaml", [*SETS, *(extra or []), f"env.fn={_env(run.parent)}", f"train.steps={steps}",
                          f"train.run_dir={run}"]
    )  # fmt: skip
    return proc.stdout + proc.stderr


def _assert_same_run(a: Path, b: Path, n: int, weights_tol: float = 0.0) -> None:
    """Metric for metric (wall-clock figures and the engine's log-prob values aside) and equal
    final weights: bitwise by default; with ``weights_tol`` the training metrics (``train/``)
    within the same relative tolerance, everything else still exact."""
    sa, sb = _steps(a), _steps(b)
    assert sorted(sa) == sorted(sb) == list(range(1, n + 1))
    for s in sa:
        ka = {k: v for k, v in sa[s].items() if not k.startswith(SKIP_PREFIXES) and not k.endswith(SKIP_SUFFIXES)}
        kb = {k: v for k, v in sb[s].items() if not k.startswith(SKIP_PREFIXES) and not k.endswith(SKIP_SUFFIXES)}
        assert ka.keys() == kb.keys(), (s, sorted(ka.keys() ^ kb.keys()))
        differ = {k: (v, kb[k]) for k, v in ka.items() if v != kb[k]}
        if weights_tol:
            differ = {k: v for k, v in differ.items() if not (k.startswith("train/") and v[0] == pytest.approx(v[1], rel=weights_tol))}
        assert differ == {}, s
        assert ka["env/turns_mean"] > 1.5
    wa, wb = load_file(str(a / "hf_final/model.safetensors")), load_file(str(b / "hf_final/model.safetensors"))
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) <= weights_tol


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 3-step multi-turn run: the token-identity check reads it and the resume
    check compares against it."""
    run = tmp_path_factory.mktemp("episodes") / "full"
    _train(run, 3)
    return run


def test_multi_turn_episodes_are_token_exact(full: Path) -> None:
    run = full
    tok = Tokenizer(run / "tokenizer" / "tokenizer.model")
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 4  # steps × prompts
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
    assert len(steps) == 3
    for step, m in enumerate(steps, 1):  # what the step counts (and the coordinator is told): generated ids only
        generated = sum(len(t["generated"]) for row in rows if row["step"] == step for ts in row["turns"] for t in ts)
        assert m["rollout/tokens"] == generated and m["rollout/responses"] == 16
    for m in steps:
        assert m["rollout/mismatch_abs_logp_mean"] < read_json(run / "config.json")["weight_sync"]["integrity_tol"]
        assert m["env/turns_mean"] > 1.5 and m["env/failures"] == 0
        assert m["env/tool_calls_mean"] == m["env/turns_mean"]  # one per step() call
        assert m["env/same_engine_frac"] == 1.0  # every later turn on its episode's engine (two engines)
        assert 0.0 <= m["env/time_frac"] < 1.0


def test_multi_turn_run_resumes_exactly(full: Path, tmp_path: Path) -> None:
    """Stopped after step 2 and resumed: the run equals the uninterrupted one, final weights
    bitwise (episodes are seeded per step, episode and turn; the environments start afresh each
    episode; the engine's log-probs do not enter this loss)."""
    parts = tmp_path / "parts"
    _train(parts, 2)
    log = _train(parts, 3)
    assert "resumed from" in log and "at step 2" in log
    _assert_same_run(full, parts, 3)


def test_multi_turn_pipelined_run_resumes_exactly(tmp_path: Path) -> None:
    """With rollout.max_staleness=1 the episodes of step s+1 run while step s trains; a run
    stopped after step 2 (its checkpoint holding step 3's episodes, generated ahead) and resumed
    equals the uninterrupted one."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _train(whole, 3, PIPELINED)
    steps = _steps(whole)
    assert [steps[s]["pipeline/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    _train(parts, 2, PIPELINED)
    state = json.loads((parts / "checkpoints" / "step_00000002" / "state.json").read_text())
    (ahead,) = state["rollouts"]["ahead"]
    assert ahead["step"] == 2 and ahead["batch"]["turn_rewards"]  # step 3's episodes, per-turn rewards and all
    log = _train(parts, 3, PIPELINED)
    assert "resumed from" in log and "at step 2" in log
    # decoupled PPO weights each token by π_prox / π_behaviour: the engine's log-probs enter the
    # loss, and their last bits follow the batching (SKIP_PREFIXES); weights bitwise in the runs
    # seen (2026-12-06), bounded here (and the train/ metrics) as tests/e2e/test_resume.py does
    _assert_same_run(whole, parts, 3, weights_tol=1e-6)


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
