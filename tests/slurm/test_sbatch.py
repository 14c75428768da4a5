"""The slurm/ sbatch scripts on a real two-node SLURM cluster (emulated on this machine).

What runs for real: slurmctld/slurmd, sbatch/srun, torchrun across two "nodes" with the TP
group spanning them, the megarl trainer and a vLLM CPU engine. Each job is a short GRPO run
(~30 s) whose metrics.jsonl is checked step by step; on failure the message carries the job
output and the daemons' logs.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import ROOT
from tests.slurm.local_cluster import CPUS_PER_NODE, LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPTS = ROOT / "slurm"
SHORT_RUN = [
    "warm_start.steps=10",
    "rollout.num_prompts=8",
    "coordinator.enabled=false",  # timing-driven batch changes would make resume checks run-dependent
    "rollout.samples_per_prompt=4",
    "parallel.micro_batch_size=16",
    "data.num_train=2000",
    "data.num_val=16",
]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
JOB_TIMEOUT_S = 300


def job_env(run_dir: Path, steps: int, extra_sets: list[str] | None = None, **env: str) -> dict[str, str]:
    """What a user exports before sbatch: config, overrides, venv, CPU-run settings."""
    sets = [*SHORT_RUN, f"train.steps={steps}", f"train.run_dir={run_dir}", *(extra_sets or [])]
    return {
        "MEGARL_ROOT": str(ROOT),
        "MEGARL_CONFIG": str(ROOT / "examples/grpo_cpu.yaml"),
        "MEGARL_SET": " ".join(sets),
        "MEGARL_VENV": sys.prefix,
        "OMP_NUM_THREADS": "1",
        "TORCHDYNAMO_DISABLE": "1",
        "PYTHONWARNINGS": "ignore",
        **env,
    }


def submit(cluster: LocalSlurm, script: str, sbatch_args: list[str], env: dict[str, str], out: Path) -> str:
    """sbatch --parsable; returns the job id."""
    cmd = ["sbatch", "--parsable", f"--output={out}", "--time=10", *sbatch_args, str(SCRIPTS / script)]
    r = cluster.cmd(cmd, timeout=30, cwd=ROOT, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr}\n{cluster.diagnostics()}"
    return r.stdout.strip().split(";")[0]


def wait_job(
    cluster: LocalSlurm, job: str, out: Path, timeout: float = JOB_TIMEOUT_S, min_restarts: int = 0
) -> dict[str, str]:
    """Poll until the job is in a terminal state (after ``min_restarts`` requeues); bounded."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job)
        if info.get("JobState") in TERMINAL and int(info.get("Restarts", "0")) >= min_restarts:
            return info
        time.sleep(1)
    cluster.cmd(["scancel", job], 10)
    pytest.fail(
        f"job {job} not finished after {timeout:.0f}s (last state {info.get('JobState')}, "
        f"restarts {info.get('Restarts')})\n{cluster.diagnostics(out)}"
    )


def rl_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if "rollout/reward_mean" in r]


