"""torchrun worker: the PPO critic on its OWN layouts, next to an actor on megatron's global one.

The actor is built at ``--tp/--pp`` (megatron's global parallel_state); each critic layout of
``--critics`` (``t<TP>p<PP>``, suffix ``d`` = distributed optimizer) gets its own groups from
``init_layout`` and is initialised from the actor the trainer's way (``copy_weights``: full
HF-named tensors across layouts). Per critic: values, one clipped value-loss Adam step (rows
split over the critic's DP ranks), values again, and the updated weights (HF trunk + value
head). ``--ckpt A:B`` saves critic A after its step, loads it into a fresh critic of layout B,
and takes one more step on both. Rank 0 writes everything to ``--out``.
"""

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megarl import algo  # noqa: E402
from megarl.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint  # noqa: E402
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import copy_weights, hf_state_dict, load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megarl.distributed import init_distributed, init_layout, layout_rng  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import forward_values  # noqa: E402
from megarl.model.train import train_step  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--pp", type=int, default=1)
ap.add_argument("--critics", required=True)
ap.add_argument("--ckpt", default="")
args = ap.parse_args()

MBS = 2
# adam_eps well above fp32 gradient noise, as in worker_parity.py: with eps=1e-8 the first Adam
# step is ~lr·sign(g), which turns 1e-9 reduction-order differences into lr-sized ones.
OPTIM = OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-4)

dims = init_distributed(args.tp, args.pp, seed=7)
hf_cfg, hf = read_hf_folder(args.hf)
mcfg = model_config_from_hf(hf_cfg, ModelConfig())
cmcfg = dataclasses.replace(mcfg, tie_embeddings=False)
adapter = LlamaQwen2Adapter(mcfg)
actor = build_gpt(mcfg, ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp), dims, trainable=False)
load_hf_tensors(actor, adapter, hf)

