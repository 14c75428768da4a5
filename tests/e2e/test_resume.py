"""Exact resume through the real entry point: a run stopped after step k (by its step budget,
or preempted by SIGUSR1 as SLURM does) and resumed equals the uninterrupted run — same
prompts in the same order, same per-step metrics, bitwise-equal final weights — for GRPO
(TP=2) and PPO with a critic on the distributed optimizer (DP=2)."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT, megarl_train, train_cmd, train_env
from tests.metrics.readback import WANDB_ENV, jsonl_by_step, mlflow_history, same, wandb_files, wandb_history

# coordinator off: its batch choices follow wall-clock timings, so two runs would differ
COMMON = ["coordinator.enabled=false", "warm_start.steps=20", "rollout.num_prompts=8", "rollout.samples_per_prompt=4", "data.num_train=2000",
          "data.num_val=16", "train.tensorboard=false", "train.eval_every=0"]
KEYS = ["rollout/reward_mean", "rollout/prompt_fingerprint", "rollout/tokens", "train/loss", "train/grad_norm",
        "train/kl", "critic/value_loss", "train/kl_coef"]
GRPO = ("grpo_cpu.yaml", ["parallel.micro_batch_size=16"])
# (it also draws sampling seeds keyed by the prompt stream, restored with the sampler, and
# validates by the exact answer probability: one run pair for both, not a case of their own)
PPO_DISTOPT = ("ppo_cpu.yaml", ["parallel.tensor_parallel=1", "parallel.data_parallel=2",
                                "parallel.use_distributed_optimizer=true", "parallel.micro_batch_size=4",
                                "critic.warmup_steps=1", "rollout.sampling_seed=prompt",
                                "train.val_metric=answer_prob"])


def _run(config: str, sets: list[str]) -> str:
    proc = megarl_train(config, sets)
    return proc.stdout + proc.stderr


def _steps(run: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps: dict[int, dict] = {}
    for r in recs:
        if "rollout/reward_mean" in r:
            assert r["step"] not in steps, f"step {r['step']} logged twice"
            steps[r["step"]] = r
    return steps


def _assert_same_run(a: Path, b: Path, n: int) -> None:
    sa, sb = _steps(a), _steps(b)
    assert sorted(sa) == sorted(sb) == list(range(1, n + 1))
    for s in sa:
        for k in KEYS:
            assert sa[s].get(k) == sb[s].get(k), (s, k, sa[s].get(k), sb[s].get(k))
    wa = load_file(str(a / "hf_final/model.safetensors"))
    wb = load_file(str(b / "hf_final/model.safetensors"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


def _assert_trackers_equal_jsonl(run: Path) -> None:
    """Both parts of the run are one W&B run (two offline files, one id) and one MLflow run, steps
    going up, each row equal to metrics.jsonl; their config and summary are the run folder's."""
    from mlflow.tracking import MlflowClient

    jsonl = jsonl_by_step(run)
    assert sorted(jsonl) == [0, 1, 2, 3, 4] and jsonl[4]["progress/samples"] == 4 * 32
    ids = json.loads((run / "trackers.json").read_text())
    files = wandb_files(run)
    assert [f.run_id for f in files] == [ids["wandb"]["run_id"]] * 2 and [f.exit_code for f in files] == [0, 0]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])
    assert mlrun.info.run_id == ids["mlflow"]["run_id"] and mlrun.info.status == "FINISHED"
    for rows in (wandb_history(files), mlflow_history(client, mlrun.info.run_id)):
        assert sorted(rows) == sorted(jsonl)
        for step, row in jsonl.items():
            assert row.keys() == rows[step].keys() and all(same(v, rows[step][k]) for k, v in row.items()), step
    config, summary = json.loads((run / "config.json").read_text()), json.loads((run / "summary.json").read_text())
    assert files[-1].config == config and config["train"]["steps"] == 4
    assert summary["steps"] == 4 and all(files[-1].summary[k] == v for k, v in summary.items())
    assert {k: mlrun.data.metrics[f"summary/{k}"] for k in summary} == summary


GRPO_ASYNC = ("grpo_cpu.yaml", ["parallel.micro_batch_size=16", "train.save_every=1", "train.async_save=true"])


