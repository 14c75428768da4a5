"""``megarl train`` with a Qwen3-MoE actor (2 layers, hidden 128, 4 experts of width 64, top-2)
on two trainer ranks (TP 1, DP 2) with the experts at EP 1 and EP 2, and one real vLLM CPU
engine: GRPO steps whose every sync writes the experts in the engine's kernel layout
(``megarl.engine.experts``) and is checked twice, by the coverage check (every engine
parameter written, every sent tensor used) and by the integrity probe (engine vs trainer
log-probs on a fixed sequence after every sync). A short warm start and an entropy bonus make
every sync carry changed weights (a random model earns no reward, so GRPO alone would not
move them). Each step's expert health (``moe/*``) counts exactly the batch's real tokens. The
coordinator measures (``adapt: false``: the batch and LR stay): its noise probe
reads the experts as their own class at EP 2 (parts over the EP group, micro-batches of 8 so
each rank has the two runs that needs). At EP 2 routing replay is on (``algo.router_replay:
trainer``, two updates a step, micro-batches of 4 for the probe's two runs): the run logs
``moe/route_mismatch*`` and ``train/old_kl_k3``."""

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
        f"parallel.micro_batch_size={4 if r3 else 8}",
        f"train.steps={STEPS}",
        "train.eval_every=0",
        "warm_start.steps=20",  # the first sync already carries trained weights
        "algo.entropy_coef=0.01",  # every step moves the weights, rewarded samples or not
        *r3,
        "optim.lr=1.0e-3",
        "coordinator.enabled=true",  # measures only: the probe's EP path in a real run
        "coordinator.adapt=false",
        "coordinator.min_prompts=8",
        "coordinator.lr_max=1.0e-2",  # (the example caps the LR below optim.lr)
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
    probed = [r.get("coord/probe_s/actor") for r in steps]
    print(f"EP={ep}: probe seconds {probed}, noise dof {[r.get('coord/noise_dof/actor') for r in steps]}")
    assert all(p is not None and p > 0 for p in probed), probed  # the probe read every step's first update
    # and a step with reward signal in two parts gave an estimate (measured: dof 1 from step 1 on)
    assert steps[-1]["coord/noise_dof/actor"] >= 1.0
    assert all(p < 1e-3 for p in probes), probes  # weight_sync.integrity_tol
    # expert health: the update routed exactly the batch's real tokens (prompt + response of
    # each row, one PPO epoch), whatever EP; per-layer loads and dead experts within bounds
    health = [{k.removeprefix("moe/"): r[k] for k in r if k.startswith("moe/")} for r in steps]
    print(f"EP={ep}: expert health per step = {health}")
    for r in steps:
        assert r["moe/tokens"] == r["rollout/sequence_tokens"] > 0, (r["moe/tokens"], r["rollout/sequence_tokens"])
        layers = [r["moe/load_max_over_mean/layer0"], r["moe/load_max_over_mean/layer1"]]
        assert r["moe/load_max_over_mean"] == max(layers) and all(1.0 <= x <= 4.0 for x in layers)
        assert r["moe/dead_experts"] in range(9)
    if not r3:
        assert not any(k.startswith("moe/route") for r in steps for k in r)
        return
    routes = [[r[f"moe/route_mismatch/layer{i}"] for i in (0, 1)] for r in steps]
    kl_old = [r["train/old_kl_k3"] for r in steps]
    print(f"routing replay: moe/route_mismatch/layer0,1 {routes}, train/old_kl_k3 {kl_old}")
    for r, per_layer in zip(steps, routes, strict=True):  # the metrics and the step line
        assert 0 <= min(per_layer) <= max(per_layer) < 0.5 and r["moe/route_mismatch"] == sum(per_layer) / 2
    assert all(0 <= k < 1e-2 for k in kl_old), kl_old
    assert "routes differ" in proc.stdout + proc.stderr
