"""The tiny actor and the synthetic GRPO batch that ``tools/gpu_check.py`` runs on each device.

Both sides of the CPU-vs-GPU comparison import this module: the CPU fp32 reference (a child
process with CUDA hidden, gloo) and the device run (CUDA, bf16 params + fp32 main params in
the optimizer, NCCL). Weights travel from the reference to the device run as a ``torch.save``
file keyed by megatron parameter name (both build the same local layer spec), already rounded
to bf16 so the two runs start from exactly the same numbers.

Everything here is megarl's real code path: ``build_gpt`` (megatron DDP + optimizer),
``forward_logprobs``, ``update.losses.policy_loss_fn``, ``algo.grpo_advantages`` /
``global_denominator``, ``model.train.train_step`` and the gradient probe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

VOCAB, BATCH, SEQ, MBS, GROUP = 96, 8, 24, 4, 4
"""Synthetic rollout: BATCH responses (BATCH / GROUP prompts × GROUP samples) of SEQ tokens."""
LR, ADAM_EPS = 1e-3, 1e-4
"""adam_eps well above bf16 gradient noise: with 1e-8 the first Adam step is ~lr·sign(g), which
turns rounding-level differences of tiny gradients into lr-sized weight differences."""


@dataclass
class Actor:
    cfg: Any
    """megarl RunConfig of the actor."""
    model: Any
    """megarl.model.builder.Model."""
    dims: Any


def run_config(dtype: str) -> Any:
    from megarl.config import RunConfig

    cfg = RunConfig()
    m = cfg.model
    m.vocab_size, m.num_layers, m.hidden_size, m.ffn_hidden_size = VOCAB, 2, 64, 128
    m.num_attention_heads, m.num_query_groups, m.max_position_embeddings = 4, 2, 64
    m.dtype = dtype
    cfg.parallel.micro_batch_size = MBS
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = LR, ADAM_EPS, 0.0
    cfg.rollout.temperature = 1.0
    return cfg


def init_dims(seed: int = 5) -> Any:
    """TP=1, PP=1 process groups: gloo on CPU, NCCL on CUDA (megarl.distributed decides)."""
    from megarl.distributed import init_distributed

    return init_distributed(1, 1, seed=seed)


def build_actor(dims: Any, dtype: str, weights: dict[str, torch.Tensor] | None = None) -> Actor:
    """A trainable actor; ``weights`` (fp32, by megatron name) replace its initial ones, else
    its own initial weights are rounded to bf16 in place (so a bf16 copy is exact)."""
    from megarl.model.builder import build_gpt

    cfg = run_config(dtype)
    model = build_gpt(cfg.model, cfg.parallel, dims, optim=cfg.optim, seed=5)
    with torch.no_grad():
        for name, p in model.core.named_parameters():
            src = p.detach().float() if weights is None else weights[name]
            if src.shape != p.shape:
                raise ValueError(f"weight '{name}': reference has shape {tuple(src.shape)}, model {tuple(p.shape)}")
            p.copy_(src.to(torch.bfloat16).float() if weights is None else src)
    model.optimizer.reload_model_params()  # the optimizer's fp32 main params follow the model's
    return Actor(cfg, model, dims)


def weights_of(actor: Actor) -> dict[str, torch.Tensor]:
    """The model's parameters as fp32 CPU tensors, by megatron name."""
    return {n: p.detach().float().cpu().clone() for n, p in actor.model.core.named_parameters()}


