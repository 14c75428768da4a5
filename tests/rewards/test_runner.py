"""User rewards through the real worker pool: loading by path and by module name, the calling
convention, weights, pre-launch errors, and rewards that hang, kill their interpreter, raise
or leak; plus the built-in ``math`` reward (math-verify)."""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from megarl.config import ConfigError, RewardConfig, RunConfig
from megarl.errors import RolloutError
from megarl.prelaunch import check_run
from megarl.rewards.builtin import last_boxed, math
from megarl.rewards.runner import RewardRunner, RewardSample
from megarl.rewards.specs import check_reward_config

REWARDS = '''
import json, os, time
from pathlib import Path

HERE = Path(__file__).parent


def seen(response, prompt, answer, messages, extra):
    """Records what it was given (one JSON line per call) and scores the exact match."""
    with open(HERE / "seen.jsonl", "a") as fh:
        fh.write(json.dumps(dict(response=response, prompt=prompt, answer=answer, messages=messages,
                                 extra=extra, pid=os.getpid())) + "\\n")
    return float(response == answer)


def bonus(response, extra, **rest):
    return extra.get("bonus", 0.0) + (0.5 if rest["prompt"].endswith("=") else 0.0)


def lengths(samples):
    return [len(s.response) + len(s.extra.get("tag", "")) for s in samples]
lengths.batched = True


def flaky(response):
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(1)
    if response == "raise":
        raise RuntimeError("verifier crashed")
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"
    return 1.0


def pid(response):
    return float(os.getpid())


def hog(response):
    block = bytearray(1024 * 2**20)  # 1 GiB
    return float(len(block))


def two_args(prompt, completion):
    return 0.0


def no_response(prompt, answer):
    return 0.0


def batched_two(samples, other):
    return []
batched_two.batched = True

NOT_A_FUNCTION = 3
'''


def _module(tmp_path: Path, name: str = "user_rewards", text: str = REWARDS) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def _runner(fn: list[str], **kw: object) -> RewardRunner:
    cfg = RunConfig(reward=RewardConfig(fn=fn, **kw))  # type: ignore[arg-type]
    check_reward_config(cfg)
    return RewardRunner(cfg.reward, cfg.data)


def _samples(responses: list[str], **kw: object) -> list[RewardSample]:
    return [RewardSample(r, "3+4=", "7", where=f"data.jsonl:{i + 1} #0", **kw) for i, r in enumerate(responses)]  # type: ignore[arg-type]


def test_reward_from_a_file_sees_the_text_messages_and_extra_fields(tmp_path: Path) -> None:
    path = _module(tmp_path)
    runner = _runner([f"{path}:seen"])
    try:
        msgs = [{"role": "user", "content": "3+4="}]
        samples = [
            RewardSample("7", "3+4=", "7", messages=msgs, extra={"level": 2, "tags": ["a"]}, where="d.jsonl:1 #0"),
            RewardSample("8", "3+4=", "7", messages=msgs, extra={"level": 2, "tags": ["a"]}, where="d.jsonl:1 #1"),
        ]
        scores, report = runner.score(samples)
    finally:
        runner.close()
    assert scores == [1.0, 0.0] and report.failures == 0
    seen = sorted(
        (json.loads(x) for x in (tmp_path / "seen.jsonl").read_text().splitlines()), key=lambda r: r["response"]
    )
    assert [r["response"] for r in seen] == ["7", "8"]
    for r in seen:
        assert (r["prompt"], r["answer"], r["messages"], r["extra"]) == ("3+4=", "7", msgs, {"level": 2, "tags": ["a"]})
        assert r["pid"] != os.getpid()  # it ran in a worker process


