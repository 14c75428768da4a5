"""torchrun worker (one gloo rank): ``PolicyUpdater`` on a tiny real Megatron actor and critic.

Each scenario builds fresh models from the same HF folder, runs phases 2–4 the trainer's way
(``evaluate`` → advantages → ``PolicyUpdater``) on a fixed ragged batch and records the step's
metrics (keys in order), the models' Adam step counts and what moved. Rank 0 writes
``--out``/result.json; ``test_updater.py`` asserts the numbers.

- ``direction``: actor only, one update, advantages +1 on rows 0–3 and −0.5 on rows 4–7, the
  engines' log-probs the actor's minus a known shift; the per-token log-probs before and after.
- ``counts``: actor + critic (GAE), ppo_epochs × mini_batches = 3 × 2.
- ``warmup``: actor + critic at step 0 of critic.warmup_steps = 2 (the actor waits), and
  the critic's V_old and returns to check its terms by hand.
"""

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import copy_weights, load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import AlgoConfig, CriticConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig  # noqa: E402
from megarl.coordinator import StepPlan  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import Model, build_gpt  # noqa: E402
from megarl.model.forward import forward_logprobs  # noqa: E402
from megarl.planning import Planner, PlanSettings  # noqa: E402
from megarl.types import Advantages, RolloutBatch  # noqa: E402
from megarl.update import AdvantageEstimator, PolicyUpdater, UpdateSettings, evaluate  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()

MBS, B, S, LR = 2, 8, 12, 1e-3
OPTIM = OptimConfig(lr=LR, clip_grad=0.0, adam_eps=1e-4)

dims = init_distributed(1, 1, seed=7)
hf_cfg, hf = read_hf_folder(args.hf)
mcfg = model_config_from_hf(hf_cfg, ModelConfig())
adapter = LlamaQwen2Adapter(mcfg)
pcfg = ParallelConfig(micro_batch_size=MBS)

g = torch.Generator().manual_seed(11)
tokens = torch.randint(3, mcfg.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses after a 4-token prompt
    mask[b, 3 : 3 + 3 + (b * 3) % 6] = 1.0
rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
batch = RolloutBatch(
    tokens=tokens,
    mask=mask,
    engine_logprobs=None,
    rewards=rewards,
    group_ids=torch.arange(B) // 4,
    response_lens=mask.sum(1).long(),
    truncated=torch.zeros(B, dtype=torch.bool),
    version=0,
)


def build(critic: bool) -> tuple[Model, Model | None]:
    actor = build_gpt(mcfg, pcfg, dims, optim=OPTIM, seed=7)
    load_hf_tensors(actor, adapter, hf)
    if not critic:
        return actor, None
    value = build_gpt(dataclasses.replace(mcfg, tie_embeddings=False), pcfg, dims, value_head=True, optim=OPTIM, seed=7)
    copy_weights(actor, value, adapter)  # the trainer's critic.init_from_actor
    with torch.no_grad():  # a non-zero value head
        for name, p in value.core.named_parameters():
            if name.startswith("output_layer."):
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    value.optimizer.reload_model_params()
    return actor, value


def adam_steps(model: Model) -> int:
    """Optimizer steps taken so far (torch Adam's per-parameter ``step``; 0 before the first)."""
    state = model.optimizer.optimizer.state
    return max((int(st["step"]) for st in state.values() if "step" in st), default=0)


def params(model: Model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.core.named_parameters()}


def moved(before: dict[str, torch.Tensor], model: Model) -> bool:
    return any(not torch.equal(before[n], p.detach()) for n, p in model.core.named_parameters())


def run(
    cfg: RunConfig, critic: bool, step: int, adv: Advantages | None = None, engine_shift: torch.Tensor | None = None
) -> dict:
    """``engine_shift``: the step asked the engines, whose log-probs are the actor's minus it."""
    actor, value = build(critic)

    def lp() -> torch.Tensor:
        return forward_logprobs(actor, tokens, micro_batch_size=MBS, temperature=cfg.rollout.temperature)["logprobs"]

    before, w_actor = lp(), params(actor)
    engine = None if engine_shift is None else (before - engine_shift) * mask
    rollout = dataclasses.replace(batch, engine_logprobs=engine)
    ev = evaluate(cfg.algo, cfg.rollout, cfg.parallel, rollout, actor, None, value)
    if adv is None:
        adv, _ = AdvantageEstimator(cfg.algo)(rollout, ev)
    plan = StepPlan(
        step=step,
        num_prompts=2,
        samples_per_prompt=4,
        lr={"actor": LR, "critic": LR},
        dp_shares=None,
        predicted_goodput=None,
        b_noise={},
        reason="test",
    )
    planner = Planner(PlanSettings.of(cfg), dims.dp, ["actor", "critic"] if critic else ["actor"])
    updater = PolicyUpdater(UpdateSettings.of(cfg), dims, actor, value, planner)

    w_critic = params(value) if value is not None else None
    metrics = updater(rollout, adv, ev, plan, step)
    out = {
        "metrics": list(metrics.items()),
        "actor_steps": adam_steps(actor),
        "actor_moved": moved(w_actor, actor),
        "logprobs_before": before.tolist(),
        "logprobs_after": lp().tolist(),
    }
    if value is not None:
        assert ev.old_values is not None and adv.returns is not None and w_critic is not None
        out.update(
            critic_steps=adam_steps(value),
            critic_moved=moved(w_critic, value),
            old_values=ev.old_values.tolist(),
            returns=adv.returns.tolist(),
            mask=adv.mask.tolist(),
        )
    return out


def config(**algo: object) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel = pcfg
    cfg.algo = AlgoConfig(kl_coef=0.0, **algo)  # type: ignore[arg-type]
    return cfg


result = {"mask": mask.tolist()}
signs = torch.tensor([1.0] * 4 + [-0.5] * 4)
shift = 0.1 * torch.randn(B, S, generator=g)
result["shift"] = shift.tolist()
result["direction"] = run(config(), critic=False, step=0, adv=Advantages(adv=signs, mask=mask), engine_shift=shift)
ppo = config(name="ppo", advantage="gae", ppo_epochs=3, mini_batches=2)
result["counts"] = run(ppo, critic=True, step=0)
warm = config(name="ppo", advantage="gae")
warm.critic = CriticConfig(warmup_steps=2)
result["warmup"] = run(warm, critic=True, step=0)

if dims.is_rank0:
    Path(args.out, "result.json").write_text(json.dumps(result))
torch.distributed.barrier()  # leave together (tests/model/worker_moe.py says why)
shutdown()
