"""Engines SIGKILLed at every phase of a real `megarl train` run (two real vLLM engines, TP=2
trainer) are restarted and brought to the current weights, and the run equals an
uninterrupted one: same metrics at every step, same final weights.

The kills are placed by the test-only hook ``MEGARL_FAULT`` (``megarl.fleet.faults``):
the death is a real SIGKILL of the engine process; recovery is the ordinary code path.
Step s samples with weight version s and its sync pushes version s + 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT

SETS = [
    "coordinator.enabled=false",
    "warm_start.steps=20",
    "rollout.num_prompts=8",
    "rollout.samples_per_prompt=4",
    "data.num_train=2000",
    "data.num_val=16",
    "train.tensorboard=false",
    "train.eval_every=0",
    "parallel.micro_batch_size=16",
    "rollout.num_engines=2",
    "rollout.seeded=true",
    "train.steps=4",
    "weight_sync.integrity_every=1",  # a check at every sync (the demo checks every 10th)
]
FAULTS = [
    "kill_engine_at=logprobs:version=1:engine=0",  # step 1, engine idle: found dead before step 1's sync
    "kill_engine_at=integrity:version=2:engine=1",  # step 1's integrity check (after update 2 committed)
    "kill_engine_at=sync_begin:version=3:engine=1",  # step 2's sync: between begin and load
    "kill_engine_at=sync_load:version=4:engine=0",  # step 3's sync: load request in flight (connection reset)
    "kill_engine_at=sync_commit:version=5:engine=1",  # step 4's sync: engine0 committed 5, engine1 dies first
]
# wall-clock measurements and the restart counters differ by design; everything else must not
SKIP_PREFIXES = ("time", "timing/", "fleet/", "coord/probe_s/", "pipeline/trainer_wait", "pipeline/fleet_wait")
SKIP_SUFFIXES = ("_s",)


def _train(run: Path, fault: str = "", extra: list[str] | None = None) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGARL_FAULT=fault)
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "examples/grpo_cpu.yaml")]
    cmd += [a for s in [*SETS, *(extra or []), f"train.run_dir={run}"] for a in ("--set", s)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    return out


def _steps(run: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps: dict[int, dict] = {}
    for r in recs:
        if "rollout/reward_mean" in r:
            assert r["step"] not in steps, f"step {r['step']} logged twice"
            steps[r["step"]] = r
    return steps


def _compared(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(SKIP_PREFIXES) and not k.endswith(SKIP_SUFFIXES)}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("recovery") / "base"
    _train(run)
    return run


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_engines_killed_at_every_phase_run_equals_uninterrupted(base: Path, tmp_path: Path, transport: str) -> None:
    """Blocking restarts (each replayed before the run goes on): shm replays a restarted engine
    from the committed files, http from the kept bytes."""
    hurt = tmp_path / "hurt"
    log = _train(hurt, ";".join(FAULTS), [f"weight_sync.transport={transport}", "rollout.engine_restart=blocking"])
    # every fault fired, at its phase, on a real process
    for phase, version, engine in [
        ("logprobs", 1, 0),
        ("integrity", 2, 1),
        ("sync_begin", 3, 1),
        ("sync_load", 4, 0),
        ("sync_commit", 5, 1),
    ]:
        assert f"SIGKILL engine{engine}" in log and f"at {phase} of version {version}" in log, (phase, log[-6000:])
    assert "engine0 died during update 4" in log  # killed with the load request in flight
    assert "engine1 died before committing version 5" in log
    assert "transport: " + transport in log
    sb, sh = _steps(base), _steps(hurt)
    assert sorted(sb) == sorted(sh) == [1, 2, 3, 4]
    # restarts: 0 in the clean run; in the hurt one, counted by the step whose phase saw them
    assert [sb[s]["fleet/restarts"] for s in range(1, 5)] == [0, 0, 0, 0]
    assert [sh[s]["fleet/restarts"] for s in range(1, 5)] == [2, 3, 4, 5]
    assert [sh[s]["rollout/policy_version"] for s in range(1, 5)] == [1, 2, 3, 4]
    for s in range(1, 5):
        a, b = _compared(sb[s]), _compared(sh[s])
        assert a.keys() == b.keys(), (s, sorted(a.keys() ^ b.keys()))
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not diff, (s, diff)
    val_b = [r["val/reward"] for r in map(json.loads, (base / "metrics.jsonl").open()) if "val/reward" in r]
    val_h = [r["val/reward"] for r in map(json.loads, (hurt / "metrics.jsonl").open()) if "val/reward" in r]
    assert val_b == val_h and len(val_b) == 2
    wb, wh = load_file(str(base / "hf_final/model.safetensors")), load_file(str(hurt / "hf_final/model.safetensors"))
    assert wb.keys() == wh.keys()
    assert max((wb[k] - wh[k]).abs().max().item() for k in wb) == 0.0


BACKGROUND_FAULT = "kill_engine_at=generate:version=2:engine=1"  # step 2, its /generate in flight


def test_engine_killed_mid_step_restarts_in_the_background(base: Path, tmp_path: Path) -> None:
    """#41 E: with two engines, an engine killed mid-generation is restarted in the background
    while the survivor takes its prompts (same per-prompt seeds: the same samples) and the run
    goes on without waiting for the restart. The run equals the uninterrupted one, metric for
    metric; steps 3 and 4 are served by the survivor alone (the restart is still under way: a
    step that waited for it would find two engines serving), and no step takes the restart's
    time (an engine's start, several seconds here, is over 20x a step). What is left is CPU
    contention: the restart runs at nice 19, yet on this 2-core machine, with both cores taken
    by the trainer's two ranks, it still slows their latency-bound gloo exchanges up to ~2x
    (benchmarks/restart_contention.py), so the bound on the steps beside it is 3x the
    undisturbed step. (Rejoining at an update and the fleet with no survivor:
    tests/fleet/test_fleet.py; the repeated-kill benchmark: benchmarks/engine_kills.py.)"""
    hurt = tmp_path / "hurt"
    log = _train(hurt, BACKGROUND_FAULT)
    assert "SIGKILL engine1" in log and "at generate of version 2" in log, log[-6000:]
    assert "engine1 died mid-generation" in log and "engine1 is down; restarting it in the background" in log
    sb, sh = _steps(base), _steps(hurt)
    assert sorted(sh) == [1, 2, 3, 4]
    assert [sh[s]["fleet/restarts"] for s in range(1, 5)] == [0, 1, 1, 1]
    assert sh[2]["fleet/reissued_prompts"] > 0 and sh[2]["fleet/serving"] == 1
    for s in range(1, 5):
        a, b = _compared(sb[s]), _compared(sh[s])
        assert a.keys() == b.keys(), (s, sorted(a.keys() ^ b.keys()))
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not diff, (s, diff)
    times = {s: (sb[s]["timing/step/total"], sh[s]["timing/step/total"]) for s in range(1, 5)}
    assert [sh[s]["fleet/serving"] for s in (2, 3, 4)] == [1, 1, 1], "a step waited for the restart"
    assert sh[4]["fleet/rejoins"] == 0
    for phase in ("update", "sync"):  # the step with the kill: nothing after its generation waits
        base_s, hurt_s = sb[2][f"timing/step/{phase}"], sh[2][f"timing/step/{phase}"]
        assert hurt_s <= 3 * base_s + 0.05, (phase, base_s, hurt_s, times)
    assert all(sh[s]["timing/step/total"] <= 3 * sb[s]["timing/step/total"] for s in (3, 4)), times
    wb, wh = load_file(str(base / "hf_final/model.safetensors")), load_file(str(hurt / "hf_final/model.safetensors"))
    assert max((wb[k] - wh[k]).abs().max().item() for k in wb) == 0.0