def test_module_name_batched_and_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, "my_rewards")
    monkeypatch.syspath_prepend(str(tmp_path))  # workers get the parent's sys.path
    runner = _runner(["my_rewards:lengths", "my_rewards:bonus", "exact_match"], weights=[1.0, 2.0, 10.0], workers=2)
    try:
        samples = _samples(["7", "abc", "7 ", "x"], extra={"bonus": 0.25, "tag": "tt"})
        scores, report = runner.score(samples)
    finally:
        runner.close()
    # lengths = len(response) + 2; bonus = 0.25 + 0.5 (prompt ends in '='); exact_match on stripped text
    assert scores == [3 + 2 * 0.75 + 10, 5 + 1.5, 4 + 1.5 + 10, 3 + 1.5]
    m = report.metrics()
    assert m["rollout/reward_failures"] == 0
    assert m["rollout/reward/lengths_mean"] == (3 + 5 + 4 + 3) / 4 and m["rollout/reward/exact_match_mean"] == 0.5


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("{path}:two_args", r"reward.fn\[1\]='.*:two_args' wrong signature: .*parameter 'completion' is not one of"),
        ("{path}:no_response", r"reward.fn\[1\]='.*:no_response' wrong signature: .*does not take 'response'"),
        ("{path}:batched_two", r"wrong signature: is marked batched but cannot be called as fn\(samples\)"),
        ("{path}:NOT_A_FUNCTION", r"reward.fn\[1\]='.*:NOT_A_FUNCTION' 'NOT_A_FUNCTION' is a int, not a function"),
        ("{path}:nope", r"reward.fn\[1\]='.*:nope' .*user_rewards.py has no attribute 'nope'"),
        ("{tmp}/missing.py:f", r"reward.fn\[1\]='.*missing.py:f' reward file .*missing.py does not exist"),
        ("no_such_module_xyz:f", r"reward.fn\[1\]='no_such_module_xyz:f' cannot be imported: ModuleNotFoundError"),
        ("{broken}:f", r"reward.fn\[1\]='.*broken.py:f' cannot be imported: ZeroDivisionError"),
        ("exact", r"reward.fn\[1\]='exact' is not a built-in reward"),
    ],
)
def test_bad_rewards_fail_before_launch_naming_the_setting(tmp_path: Path, fn: str, message: str) -> None:
    path = _module(tmp_path)
    broken = _module(tmp_path, "broken", "x = 1 / 0\n")
    spec = fn.format(path=path, tmp=tmp_path, broken=broken)
    cfg = RunConfig(reward=RewardConfig(fn=["exact_match", spec]))
    with pytest.raises(ConfigError, match=message):
        check_run(cfg, 1)  # what `megarl train` runs before torchrun