@pytest.fixture(scope="module")
def grpo_full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 4-step GRPO run (TP=2, no periodic saves), the reference of every GRPO
    resume below: checkpoint settings must not change what is trained, so one run serves all."""
    full = tmp_path_factory.mktemp("grpo") / "full"
    _run(GRPO[0], [*COMMON, *GRPO[1], "train.steps=4", f"train.run_dir={full}"])
    return full


@pytest.mark.parametrize("setup", [GRPO, PPO_DISTOPT, GRPO_ASYNC], ids=["grpo_tp2", "ppo_dp2_distopt", "grpo_async"])
def test_resume_after_stop_equals_uninterrupted(tmp_path: Path, setup, request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config, extra = setup
    parts = tmp_path / "parts"
    if setup in (GRPO, GRPO_ASYNC):
        full = request.getfixturevalue("grpo_full")
    else:
        full = tmp_path / "full"
        _run(config, [*COMMON, *extra, "train.steps=4", f"train.run_dir={full}"])
    if setup is GRPO:  # the resumed run also logs to W&B (offline) and MLflow (a SQLite file): one run each
        extra = [*extra, "train.trackers=jsonl,wandb,mlflow"]
        for k, v in WANDB_ENV.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(config, [*COMMON, *extra, "train.steps=2", f"train.run_dir={parts}"])
    log = _run(config, [*COMMON, *extra, "train.steps=4", f"train.run_dir={parts}"])
    assert "resumed from" in log and "at step 2" in log
    if setup is GRPO:
        _assert_trackers_equal_jsonl(parts)
    if "train.async_save=true" in extra:  # periodic saves were staged, written in the background
        assert "writing in the background" in log and "committed" in log
        blocked = [r["timing/checkpoint_blocked_s"] for r in map(json.loads, (parts / "metrics.jsonl").open())
                   if "timing/checkpoint_blocked_s" in r]
        assert len(blocked) == 4
    _assert_same_run(full, parts, 4)
    if setup is PPO_DISTOPT:  # the final validation (answer_prob) of the same weights: the same number
        assert _summary(full)["val/reward_end"] == _summary(parts)["val/reward_end"]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_preempted_by_signal_then_resumed(tmp_path: Path) -> None:
    config, extra = GRPO
    full, pre = tmp_path / "full", tmp_path / "pre"
    sets = [*COMMON, *extra, "train.steps=40", "rollout.num_prompts=4"]
    _run(config, [*sets, f"train.run_dir={full}"])
    proc = subprocess.Popen(train_cmd(config, [*sets, f"train.run_dir={pre}"]), env=train_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    metrics = pre / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and sum("rollout/reward_mean" in line for line in metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "run ended before it could be preempted"
    os.killpg(proc.pid, signal.SIGUSR1)  # like SLURM: every process of the job gets it
    out, _ = proc.communicate(timeout=300)
    assert "preempted after step" in out, out[-3000:]
    stopped = int(out.split("preempted after step ")[1].split(":")[0])
    assert 3 <= stopped < 40
    assert (pre / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    log = _run(config, [*sets, f"train.run_dir={pre}"])
    assert f"at step {stopped}" in log
    _assert_same_run(full, pre, 40)


def test_resume_fails_clearly_on_other_model_shape(tmp_path: Path, grpo_full: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(grpo_full, run)  # a finished run with its checkpoint, continued with another shape
    config, extra = GRPO
    proc = subprocess.run(train_cmd(config, [*COMMON, *extra, "train.steps=5", "model.hidden_size=256",
                                        f"train.run_dir={run}"]), env=train_env(), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "hidden_size" in out and "does not fit the model being loaded" in out, out[-3000:]  # the checkpoint's check
    assert not (run / "checkpoints" / "step_00000005").exists()


# actor TP2 (megatron's global groups), critic TP1 × DP2 on its own groups (critic.parallel)
PPO_CRITIC_LAYOUT = ("ppo_cpu.yaml", ["critic.parallel.tensor_parallel=1", "parallel.micro_batch_size=8",
                                      "critic.warmup_steps=1"])


def test_ppo_critic_on_its_own_layout_resumes_exactly(tmp_path: Path) -> None:
    """A short PPO run through `megarl train` with the critic on its own layout logs critic
    metrics every step, checkpoints each model with its own layout, and a run stopped after
    step 2 and resumed equals the uninterrupted one."""
    config, extra = PPO_CRITIC_LAYOUT
    full, parts = tmp_path / "full", tmp_path / "parts"
    _run(config, [*COMMON, *extra, "train.steps=4", f"train.run_dir={full}"])
    _run(config, [*COMMON, *extra, "train.steps=2", f"train.run_dir={parts}"])
    log = _run(config, [*COMMON, *extra, "train.steps=4", f"train.run_dir={parts}"])
    assert "resumed from" in log and "at step 2" in log
    _assert_same_run(full, parts, 4)
    steps = _steps(full)
    assert [steps[s]["train/actor_updated"] for s in range(1, 5)] == [0.0, 1.0, 1.0, 1.0]
    for s in range(1, 5):
        r = steps[s]
        assert r["critic/lr"] == 5e-4 and r["critic/value_loss"] >= 0 and "critic/value_mse" in r
        assert (r["critic/grad_norm"] > 0) == (r["critic/value_loss"] > 0)
    assert sum(steps[s]["critic/grad_norm"] > 0 for s in range(1, 5)) >= 2
    meta = json.loads((parts / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["models"]["critic"]["layout"] == {"world_size": 2, "tp": 1, "pp": 1, "dp": 2}
    assert meta["models"]["actor"]["layout"] == {"world_size": 2, "tp": 2, "pp": 1, "dp": 1}
