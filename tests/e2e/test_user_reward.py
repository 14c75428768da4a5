"""``megarl train`` with a user reward from a temporary folder that kills its interpreter once
and hangs past ``reward.timeout_s`` twice: the run completes, the metrics count exactly those
failures, one log line names a sample, and the reward saw decoded text without special tokens."""

import json
import textwrap
from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import megarl_train

NUM_VAL = 8

# Calls are numbered across worker processes with an O_APPEND counter file: each call appends one
# byte and the offset after its write is its own number. Validation at the start makes calls
# 1..NUM_VAL, so the failures below land in step 1.
REWARD = f'''
import json, os, time
from pathlib import Path

HERE = Path(__file__).parent


def _call_number():
    fd = os.open(HERE / "calls", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, b".")
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def reward(response, prompt, answer, extra):
    n = _call_number()
    with open(HERE / "seen.jsonl", "a") as fh:
        fh.write(json.dumps(dict(n=n, response=response, prompt=prompt, answer=answer, extra=extra)) + "\\n")
    if n == {NUM_VAL} + 3:
        os._exit(1)
    if n in ({NUM_VAL} + 5, {NUM_VAL} + 9):
        time.sleep(300)
    return 1.0 if response.strip() == answer else 0.0
'''


@pytest.mark.slow
def test_user_reward_that_hangs_and_crashes_does_not_stop_the_run(tmp_path: Path) -> None:
    rdir = tmp_path / "my_reward"
    rdir.mkdir()
    (rdir / "score.py").write_text(textwrap.dedent(REWARD))
    run = tmp_path / "run"
    sets = ["train.steps=2", "train.eval_every=0", "warm_start.steps=0", "coordinator.enabled=false",
            "rollout.num_prompts=4", "rollout.samples_per_prompt=4", "parallel.micro_batch_size=8",
            "data.num_train=200", f"data.num_val={NUM_VAL}", f"train.run_dir={run}",
            f"reward.fn={rdir}/score.py:reward", "reward.timeout_s=3", "reward.workers=2"]
    proc = megarl_train("grpo_cpu.yaml", sets, timeout=900)
    out = proc.stdout + proc.stderr
    (run / "stdout.log").write_text(out)
    steps = [r for r in read_metrics(run) if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    got = [(r["rollout/reward_failures"], r["rollout/reward_timeouts"], r["rollout/reward_crashes"]) for r in steps]
    assert got == [(3.0, 2.0, 1.0), (0.0, 0.0, 0.0)]
    assert "step 1 rewards: 3 of 16 samples got reward.failed_reward=0 (2 timed out, 1 crashed their worker" in out
    assert "builtin:" in out.split("step 1 rewards:")[1].splitlines()[0]  # names the sample's prompt
    seen = [json.loads(x) for x in (rdir / "seen.jsonl").read_text().splitlines()]
    assert sorted(s["n"] for s in seen) == list(range(1, 2 * NUM_VAL + 2 * 16 + 1))  # val, 2 steps, val
    for s in seen:
        a, op, b = s["prompt"].rstrip("=").partition("+") if "+" in s["prompt"] else s["prompt"].rstrip("=").partition("-")
        assert s["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b)) and s["extra"] == {}
        assert not any(t in s["response"] for t in ("<s>", "</s>", "<pad>", "<unk>")), s["response"]