def test_hanging_reward_times_out_and_the_pool_recovers(tmp_path: Path) -> None:
    path = _module(tmp_path)
    runner = _runner([f"{path}:flaky"], timeout_s=1.0, workers=2, failed_reward=-1.0)
    try:
        runner.score(_samples(["7"]))  # workers started
        t0 = time.monotonic()
        scores, report = runner.score(_samples(["7", "hang", "7", "7", "hang", "7"]))
        wall = time.monotonic() - t0
        assert scores == [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
        assert (report.failures, report.timeouts, report.crashes, report.errors) == (2, 2, 0, 0)
        assert report.examples[0] == "data.jsonl:2 #0: flaky: timed out after 1s (worker killed)"
        assert wall < 1.0 * 2 + 10  # two timeouts (in parallel or not) plus a replacement start; never 60 s
        again, rep2 = runner.score(_samples(["7"] * 4))
        assert again == [1.0] * 4 and rep2.failures == 0
        assert runner.pool is not None and runner.pool.replaced == 2
    finally:
        runner.close()


def test_reward_that_kills_its_interpreter_is_counted(tmp_path: Path) -> None:
    path = _module(tmp_path)
    runner = _runner([f"{path}:flaky"], workers=1)
    try:
        scores, report = runner.score(_samples(["7", "die", "7", "raise", "nan", "text"]))
        assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
        assert (report.failures, report.timeouts, report.crashes, report.errors) == (4, 0, 1, 3)
        assert report.examples[0] == "data.jsonl:2 #0: flaky: reward worker died (exit code 1)"
        assert report.examples[1] == "data.jsonl:4 #0: flaky: RuntimeError: verifier crashed"
        line = report.summary(0.0)
        assert line.startswith(
            "4 of 6 samples got reward.failed_reward=0 (0 timed out, 1 crashed their worker, 3 raised)"
        )
        assert runner.score(_samples(["7", "7"]))[0] == [1.0, 1.0]
    finally:
        runner.close()


def test_workers_are_recycled_and_memory_capped(tmp_path: Path) -> None:
    path = _module(tmp_path)
    runner = _runner(
        [f"{path}:pid", f"{path}:hog"], weights=[1.0, 0.0], workers=1, max_tasks_per_worker=2, worker_memory_mb=768
    )
    try:
        pids = []
        for _ in range(3):
            _, report = runner.score(_samples(["7"]))
            pids.append(report.sums["pid"])
            assert report.errors == 1 and "MemoryError" in report.examples[0]  # hog: 1 GiB > 768 MiB
    finally:
        runner.close()
    # each score() makes two calls (pid, hog) on the one worker; it is replaced after every 2
    assert len(set(pids)) == 3 and os.getpid() not in pids


def test_workers_that_cannot_start_stop_the_run_with_the_reason(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        "only_in_parent",
        """
        import multiprocessing
        if multiprocessing.current_process().name == "megarl-reward":
            raise ImportError("needs a GPU driver")
        def f(response):
            return 1.0
    """,
    )
    runner = _runner([f"{path}:f"], workers=1)
    try:
        with pytest.raises(RolloutError, match="reward workers fail to start .3 in a row.*needs a GPU driver"):
            runner.score(_samples(["7"]))
    finally:
        runner.close()


def test_builtins_run_in_process_and_a_failing_one_is_counted() -> None:
    runner = _runner(["math", "arithmetic"], weights=[1.0, 1.0])
    assert runner.pool is None  # built-ins: no worker processes
    samples = [RewardSample("\\boxed{7}", "3+4=", "7", where="a:1 #0"), RewardSample("7", "3+4=", "", where="a:2 #0")]
    scores, report = runner.score(samples)
    assert scores == [1.0, 0.0]  # sample 2: the empty reference answer makes both rewards raise
    assert report.failures == 1 and report.errors == 2 and "a:2 #0: math: ValueError" in report.examples[0]


def test_deprecated_data_reward_alias(caplog: pytest.LogCaptureFixture) -> None:
    cfg = RunConfig()
    cfg.data.reward = "exact_match"
    check_reward_config(cfg)
    runner = RewardRunner(cfg.reward, cfg.data)
    assert runner.specs == ["exact_match"] and "data.reward is deprecated" in caplog.text
    cfg.reward.fn = ["math"]
    with pytest.raises(ConfigError, match="data.reward='exact_match' is a deprecated alias of reward.fn and conflicts"):
        check_reward_config(cfg)


@pytest.mark.parametrize(
    ("response", "answer", "value"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "1/2", 1.0),
        ("$x = \\boxed{\\sqrt{4}}$", "2", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("first \\boxed{3}, finally \\boxed{42}", "42", 1.0),  # the last boxed answer counts
        ("first \\boxed{42}, finally \\boxed{3}", "42", 0.0),
        ("the answer is 42", "42", 0.0),  # no boxed answer: wrong, not a failure
        ("\\boxed{}", "42", 0.0),
        ("\\boxed{\\frac{1}{2", "0.5", 0.0),  # unbalanced: no boxed answer
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{-3}", "3", 0.0),
    ],
)
def test_math_reward(response: str, answer: str, value: float) -> None:
    assert math(prompt="", response=response, answer=answer) == value


def test_last_boxed() -> None:
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\fbox{3}") == "3"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("none") is None


def test_two_files_with_the_same_name_are_two_rewards(tmp_path: Path) -> None:
    """Files load under a name derived from their full path: no silent reuse of the first."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _module(a, "r", "def f(response):\n    return 1.0\n")
    _module(b, "r", "def f(response):\n    return 2.0\n")
    runner = _runner([f"{a}/r.py:f", f"{b}/r.py:f"], isolate_builtins=True)
    try:
        scores, report = runner.score(_samples(["7"]))
    finally:
        runner.close()
    assert scores == [3.0] and sorted(report.sums) == ["f", "f_2"]


def test_a_sample_that_does_not_pickle_fails_alone(tmp_path: Path) -> None:
    path = _module(tmp_path)
    runner = _runner([f"{path}:bonus"], workers=1)
    try:
        samples = _samples(["7"], extra={"bonus": 1.0}) + _samples(["7"], extra={"bonus": lambda: 1.0})
        scores, report = runner.score(samples)
    finally:
        runner.close()
    assert scores == [1.5, 0.0] and report.errors == 1 and "sample not picklable" in report.examples[0]


def test_megarl_train_stops_on_a_bad_reward_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megarl.cli import main

    path = _module(tmp_path)
    run = tmp_path / "run"
    t0 = time.monotonic()
    rc = main(["train", "--set", f"reward.fn={path}:two_args", "--set", f"train.run_dir={run}"])
    assert rc == 2 and time.monotonic() - t0 < 10
    assert f"megarl: config error: reward.fn[0]='{path}:two_args' wrong signature" in capsys.readouterr().err
    assert not run.exists()  # no process group, engine or run folder was started


def test_a_reward_file_imports_its_neighbours_and_a_module_name_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a script would: ``score.py`` next to its ``helper.py``; ``mymod:f`` from the folder
    it sits in, under the ``megarl`` console script (whose sys.path has no working directory)."""
    import sys

    (tmp_path / "rw").mkdir()
    (tmp_path / "rw/helper_s21.py").write_text("def bonus():\n    return 0.5\n")
    (tmp_path / "rw/score.py").write_text("from helper_s21 import bonus\n\ndef score(response):\n    return 1.0 + bonus()\n")
    (tmp_path / "mymod_s21.py").write_text("def f(response):\n    return 2.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), str(tmp_path / "rw"))])
    runner = _runner([f"{tmp_path}/rw/score.py:score", "mymod_s21:f"], weights=[1.0, 10.0])
    try:
        scores, report = runner.score(_samples(["7"]))
    finally:
        runner.close()
    assert report.failures == 0 and scores == [1.5 + 20.0]


def test_array_rewards_and_a_step_where_every_reward_failed(tmp_path: Path) -> None:
    """A batched reward may return a numpy array (one value per sample) and a per-sample one a
    numpy / torch scalar; reward.stop_after_failed_steps steps in a row where every sample's
    reward failed stop the run, naming why (a shorter outage is survived)."""
    from megarl.errors import RolloutError
    from megarl.rewards.runner import failed_steps_check

    path = _module(tmp_path, "arr", """
        import numpy as np, torch

        def batch(samples):
            return np.array([len(s.response) for s in samples], dtype=np.float32)
        batch.batched = True

        def scalar(response):
            return torch.tensor(0.25)

        def broken(response):
            raise KeyError("answer")
    """)
    runner = _runner([f"{path}:batch", f"{path}:scalar"])
    try:
        scores, good = runner.score(_samples(["a", "bb", "ccc"]))
        assert good.failures == 0 and scores == [1.25, 2.25, 3.25]
    finally:
        runner.close()
    runner = _runner([f"{path}:broken"])
    try:
        scores, report = runner.score(_samples(["a", "b"]))
    finally:
        runner.close()
    assert report.failures == 2 and scores == [0.0, 0.0]
    assert failed_steps_check(report, 0, 3, 1) == 1
    assert failed_steps_check(good, 1, 3, 2) == 0  # a step with rewards resets the count
    assert failed_steps_check(report, failed_steps_check(report, 0, 3, 3), 3, 4) == 2
    assert failed_steps_check(report, 5, 0, 9) == 6  # 0: never stops
    with pytest.raises(RolloutError, match=r"step 7: the reward failed on every sample for 3 steps in a row "
                       r"\(reward.stop_after_failed_steps=3\); this step: 2 samples, 0 timed out, 0 crashed "
                       r"their worker, 2 raised or returned a non-number, e.g. data.jsonl:1 #0: .*KeyError"):
        failed_steps_check(report, 2, 3, 7)