def main_params(actor: Actor) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 main parameters (bf16 training keeps them apart from the model's
    bf16 copy, which cannot resolve an lr-sized step on a weight near 1) as CPU tensors."""
    opt = actor.model.optimizer
    chained = getattr(opt, "chained_optimizers", [opt])
    main_of: dict[int, torch.Tensor] = {}
    for o in chained:
        for model_group, main_group in zip(
            getattr(o, "float16_groups", []), getattr(o, "fp32_from_float16_groups", [])
        ):
            for p, m in zip(model_group, main_group, strict=True):
                main_of[id(p)] = m
    out = {}
    for n, p in actor.model.core.named_parameters():
        main = main_of.get(id(p), p)
        if main.dtype != torch.float32:
            raise ValueError(f"parameter '{n}' is {p.dtype} and the optimizer holds no fp32 main copy of it")
        out[n] = main.detach().cpu().clone()
    return out


def synthetic_rollout(seed: int) -> dict[str, torch.Tensor]:
    """Random tokens, ragged response masks after a 6-token prompt, and rewards from a fixed
    rule of the tokens (share of response tokens in the lower half of the vocabulary), so
    reward differences within a group carry a learnable signal."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.zeros(BATCH, SEQ)
    for b in range(BATCH):
        mask[b, 5 : 5 + 6 + (b * 5) % 12] = 1.0
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # mask[:, t] marks tokens[t+1]
    rewards = ((nxt < VOCAB // 2).float() * mask).sum(1) / mask.sum(1)
    return {"tokens": tokens, "mask": mask, "rewards": rewards, "group_ids": torch.arange(BATCH) // GROUP}


def grpo_batch(actor: Actor, rollout: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """The train batch on the actor's device (old log-probs from the actor itself) and the
    loss denominator over the whole batch."""
    from megarl import algo
    from megarl.model.forward import forward_logprobs

    dev = actor.dims.device
    tokens = rollout["tokens"].to(dev)
    mask = rollout["mask"].to(dev)
    old = forward_logprobs(actor.model, tokens, micro_batch_size=MBS, temperature=actor.cfg.rollout.temperature)
    adv = algo.grpo_advantages(rollout["rewards"], rollout["group_ids"]).to(dev)
    denom = algo.global_denominator(actor.cfg.algo.loss_agg, rollout["mask"])
    batch = {
        "tokens": tokens,
        "mask": mask,
        "adv": adv,
        "old_logprobs": old["logprobs"],
        "engine_logprobs": old["logprobs"],
    }
    return batch, denom


def one_step(actor: Actor, batch: dict[str, torch.Tensor], denom: float) -> tuple[dict[str, float], float]:
    from megarl.model.train import train_step
    from megarl.types import UpdateRows
    from megarl.update.losses import policy_loss_fn

    loss_fn = policy_loss_fn(actor.cfg.algo, actor.cfg.rollout.temperature, actor.dims.tp_group, denom)
    terms, grad_norm = train_step(actor.model, UpdateRows(**batch), loss_fn, micro_batch_size=MBS)
    return {name: float(v) for name, v, _ in terms.present()}, grad_norm


def reference_step(actor: Actor, seed: int = 11) -> dict[str, Any]:
    """Log-probs, loss, grad norm on one batch; main params and log-probs after one optimizer
    step on it. (The loss at the first step is −Σ A·mask / D, ratio = 1, so it checks the
    advantage and aggregation path; the log-probs after the step check the update.)"""
    batch, denom = grpo_batch(actor, synthetic_rollout(seed))
    stats, grad_norm = one_step(actor, batch, denom)
    from megarl.model.forward import forward_logprobs

    after = forward_logprobs(actor.model, batch["tokens"], micro_batch_size=MBS, temperature=1.0)["logprobs"]
    return {
        "logprobs": batch["old_logprobs"].float().cpu(),
        "logprobs_after": after.float().cpu(),
        "mask": batch["mask"].cpu(),
        "loss": stats["loss"],
        "grad_norm": grad_norm,
        "main_params": main_params(actor),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grpo_loop(actor: Actor, steps: int, seed: int = 21) -> dict[str, Any]:
    """``steps`` policy updates on one synthetic GRPO rollout batch (old log-probs fixed at the
    first, as PPO epochs over one rollout), with the gradient probe measuring every step.

    Returns per-step loss, grad norm, probe |g|² (local, per micro-batch), wall time, and the
    policy-gradient objective J = Σ A_t·log π(a_t) over response tokens before and after."""
    from megarl.model.forward import forward_logprobs
    from megarl.model.grad_stats import GradProbe

    rollout = synthetic_rollout(seed)
    batch, denom = grpo_batch(actor, rollout)
    actor.model.probe = GradProbe(actor.dims, microbatch=True)
    adv_tok = batch["adv"][:, None] * batch["mask"]

    def objective() -> float:
        lp = forward_logprobs(actor.model, batch["tokens"], micro_batch_size=MBS, temperature=1.0)["logprobs"]
        return float((adv_tok * lp).sum())

    out: dict[str, Any] = {"loss": [], "grad_norm": [], "probe_local_sq": [], "probe_mb": [], "seconds": []}
    out["objective_before"] = objective()
    for _ in range(steps):
        sync(actor.dims.device)
        t0 = time.perf_counter()
        actor.model.probe.start()
        stats, grad_norm = one_step(actor, batch, denom)
        local = actor.model.probe.gather_local()
        sync(actor.dims.device)
        out["seconds"].append(time.perf_counter() - t0)
        out["loss"].append(stats["loss"])
        out["grad_norm"].append(grad_norm)
        out["probe_local_sq"].append(local[0])
        out["probe_mb"].append(len(actor.model.probe.mb_sq))
    out["objective_after"] = objective()
    actor.model.probe = None
    return out
