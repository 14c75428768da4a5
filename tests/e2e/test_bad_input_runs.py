"""Bad input met at run time (issue 14 C), through real runs: a real vLLM engine, megatron on
gloo, real files.

Run A (one rank, no torchrun) uses a reward that raises on every sample and a validation set
whose first prompt is longer than the model's context, while another process holds the port
the single-rank rendezvous used to take: the run finishes, every failure is counted and
summarised in one line per step (and per validation), the overlong validation prompt is
skipped. Run B resumes A's checkpoint into a model of another shape under torchrun (TP=2,
started by ``megarl train``): one line, exit 2, none of torchrun's report. Run C starts
ranks under torchrun by hand with the wrong world size (plain, and as ``python -m megarl.launcher``).

Heavy: run under ``flock /tmp/megarl-heavy.lock``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
CONFIG = str(ROOT / "examples/grpo_cpu.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCHDYNAMO_DISABLE": "1"}
# the reward is registered in the run's own process (one rank: no torchrun re-import)
RUN_WITH_BROKEN_REWARD = """
import sys
from megarl.rewards import builtin as rewards

def always_raises(prompt, response, answer):
    raise RuntimeError("verifier service down")

rewards.REWARDS["always_raises"] = always_raises
from megarl.cli import main
raise SystemExit(main(sys.argv[1:]))
"""
OVERLONG = "1+" * 200 + "1="  # > 80 tokens under any merges of the 48-piece tokenizer > model context 64


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.CompletedProcess[str]]]:
    base = tmp_path_factory.mktemp("bad_input")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)]
    val = [{"prompt": OVERLONG, "answer": "41"}] + [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(3)]
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + val))
    run = base / "run_a"
    sets = _sets(
        "parallel.tensor_parallel=1", "train.steps=2", "train.eval_every=1", "warm_start.steps=0",
        "rollout.num_prompts=8", "rollout.samples_per_prompt=4", "parallel.micro_batch_size=16",
        "coordinator.enabled=false", f"data.source={data}", "data.num_val=4", "data.reward=always_raises",
        f"train.run_dir={run}",
    )  # fmt: skip
    # the fixed port single-rank runs used to bind (a second run on the machine holds it)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 29511))
        holder.listen()
        proc = subprocess.run(
            [sys.executable, "-c", RUN_WITH_BROKEN_REWARD, "train", "--config", CONFIG, *sets],
            env=ENV, capture_output=True, text=True, timeout=900, cwd=base,
        )  # fmt: skip
    (base / "run_a.log").write_text(proc.stdout + proc.stderr)
    yield run, proc


def test_broken_reward_and_overlong_validation_prompt_do_not_stop_the_run(
    run_a: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run, proc = run_a
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "Traceback" not in log
    recs = read_metrics(run)
    steps = [r for r in recs if "rollout/reward_failures" in r]
    assert [r["rollout/reward_failures"] for r in steps] == [32.0, 32.0]  # 8 prompts × 4 samples, each step
    assert [(r["step"], r["val/reward"]) for r in recs if "val/reward" in r] == [(0, 0.0), (1, 0.0), (2, 0.0)]
    lines = log.splitlines()
    train_lines = [ln for ln in lines if "rewards: 32 of 32 samples got reward.failed_reward=0" in ln]
    val_lines = [ln for ln in lines if "validation rewards: 3 of 3 samples got reward.failed_reward=0" in ln]
    skipped = [ln for ln in lines if "validation: skipped 1 of 4 prompts longer than rollout.max_prompt_len=12" in ln]
    # one line per step and per validation, not one per sample (64 + 9 lines before)
    assert len(train_lines) == 2 and len(val_lines) == 3 and len(skipped) == 3, "\n".join(lines[-40:])
    assert "step 1 rewards: 32 of 32 samples got reward.failed_reward=0 (0 timed out, 0 crashed" in train_lines[0]
    assert "32 raised); e.g. " in train_lines[0] and "RuntimeError: verifier service down" in train_lines[0]
    assert "validation rewards: 3 of 3 samples got reward.failed_reward=0" in val_lines[0]
    # the line after the first skip counts the prompts validated, not the validation set
    start = [ln for ln in lines if "start: validation reward" in ln]
    assert len(start) == 1 and start[0].endswith("start: validation reward 0.000 (3 prompts)"), start
    print(f"run A: {len(lines)} log lines; {train_lines[0][:160]}")


def test_resume_into_another_shape_is_one_line_under_torchrun(
    run_a: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    run, proc_a = run_a
    assert proc_a.returncode == 0
    sets = _sets(
        "parallel.tensor_parallel=2", "model.num_layers=4", f"train.resume={run}/checkpoints",
        "train.steps=2", "warm_start.steps=0", "rollout.num_prompts=8", "rollout.samples_per_prompt=4",
        "parallel.micro_batch_size=16", "coordinator.enabled=false", "data.num_train=200", "data.num_val=8",
        f"train.run_dir={tmp_path / 'run_b'}",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG, *sets],
        env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 2, err[-6000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("megarl: ")]
    assert len(errors) == 1, err[-6000:]
    assert errors[0].startswith(f"megarl: checkpoint error: checkpoint {run}/checkpoints/")
    assert "does not fit the model being loaded: saved with num_layers=2" in errors[0]
    assert "the model has num_layers=4" in errors[0]
    for noise in ("Traceback", "ChildFailedError", "exitcode", "Root Cause"):
        assert noise not in err, err[-6000:]
    assert err.rstrip().splitlines()[-1] == errors[0]  # the last thing on the terminal
    print(f"run B: exit 2, {len(err.splitlines())} stderr lines, last: {errors[0][:140]}")


WRONG_WORLD = (
    "megarl: config error: this run has 2 ranks (WORLD_SIZE) but parallel.tensor_parallel=1 × "
    "pipeline_parallel=1 × data_parallel=1 = 1: start it with `megarl train` (it launches torchrun itself) "
    "or --nproc-per-node=1"
)


@pytest.mark.parametrize("runner", ["torch.distributed.run", "megarl.launcher"])
def test_wrong_world_size_under_torchrun_by_hand(tmp_path: Path, runner: str) -> None:
    """torchrun started by the user: the ranks say it once (local rank 0, the only one that
    leaves by itself, so torchrun's report names it). Plain torchrun then prints its own report
    (a ChildFailedError traceback for any failed rank: not ours to silence); ``python -m
    megarl.launcher``, torchrun with the same arguments as slurm/README.md shows it, prints
    the line alone and exits 2."""
    cmd = [sys.executable, "-m", runner, "--standalone", "--nproc-per-node=2", "-m", "megarl.cli",
           "train", "--config", CONFIG, *_sets("parallel.tensor_parallel=1", f"train.run_dir={tmp_path / 'r'}")]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    ours = [ln for ln in out.splitlines() if ln.startswith("megarl: ")]
    assert ours == [WRONG_WORLD], out[-4000:]
    if runner == "torch.distributed.run":
        assert proc.returncode == 1, out[-4000:]
        cause = out.split("Root Cause (first observed failure):", 1)[1]
        assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2 " in cause, out[-4000:]
    else:
        assert proc.returncode == 2 and proc.stdout == "", out[-4000:]
        assert proc.stderr.strip().splitlines() == [WRONG_WORLD], proc.stderr[-4000:]