def test_colocated_two_nodes_tp_across_nodes(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """2 nodes × 1 task, torchrun nnodes=2 nproc-per-node=1, TP=2: one TP group over both nodes."""
    run, out = tmp_path / "run", tmp_path / "job.out"
    name = f"megarl-colo-{os.getpid()}"
    cmd = [
        "sbatch",
        "--wait",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--job-name={name}",
        f"--output={out}",
        "--time=10",
        str(SCRIPTS / "megarl_colocated.sbatch"),
    ]
    r = slurm_cluster.cmd(cmd, timeout=JOB_TIMEOUT_S, cwd=ROOT, env=job_env(run, steps=3))
    if r.returncode == 124:
        slurm_cluster.cmd(["scancel", f"--name={name}"], 10)
    assert r.returncode == 0, f"sbatch --wait returned {r.returncode}: {r.stderr}\n{slurm_cluster.diagnostics(out)}"
    log = out.read_text()
    assert "trainer: 2 node(s) × 1 rank(s) per node (--ntasks-per-node) = world 2" in log, log[-3000:]
    assert "trainer agent node-rank 0 on node1" in log and "trainer agent node-rank 1 on node2" in log, log[-3000:]
    assert "MASTER_ADDR=node1" in log
    assert rl_steps(run) == [1, 2, 3], log[-4000:]
    assert "step 3/3" in log and "trainer step exited with code 0" in log


def test_disaggregated_trainer_node_and_fleet_node(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """node1: 2 trainer ranks (TP=2); node2: one engine server the trainer attaches to."""
    run, out = tmp_path / "run", tmp_path / "job.out"
    env = job_env(run, steps=3, MEGARL_FLEET_NODES="1", MEGARL_ENGINES_PER_NODE="1")
    # every CPU of each node: the engine's threads follow the job's CPUs on its node
    job = submit(
        slurm_cluster, "megarl_disaggregated.sbatch", ["--nodes=2", f"--cpus-per-task={CPUS_PER_NODE}"], env, out
    )
    info = wait_job(slurm_cluster, job, out)
    diag = f"\n{slurm_cluster.diagnostics(out)}"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), diag
    log = out.read_text()
    assert "split: trainer nodes node1 | fleet nodes node2" in log, diag
    m = re.search(r"rollout\.engine_addresses=(node2:\d+)\b", log)
    assert m, diag
    engine_log = (run / "logs" / "slurm-engine-0.log").read_text()
    assert f"engine 0 starting on {m.group(1)}" in engine_log and "engine ready" in engine_log, engine_log[-3000:]
    # node1's two ranks export OMP_NUM_THREADS=1; the engine on node2 sizes its own threads by
    # the job's CPUs on node2 (slurm/engine_task.sh), which vLLM's CPU worker then keeps
    threads = min(CPUS_PER_NODE, len(os.sched_getaffinity(0)))
    assert f"with {threads} torch threads" in engine_log, engine_log[-3000:]
    assert f"torch threads {threads}" in engine_log, engine_log[-3000:]
    assert rl_steps(run) == [1, 2, 3], diag
    assert "engine step stopped" in log
    # the engine (bound to 0.0.0.0) served a trainer holding the job's credential: a 0600 file
    token = run / "engine_token"
    assert f"engine credential: {token} (mode 0600)" in log and stat.S_IMODE(token.stat().st_mode) == 0o600, diag
    assert "refused" not in engine_log, engine_log[-3000:]


MISFITS = {
    # id: (script, sbatch args, env, extra --set items, expected message)
    "too-few-nodes-for-fleet": (
        "megarl_disaggregated.sbatch", ["--nodes=2"], {"MEGARL_FLEET_NODES": "2"}, [],
        "MEGARL_FLEET_NODES=2 needs at least 3",
    ),
    "world-not-divisible-by-tp": (
        "megarl_colocated.sbatch", ["--nodes=2", "--ntasks-per-node=1"], {}, ["parallel.tensor_parallel=4"],
        "= 2 is not divisible by tensor_parallel×pipeline_parallel = 4×1",
    ),
    "world-mismatch": (
        "megarl_colocated.sbatch", ["--nodes=2"], {"MEGARL_NPROC_PER_NODE": "2"}, [],
        "= 4 but the config wants TP×PP×DP = 2; add parallel.data_parallel=2",
    ),
    "single-node-on-two": (
        "megarl_single_node.sbatch", ["--nodes=2"], {}, [],
        "this script runs on one node but the allocation has 2",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MISFITS))
def test_misfit_allocation_fails_before_launch(slurm_cluster: LocalSlurm, tmp_path: Path, case: str) -> None:
    """A clear error (exit 2) from the batch script itself, before any srun step starts."""
    script, sbatch_args, extra_env, extra_sets, message = MISFITS[case]
    run, out = tmp_path / "run", tmp_path / "job.out"
    env = job_env(run, steps=3, extra_sets=extra_sets, **extra_env)
    job = submit(slurm_cluster, script, sbatch_args, env, out)
    info = wait_job(slurm_cluster, job, out, timeout=60)
    log = out.read_text()
    assert info["ExitCode"] == "2:0", f"{info}\n{log}"
    assert message in log, log
    assert "trainer step:" not in log and not run.exists(), "launched despite the misfit:\n" + log


@pytest.mark.skipif(
    not (ROOT / "megarl/checkpoint/state.py").exists(), reason="trainer checkpointing not available yet"
)
def test_preempt_checkpoint_requeue_resume(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """USR1 to the batch script → trainer checkpoints and exits → script requeues → resume.

    The batch script forwards USR1 to the trainer step and, after the ranks exit, runs
    `scontrol requeue` itself (MEGARL_REQUEUE_ON_USR1=1, the default): this is the path a
    `--signal=B:USR1@60` time-limit warning takes on a real cluster.
    """
    steps = 40
    run, out = tmp_path / "run", tmp_path / "job.out"
    env = job_env(run, steps=steps, extra_sets=["train.eval_every=0"])
    job = submit(slurm_cluster, "megarl_colocated.sbatch", ["--nodes=2", "--ntasks-per-node=1", "--requeue"], env, out)

    def fail(msg: str) -> None:
        slurm_cluster.cmd(["scancel", job], 10)
        pytest.fail(f"{msg}\n{slurm_cluster.diagnostics(out)}")

    deadline = time.monotonic() + 240
    seen: list[int] = []
    while time.monotonic() < deadline:
        seen = rl_steps(run) if (run / "metrics.jsonl").exists() else []
        if seen and max(seen) >= 3:
            break
        if slurm_cluster.job_info(job).get("JobState") in TERMINAL:
            fail("job ended before reaching step 3")
        time.sleep(0.2)
    else:
        fail("no step >= 3 in metrics.jsonl after 240 s")
    at_signal = max(seen)
    if at_signal >= steps:
        fail(f"run finished (step {at_signal}) before it could be preempted; make it longer")
    r = slurm_cluster.cmd(["scancel", "--batch", "--signal=USR1", job], 10)
    assert r.returncode == 0, r.stderr

    ckpt_root = run / "checkpoints"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (ckpt_root.is_dir() and any(p.is_dir() for p in ckpt_root.iterdir())):
        time.sleep(0.5)
    if not (ckpt_root.is_dir() and any(p.is_dir() for p in ckpt_root.iterdir())):
        fail(f"no checkpoint directory under {ckpt_root} within 180 s of SIGUSR1")

    info = wait_job(slurm_cluster, job, out, timeout=JOB_TIMEOUT_S, min_restarts=1)
    diag = f"\n{slurm_cluster.diagnostics(out)}"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}{diag}"
    log = out.read_text()
    assert "caught SIGUSR1, sending it to trainer step" in log, diag
    assert "requeueing job" in log and "restart 1 on 2 node(s)" in log, diag
    assert "preempted" in log, diag

    ckpt_steps = [int(m.group(1)) for p in ckpt_root.iterdir() if (m := re.search(r"(\d+)", p.name))]
    ckpt_step = max(ckpt_steps) if ckpt_steps else at_signal
    done = rl_steps(run)
    counts = Counter(done)
    assert sorted(counts) == list(range(1, steps + 1)), f"steps logged: {done}{diag}"
    repeated = sorted(s for s, c in counts.items() if c > 1)
    assert all(s > ckpt_step for s in repeated), f"steps <= checkpoint {ckpt_step} repeated: {repeated}{diag}"
    assert ckpt_step >= at_signal, f"checkpoint step {ckpt_step} < step {at_signal} seen before the signal"