g = torch.Generator().manual_seed(123)
B, S = 16, 20
tokens = torch.randint(3, mcfg.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses after a 6-token prompt
    mask[b, 5 : 5 + 4 + (b % 9)] = 1.0
returns = torch.rand(B, S, generator=g)
targets = torch.rand(B, generator=g)[:, None].expand(B, S).contiguous()
denom = algo.global_denominator("token-mean", mask)


def value_loss_fn(mb, out):
    per_tok = algo.value_loss(out[..., 0], mb["old_values"], mb["returns"], mb["mask"], clip=0.2)
    loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
    return loss, {"loss": loss.detach()}


def parse(spec):
    tp, pp = int(spec[1 : spec.index("p")]), int(spec[spec.index("p") + 1 :].rstrip("d"))
    return tp, pp, spec.endswith("d")


def build_critic(spec):
    tp, pp, distopt = parse(spec)
    cdims = init_layout(dims, tp, pp)
    pcfg = ParallelConfig(
        tensor_parallel=tp, pipeline_parallel=pp, micro_batch_size=MBS, use_distributed_optimizer=distopt
    )
    critic = build_gpt(cmcfg, pcfg, cdims, value_head=True, optim=OPTIM, seed=7)
    copy_weights(actor, critic, adapter)  # the trainer's critic.init_from_actor
    with torch.no_grad():  # a non-zero value head, so the step moves the trunk too
        for name, p in critic.core.named_parameters():
            if name.startswith("output_layer."):
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    critic.optimizer.reload_model_params()
    return critic


def rows(cdims):
    per = B // cdims.dp
    return slice(cdims.dp_rank * per, (cdims.dp_rank + 1) * per)


def step(critic, old_values, rets):
    sl = rows(critic.dims)
    batch = {"tokens": tokens[sl], "mask": mask[sl], "old_values": old_values[sl], "returns": rets[sl]}
    return train_step(critic, batch, value_loss_fn, micro_batch_size=MBS, value_model=True)


def value_head(critic):
    """The value head (weight row + bias) on every rank, from the critic's last stage."""
    cd = critic.dims
    own = cd.is_last_stage and cd.tp_rank == 0 and cd.dp_rank == 0
    flags = [None] * cd.world_size
    dist.all_gather_object(flags, own)
    if own:
        t = torch.cat([critic.core.output_layer.weight.detach().flatten(), critic.core.output_layer.bias.detach()])
    else:
        t = torch.empty(mcfg.hidden_size + 1)
    dist.broadcast(t, src=flags.index(True))
    return t


def weights(critic, prefix):
    out = {f"{prefix}/{k}": v for k, v in hf_state_dict(critic, adapter).items()}
    out[f"{prefix}/value_head"] = value_head(critic)
    return out


result, info, critics = {}, {}, {}
for spec in args.critics.split(","):
    critic = build_critic(spec)
    critics[spec] = critic
    cd = critic.dims
    info[spec] = {
        "tp": cd.tp,
        "pp": cd.pp,
        "dp": cd.dp,
        "global": cd.global_layout,
        "tp_ranks": dist.get_process_group_ranks(cd.tp_group),
        "pp_ranks": dist.get_process_group_ranks(cd.pp_group),
        "dp_ranks": dist.get_process_group_ranks(cd.dp_group),
    }
    # weight init on this layout forks a model-parallel RNG stream seeded by ITS TP rank; the
    # global tracker (the actor's streams) is back afterwards
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    before = tracker.get_states()
    with layout_rng(cd, 7):
        inside = tracker.get_states()["model-parallel-rng"]
    expected = torch.Generator().manual_seed(7 + 2718 + cd.tp_rank).get_state()
    after = tracker.get_states()
    info[spec]["rng_inside_ok"] = bool(torch.equal(inside, expected)) or cd.global_layout
    info[spec]["rng_restored"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    v0 = forward_values(critic, tokens, micro_batch_size=MBS)
    stats, gnorm = step(critic, v0, returns)
    v1 = forward_values(critic, tokens, micro_batch_size=MBS)
    result.update(
        {
            f"{spec}/values0": v0,
            f"{spec}/values1": v1,
            f"{spec}/loss": torch.tensor([stats["loss"]]),
            f"{spec}/grad_norm": torch.tensor([gnorm]),
        }
    )
    result.update(weights(critic, f"{spec}/w1"))

ckpt_info = {}
for pair in [p for p in args.ckpt.split(",") if p]:
    src, dst = pair.split(":")
    root = Path(args.out) / f"ckpt_{src}"
    save_checkpoint(root, {"critic": critics[src]}, {"step": 1}, keep_last=1)
    loaded = build_critic(dst)
    load_checkpoint(root, {"critic": loaded})
    meta = json.loads((root / "step_00000001" / "meta.json").read_text())
    ckpt_info[pair] = meta["models"]["critic"]["layout"]
    result.update(weights(loaded, f"{pair}/at_load"))
    result[f"{pair}/loaded_values"] = forward_values(loaded, tokens, micro_batch_size=MBS)
    # one more step on both: Adam moments and step count must have been resharded too
    v1 = result[f"{src}/values1"]
    for name, c in (("orig", critics[src]), ("loaded", loaded)):
        stats, gnorm = step(c, v1, targets)
        result[f"{pair}/{name}/loss2"] = torch.tensor([stats["loss"]])
        result.update(weights(c, f"{pair}/{name}/w2"))

if dims.is_rank0:
    from safetensors.torch import save_file

    out = Path(args.out)
    save_file({k: v.contiguous() for k, v in result.items()}, str(out / "result.safetensors"))
    (out / "info.json").write_text(json.dumps({"critics": info, "ckpt_layouts": ckpt_info}))

# leave together and tear the groups down explicitly (a rank exiting while its peer still holds
# live gloo groups can abort in their destructors: "terminate called without an active exception")
dist.barrier()
from megarl.distributed import shutdown  # noqa: E402

shutdown()
