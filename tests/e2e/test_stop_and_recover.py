"""Stopping `megarl train` the way users and process managers do, and recovering from a
damaged checkpoint, through the real entry point (GRPO, TP=2: torchrun, two ranks, one
vLLM engine).

* SIGTERM / SIGINT to the launcher's pid only (not its process group): the ranks finish
  the step, checkpoint it, stop the engine and exit; the launcher exits with their status
  (0) and no process of the run is left.
* A truncated tensor file or an emptied state file in the newest checkpoint:
  ``train.resume=auto`` falls back to the previous checkpoint with a warning naming the bad
  one and the run finishes (through the launcher, and through plain torchrun where rank 0
  decides); an explicit path to the bad one fails with exit 2 and one line.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.checkpoint.integrity import verify_checkpoint
from tests.helpers import ROOT
from tests.helpers import alive_processes as _alive

SETS = [
    "coordinator.enabled=false",
    "warm_start.steps=20",
    "rollout.num_prompts=4",
    "rollout.samples_per_prompt=4",
    "parallel.micro_batch_size=16",
    "data.num_train=2000",
    "data.num_val=16",
    "train.tensorboard=false",
    "train.eval_every=0",
    "train.save_every=1",
    "train.keep_last=3",
]
ARGS = ["train", "--config", str(ROOT / "examples" / "grpo_cpu.yaml")]


def _megarl(sets: list[str], torchrun: bool = False) -> list[str]:
    head = [sys.executable, "-m", "megarl.cli"]
    if torchrun:  # the ranks without the launcher, as the SLURM scripts start them
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megarl.cli"]
    return head + ARGS + [a for s in [*SETS, *sets] for a in ("--set", s)]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MEGARL_RESUME_VERIFIED", None)
    return env


def _steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "rollout/reward_mean" in r]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return "(gone)"


def _stop_with(sig: int, run: Path) -> dict:
    """Start a long run, wait for 2 logged steps, send ``sig`` to the launcher pid only."""
    run.mkdir(parents=True)
    log = open(run.parent / "launcher.log", "w")  # a file, not a pipe: wait for the launcher, not its orphans
    proc = subprocess.Popen(
        _megarl(["train.steps=200", f"train.run_dir={run}"]),
        env=_env(),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len(_steps(run)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be stopped"
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = [_cmdline(p) for p in tree]
        os.kill(proc.pid, sig)
        proc.wait(timeout=300)
        out = (run.parent / "launcher.log").read_text()
        deadline = time.monotonic() + 5  # a child exiting just now may not be reaped yet
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [f"{p.pid} {_cmdline(p)[:120]}" for p in _alive(tree)]
        return {
            "rc": proc.returncode,
            "out": out,
            "tree": names,
            "survivors": survivors,
            "run": run,
        }
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
        for p in _alive(tree):  # never leave a failed test's orphans training on
            p.kill()


def _assert_stopped_with_checkpoint(res: dict) -> int:
    out = res["out"]
    assert res["survivors"] == [], (res["survivors"], out[-3000:])
    names = " | ".join(res["tree"])
    # torchrun runs inside the megarl.launcher wrapper process (its one-line-error filter)
    assert "megarl.launcher" in names and names.count("megarl.cli train") >= 3, names  # +2 ranks
    assert "megarl.engine.server" in names, names
    assert res["rc"] == 0, out[-5000:]  # the ranks' status: they checkpointed and exited cleanly
    assert "preempted after step" in out, out[-3000:]
    stopped = int(out.split("preempted after step ")[1].split(":")[0])
    ckpts = res["run"] / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{stopped:08d}"
    verify_checkpoint(ckpts / f"step_{stopped:08d}")  # complete and intact (manifest)
    assert _steps(res["run"]) == list(range(1, stopped + 1))
    return stopped


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    res = _stop_with(signal.SIGTERM, tmp_path_factory.mktemp("sigterm") / "run")
    res["step"] = _assert_stopped_with_checkpoint(res) if res["rc"] == 0 else None
    return res


def test_sigterm_to_the_launcher_checkpoints_and_leaves_no_process(stopped: dict) -> None:
    _assert_stopped_with_checkpoint(stopped)
    assert "launcher got SIGTERM" in stopped["out"]


def test_sigint_to_the_launcher_checkpoints_and_leaves_no_process(tmp_path: Path) -> None:
    res = _stop_with(signal.SIGINT, tmp_path / "run")
    _assert_stopped_with_checkpoint(res)
    assert "launcher got SIGINT" in res["out"] and "KeyboardInterrupt" not in res["out"]


def _damaged(stopped: dict, tmp_path: Path, damage: str) -> tuple[Path, Path, int]:
    """A copy of the stopped run whose newest checkpoint is damaged; returns (run, bad, step)."""
    if stopped["step"] is None:
        pytest.skip("the SIGTERM run did not stop cleanly (see its test)")
    run = tmp_path / "run"
    shutil.copytree(stopped["run"], run)
    k = stopped["step"]
    bad = run / "checkpoints" / f"step_{k:08d}"
    if damage == "truncated":
        f = bad / "actor" / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        (bad / "state.json").write_text("")
    return run, bad, k


NEEDLE = {"truncated": "actor/__0_0.distcp has", "emptied": "state.json has 0 bytes"}


@pytest.mark.parametrize(
    "damage, torchrun",
    [("truncated", False), ("emptied", True)],
    ids=["truncated_tensor_via_launcher", "emptied_state_via_plain_torchrun"],
)
def test_resume_auto_falls_back_past_a_damaged_checkpoint(
    stopped: dict, tmp_path: Path, damage: str, torchrun: bool
) -> None:
    run, bad, k = _damaged(stopped, tmp_path, damage)
    proc = subprocess.run(
        _megarl([f"train.steps={k + 1}", f"train.run_dir={run}"], torchrun=torchrun),
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    warning = next(line for line in out.splitlines() if "is corrupt" in line)
    assert f"checkpoint {bad} is corrupt ({NEEDLE[damage]}" in warning and "falling back" in warning, warning
    assert f"resumed from {run / 'checkpoints' / f'step_{k - 1:08d}'} at step {k - 1}" in out, out[-3000:]
    assert _steps(run) == list(range(1, k + 2))  # step k again (from k-1), then k+1; each once
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{k + 1:08d}"
    verify_checkpoint(run / "checkpoints" / f"step_{k:08d}")  # the bad one was saved over


@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_explicit_damaged_checkpoint_fails_in_one_line(stopped: dict, tmp_path: Path, damage: str) -> None:
    run, bad, k = _damaged(stopped, tmp_path, damage)
    proc = subprocess.run(
        _megarl([f"train.steps={k + 1}", f"train.run_dir={run}", f"train.resume={bad}"]),
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert out.count("\n") == 0 and "Traceback" not in out, out
    assert out.startswith(f"megarl: checkpoint error: checkpoint {bad} is corrupt: {NEEDLE[damage]}"), out
