"""``megarl train`` with a Qwen3-MoE actor (2 layers, hidden 128, 4 experts of width 64, top-2)
on two trainer ranks (TP 1, DP 2) with the experts at EP 1 and EP 2, and one real vLLM CPU
engine: GRPO steps whose every sync writes the experts in the engine's kernel layout
(``megarl.engine.experts``) and is checked twice, by the coverage check (every engine
parameter written, every sent tensor used) and by the integrity probe (engine vs trainer
log-probs on a fixed sequence after every sync). A short warm start and an entropy bonus make
every sync carry changed weights (a random model earns no reward, so GRPO alone would not
move them). At EP 2 routing replay is on (``algo.router_replay: trainer``, two updates a step):
the run completes and logs ``moe/route_mismatch*`` and ``train/old_kl_k3``."""

from pathlib import Path

import pytest

from megarl.metrics import read_metrics
from tests.helpers import megarl_train

STEPS = 3


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_grpo_steps_with_engine_parity(tmp_path: Path, ep: int) -> None:
    run = tmp_path / "run"
    # EP 2 with routing replay, two updates a step: the second replays routes of weights one step older
    r3 = ["algo.mini_batches=2", "algo.router_replay=trainer"] if ep == 2 else []
    sets = [
        "model.arch=qwen3_moe",
        "model.num_experts=4",
        "model.moe_ffn_hidden_size=64",
        "parallel.tensor_parallel=1",
        "parallel.data_parallel=2",
        f"parallel.expert_parallel={ep}",
        f"parallel.micro_batch_size={8 if r3 else 16}",  # (two mini-batches of 16 rows over DP 2)
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "warm_start.steps=20",  # the first sync already carries trained weights
        "algo.entropy_coef=0.01",  # every step moves the weights, rewarded samples or not
        *r3,
        "optim.lr=1.0e-3",
        "coordinator.enabled=false",
        "rollout.num_prompts=8",
        "rollout.samples_per_prompt=4",
        "data.num_train=200",
        "data.num_val=8",
        "train.tensorboard=false",
        "weight_sync.integrity_every=1",  # the probe after every sync
        f"train.run_dir={run}",
    ]
    proc = megarl_train("grpo_cpu.yaml", sets)
    (run / "stdout.log").write_text(proc.stdout + proc.stderr)
    steps = [r for r in read_metrics(run) if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    probes = [r["sync/integrity_max_abs_diff"] for r in steps]
    grads = [r["train/grad_norm"] for r in steps]
    print(f"Qwen3-MoE megarl train, EP={ep}: sync/integrity_max_abs_diff per step = {probes}, grad norms {grads}")
    assert all(g > 0 for g in grads), grads  # each sync sends changed weights
    assert all(p < 1e-3 for p in probes), probes  # weight_sync.integrity_tol
    if not r3:
        assert not any(k.startswith("moe/") for r in steps for k in r)
        return
    routes = [[r[f"moe/route_mismatch_l{i}"] for i in (0, 1)] for r in steps]
    kl_old = [r["train/old_kl_k3"] for r in steps]
    print(f"routing replay: moe/route_mismatch_l0,l1 {routes}, train/old_kl_k3 {kl_old}")
    for r, per_layer in zip(steps, routes, strict=True):  # the metrics and the step line
        assert 0 <= min(per_layer) <= max(per_layer) < 0.5 and r["moe/route_mismatch"] == sum(per_layer) / 2
    assert all(0 <= k < 1e-2 for k in kl_old), kl_old
    assert "routes differ" in proc.stdout + proc.stderr
