"""torchrun worker (2 ranks; 4 for ``--layouts tp2ep2,tp2ep2etp1,tp4etp2``): a Qwen3-MoE model from an HF folder at EP=1 (DP=2), then at EP=2
(DP=2, each rank holding 2 of the 4 experts), then at TP=2 (experts split like a dense MLP,
with sequence parallelism, which megatron needs to train MoE under TP; the plain variant), then
at TP=2 with expert TP 1 (experts whole on each TP rank, ``etp1``) in the
same process group: full logits, log-probs (and of 15-column rows, which SP pads), and one optimizer step of a fixed GRPO loss per variant (loss, grad norm, every gradient after
the DP reduction, weights after the step): the plain optimizer, the distributed optimizer, the
router losses on (load balancing 1e-2, z-loss 1e-3), and the router losses alone, whose last
router's gradient is checked against a direct implementation of their formulas. Each rank
saves its own results; expert gradients are keyed by their GLOBAL expert index. With the plain
optimizer (and in three steps whose routing is forced onto two experts) the tokens each expert
received (``megarl.model.expert_load``) are saved too. ``--hf-mixtral``:
a Mixtral model's logits and the weights read back out of each layout (forward only). At EP 1,
EP 2 and PP 2 (DP 1: routing replay only), the routing replay checks of ``worker_moe_replay.py``."""

import argparse
import dataclasses
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from safetensors.torch import save_file  # noqa: E402

from megarl import algo  # noqa: E402
from megarl.checkpoint.experts import to_global  # noqa: E402
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import hf_state_dict, load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megarl.coordinator.estimates import grad_updates  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.grad_parts import ExpertParts, chunks, grad_stats, read_parts  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs  # noqa: E402
from megarl.model.grad_stats import GradProbe  # noqa: E402
from megarl.model.routes import attach as attach_routes  # noqa: E402
from megarl.model.train import train_step  # noqa: E402
from tests.model.worker_moe_replay import replay_checks  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--hf-softmax-all", help="a second HF model, norm_topk_prob=false: its logits only")
ap.add_argument("--hf-mixtral", help="a Mixtral HF model: its logits and read-back weights only")
ap.add_argument("--layouts", default="ep1,ep2,tp2,tp2etp1,pp2", help="which of LAYOUTS to run, in order")
args = ap.parse_args()

B, S, MBS = 8, 16, 2
AUX, Z = 1e-2, 1e-3
hf_cfg, hf = read_hf_folder(args.hf)
base = model_config_from_hf(hf_cfg, ModelConfig())
adapter = LlamaQwen2Adapter(base)
# adam_eps well above fp32 gradient noise (see tests/model/worker_parity.py)
OPTIM = OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-4)
VARIANTS = {  # name: (distributed optimizer, router losses on, main loss weight)
    "plain": (False, False, 1.0),
    "distopt": (True, False, 1.0),
    "aux": (False, True, 1.0),
    "aux_only": (False, True, 0.0),  # the router losses' gradient alone, against a reference
}

g = torch.Generator().manual_seed(123)
tokens = torch.randint(3, base.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses after a 5-token prompt
    mask[b, 4 : 4 + 3 + (b % 8)] = 1.0
adv = algo.grpo_advantages(torch.rand(B, generator=g), torch.arange(B) // 4)
denom = algo.global_denominator("token-mean", mask)


def loss_fn(weight):
    def fn(mb, logits):
        cur = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        per_tok, _ = algo.policy_loss(cur, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
        loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
        return loss * weight, {"loss": loss.detach()}

    return fn


def reference_router_grad(inputs, weight, k, total):
    """d/dW of Σ_mb (n_mb / N)·(AUX·aux_mb + Z·z_mb) for the last layer's router W (E, H), its
    micro-batch inputs held fixed (no later layer depends on W): Switch Transformer eq. 4,
    aux = E·Σᵢ fᵢ·Pᵢ with fᵢ = (tokens sending to i) / (k·n), Pᵢ = mean router probability of
    i (softmax over all experts); ST-MoE eq. 5, z = mean over tokens of logsumexp(logits)²."""
    w = weight.detach().clone().requires_grad_(True)
    objective = 0.0
    for x in inputs:
        x = x.reshape(-1, x.shape[-1]).float()
        n, experts = x.shape[0], w.shape[0]
        logits = x @ w.t()
        probs = logits.softmax(-1)
        counts = torch.zeros(experts).scatter_add_(0, probs.topk(k, -1).indices.reshape(-1), torch.ones(n * k))
        aux = experts * ((counts / (k * n)) * probs.mean(0)).sum()
        z = logits.logsumexp(-1).square().mean()
        objective = objective + (n / total) * (AUX * aux + Z * z)
    objective.backward()
    return w.grad


def full_logits(model):
    model.module.eval()
    with torch.no_grad():  # every rank runs the whole batch (its experts serve both)
        positions = torch.arange(S).expand_as(tokens)
        logits = model.core(tokens, positions, None)
    if model.dims.tp > 1:  # vocabulary shards
        parts = [torch.empty_like(logits) for _ in range(model.dims.tp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=model.dims.tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., : model.vocab_size].clone()


def hf_grads(model):
    """Every gradient after the step's reduction, full and HF-named (rank 0; gathered over TP,
    EP and PP as the weights are): the main grads swapped in for the weights while they are read."""
    params = [p for p in model.core.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.detach().to(p.dtype)
    try:
        return hf_state_dict(model, adapter)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def force_routing(model, first, second):
    """Every token of every layer to experts ``first`` and ``second`` (router logits 10 and 5,
    the others 0): all token embeddings one vector v, attention and expert outputs zero, so each
    layer's router sees the same input x = pre_mlp_layernorm(v), and its rows are set along x."""
    core = model.core
    with torch.no_grad():
        core.embedding.word_embeddings.weight.fill_(1.0)
        for layer in core.decoder.layers:
            layer.self_attention.linear_proj.weight.zero_()
            for expert in layer.mlp.experts.local_experts:
                expert.linear_fc2.weight.zero_()
            x = layer.pre_mlp_layernorm(torch.ones(1, base.hidden_size))[0]
            router = layer.mlp.router.weight
            router.zero_()
            router[first], router[second] = 10.0 * x / x.square().sum(), 5.0 * x / x.square().sum()


def forced_routing_steps(layout, dims, ep):
    """Three optimizer steps with every token forced to experts 1 and 3 (experts 0 and 2
    dead; at EP=2 one live expert on each rank): each step's expert counts."""
    model = build_gpt(base, ParallelConfig(micro_batch_size=MBS, expert_parallel=ep), dims, optim=OPTIM,
                      track_experts=True)  # fmt: skip
    load_hf_tensors(model, adapter, hf)
    force_routing(model, 1, 3)
    old = forward_logprobs(model, tokens, micro_batch_size=MBS, temperature=1.0)["logprobs"]
    rows = slice(dims.dp_rank * B // dims.dp, (dims.dp_rank + 1) * B // dims.dp)
    batch = {"tokens": tokens[rows], "mask": mask[rows], "adv": adv[rows], "old": old[rows]}
    out = {}
    for step in range(3):
        model.expert_load.reset()
        train_step(model, batch, loss_fn(1.0), micro_batch_size=MBS)
        out[f"{layout}/forced/counts{step}"] = model.expert_load.read()
    return out


# The coordinator's noise probe (#44 item 6), on the plain and distributed-optimizer steps at
# DP = 2: parts are the micro-batches (runs of 1: the test is about accounting, not about whole
# groups), units are tokens (token-mean loss), every row has an advantage.
EVERY = [slice(0, B // 2), slice(B // 2, B)]  # each DP rank's rows
UNITS, SIGNAL = mask.sum(1), (mask.sum(1) > 0) & (adv != 0)


class GradRecorder:
    """Every parameter's accumulated gradient at each call the schedule makes to the probe, read
    from ``main_grad`` by name (not from the probe's buffer ranges): the EP=1 reference. Hands
    each call on to ``probe``."""

    def __init__(self, model, probe):
        self.model, self.probe, self.snaps = model, probe, []

    def _snap(self):
        self.snaps.append({n: p.main_grad.detach().double().clone() for n, p in self.model.core.named_parameters()})

    def microbatch_boundary(self, ddp, last=False):
        self._snap()
        self.probe.microbatch_boundary(ddp, last)

    def before_reduce(self, ddp):
        self._snap()
        self.probe.before_reduce(ddp)

    def after_reduce(self, ddp):
        self.probe.after_reduce(ddp)


def estimate(parts, rows, dense_sq, experts):
    """(|G|², tr Σ, dof) the coordinator takes from these parts (its own code path)."""
    stats = grad_stats("actor", parts, rows, UNITS, SIGNAL, dense_sq**0.5, "tokens", "microbatch", experts)
    (u,) = grad_updates([stats], {"actor": 1.0}, {})
    return torch.tensor([u.g2, u.tr_sigma, u.dof], dtype=torch.float64)


def reference_parts(recorder, dims):
    """At EP=1 (DP=2): each rank's micro-batch gradients gathered; the dense parts per rank and
    micro-batch, the experts' parts as the SUM of the two ranks' micro-batch k gradients (the
    union EP=2 sends to the experts), and both classes' global |G|², all by brute force."""
    names = list(recorder.snaps[0])
    flat = [torch.cat([snap[n].flatten() for n in names]) for snap in recorder.snaps]
    mine = torch.stack([flat[0]] + [b - a for a, b in zip(flat, flat[1:])])  # (micro-batches, params)
    both = [torch.zeros_like(mine) for _ in range(dims.dp)]
    torch.distributed.all_gather(both, mine, group=dims.dp_group)
    is_expert = torch.cat([torch.full((recorder.snaps[0][n].numel(),), "local_experts" in n) for n in names])
    dense = [float(g[~is_expert].square().sum()) for rank in both for g in rank]
    union = sum(both)  # (micro-batches, params): micro-batch k of both ranks
    experts = [float(g[is_expert].square().sum()) for g in union]
    total = union.sum(0)
    own = [float(g[is_expert].square().sum()) for rank in both for g in rank]
    return dense, experts, own, float(total[~is_expert].square().sum()), float(total[is_expert].square().sum())


def expert_tp_spread(model):
    """The largest difference between this rank's expert weights and those of the first rank of
    its expert-data-parallel group, which holds the same shard of the same experts (at expert TP
    1 and EP 1 the TP group; at TP 4 expert TP 2 the TP ranks 2 apart). 0: the replicas of each
    expert shard, fed different tokens, took the same step."""
    from megatron.core import parallel_state as ps

    group, spread = ps.get_expert_data_parallel_group(), torch.zeros(())
    for name, p in model.core.named_parameters():
        if ".mlp.experts." in name:
            first = p.detach().clone()
            torch.distributed.broadcast(first, group=group, group_src=0)
            spread = torch.maximum(spread, (p.detach() - first).abs().max())
    torch.distributed.all_reduce(spread, op=torch.distributed.ReduceOp.MAX)
    return spread


def forward_only(hf_dir, tp, ep, dims, etp=0):
    """Another HF model at this layout: (its megarl config, full logits, weights read back)."""
    cfg, tensors = read_hf_folder(hf_dir)
    mcfg = model_config_from_hf(cfg, ModelConfig())
    pcfg = ParallelConfig(tensor_parallel=tp, expert_parallel=ep, expert_tensor_parallel=etp)
    model = build_gpt(mcfg, pcfg, dims, trainable=False)
    load_hf_tensors(model, LlamaQwen2Adapter(mcfg), tensors)
    return mcfg, full_logits(model), hf_state_dict(model, LlamaQwen2Adapter(mcfg))


def routing_replay(layout, dims, ep, pp):
    """The routing replay checks (worker_moe_replay.py) on a fresh model of this layout."""
    pcfg = ParallelConfig(micro_batch_size=MBS, expert_parallel=ep, pipeline_parallel=pp)
    model = build_gpt(base, pcfg, dims, optim=OPTIM)
    load_hf_tensors(model, adapter, hf)
    attach_routes(model)
    return {f"{layout}/r3/{k}": v for k, v in replay_checks(model, tokens, mask, MBS).items()}


LAYOUTS = {  # (TP, EP, PP, expert TP: 0 = TP, 1 = experts whole on each TP rank)
    "ep1": (1, 1, 1, 0),
    "ep2": (1, 2, 1, 0),
    "tp2": (2, 1, 1, 0),
    "tp2etp1": (2, 1, 1, 1),
    "tp2ep2": (2, 2, 1, 0),
    "tp2ep2etp1": (2, 2, 1, 1),
    "tp4etp2": (4, 1, 1, 2),  # each expert split over 2 of the 4 TP ranks
    "pp2": (1, 1, 2, 0),
}
result: dict[str, torch.Tensor] = {}
for layout in args.layouts.split(","):
    tp, ep, pp, etp = LAYOUTS[layout]
    dims = init_distributed(tp, pp, seed=7, ep=ep, etp=etp)
    if pp > 1:  # routing replay only
        result.update(routing_replay(layout, dims, ep, pp))
        continue
    local = base.num_experts // ep
    if args.hf_softmax_all and tp == 1:
        m2, result[f"{layout}/softmax_all_logits"], _ = forward_only(args.hf_softmax_all, tp, ep, dims)
        assert not m2.moe_norm_topk_prob
    if args.hf_mixtral:
        m3, result[f"mixtral/{layout}/logits"], loaded = forward_only(args.hf_mixtral, tp, ep, dims, etp)
        assert m3.arch == "mixtral"
        result.update({f"mixtral/{layout}/loaded/{k}": v for k, v in loaded.items()})
    for variant, (dist_opt, router_losses, weight) in VARIANTS.items():
        if tp > 1 and variant != "plain":
            continue
        mcfg = dataclasses.replace(base, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z) if router_losses else base
        pcfg = ParallelConfig(
            tensor_parallel=tp,
            micro_batch_size=MBS,
            expert_parallel=ep,
            expert_tensor_parallel=etp,
            use_distributed_optimizer=dist_opt,
            sequence_parallel=tp > 1,
        )
        model = build_gpt(mcfg, pcfg, dims, optim=OPTIM, track_experts=variant == "plain")
        load_hf_tensors(model, adapter, hf)
        key = f"{layout}/{variant}"
        if variant == "plain":
            result[f"{layout}/logits"] = full_logits(model)
            result.update({f"{layout}/loaded/{k}": v for k, v in hf_state_dict(model, adapter).items()})
        old = forward_logprobs(model, tokens, micro_batch_size=MBS, temperature=1.0)["logprobs"]
        result[f"{key}/logprobs"] = old
        if variant == "plain" and ep == 1:  # 15 columns: sequence parallelism at TP 2 pads them to 16
            odd = forward_logprobs(model, tokens[:, :15], micro_batch_size=MBS, temperature=1.0)
            result[f"{key}/logprobs_odd"] = odd["logprobs"]
        rows = slice(dims.dp_rank * B // dims.dp, (dims.dp_rank + 1) * B // dims.dp)
        batch = {"tokens": tokens[rows], "mask": mask[rows], "adv": adv[rows], "old": old[rows]}
        router = model.core.decoder.layers[-1].mlp.router
        router_before = router.weight.detach().clone()
        seen: list[torch.Tensor] = []
        hook = router.register_forward_hook(lambda mod, inp, out, seen=seen: seen.append(inp[0].detach().clone()))
        # (the EP=1 reference once; not at TP 2: sequence parallelism and the probe are refused together)
        measured = tp == 1 and (variant == "plain" or (variant == "distopt" and ep > 1))
        probe = GradProbe(dims, microbatch=True) if measured else None
        if probe is not None:
            probe.start()
            model.probe = GradRecorder(model, probe) if ep == 1 and variant == "plain" else probe
        stats, gnorm = train_step(model, batch, loss_fn(weight), micro_batch_size=MBS)
        hook.remove()
        if variant == "plain":  # tokens each expert received in the step (summed over DP ranks)
            result[f"{key}/expert_counts"] = model.expert_load.read()
        if isinstance(model.probe, GradRecorder):  # the reference, and the EP=1 probe (one class)
            dense, experts, own, g_dense, g_experts = reference_parts(model.probe, dims)
            result[f"{key}/probe/ref_dense_parts"] = torch.tensor(dense, dtype=torch.float64)
            result[f"{key}/probe/ref_expert_parts"] = torch.tensor(experts, dtype=torch.float64)
            result[f"{key}/probe/ref_own_expert_parts"] = torch.tensor(own, dtype=torch.float64)
            result[f"{key}/probe/ref_global"] = torch.tensor([g_dense, g_experts], dtype=torch.float64)
            union = [list(k) for k in zip(*(chunks(sl, MBS) for sl in EVERY))]
            rows = [r for sl in EVERY for r in chunks(sl, MBS)]
            ref = ExpertParts(sq=experts, rows=union, global_sq=g_experts)
            result[f"{key}/probe/ref_estimate"] = estimate(dense, rows, g_dense, ref)
            result[f"{key}/probe/parts"] = torch.tensor(probe.gather_microbatches(), dtype=torch.float64)
        elif probe is not None:  # EP=2: the probe's two classes
            parts, rows, expert_parts = read_parts(probe, EVERY, MBS)
            assert expert_parts is not None and probe.global_sq is not None
            result[f"{key}/probe/parts"] = torch.tensor(parts, dtype=torch.float64)
            result[f"{key}/probe/expert_parts"] = torch.tensor(expert_parts.sq, dtype=torch.float64)
            result[f"{key}/probe/expert_rows"] = torch.tensor([[r.start for r in u] for u in expert_parts.rows])
            result[f"{key}/probe/global"] = torch.tensor([probe.global_sq, expert_parts.global_sq], dtype=torch.float64)
            result[f"{key}/probe/estimate"] = estimate(parts, rows, probe.global_sq, expert_parts)
        model.probe = None
        result[f"{key}/loss"] = torch.tensor([stats["loss"]], dtype=torch.float64)
        result[f"{key}/grad_norm"] = torch.tensor([gnorm], dtype=torch.float64)
        if not dist_opt and tp == 1:  # (the distributed optimizer leaves only its shard of each gradient)
            for name, p in model.core.named_parameters():  # this rank's gradients after the DP reduction
                result[f"{key}/grad/{to_global(name, dims.ep_rank, local)}"] = p.main_grad.detach().clone()
        if variant == "plain":  # full gradients, HF-named: TP 2 / EP 2 (sharded) against TP 1
            result.update({f"{key}/hfgrad/{k}": v for k, v in hf_grads(model).items()})
        if variant == "aux_only":
            ref = reference_router_grad(seen, router_before, base.moe_router_topk, B * S)
            torch.distributed.all_reduce(ref, group=dims.dp_group)  # the DP reduction of this replicated weight
            result[f"{key}/router_grad"] = router.weight.main_grad.detach().clone()
            result[f"{key}/router_grad_ref"] = ref
        result.update({f"{key}/w/{k}": v for k, v in hf_state_dict(model, adapter).items()})
        if etp and etp != tp and ep == 1 and variant == "plain":  # each expert shard on several TP ranks: still equal
            result[f"{key}/expert_tp_spread"] = expert_tp_spread(model)  # (after the step)
        print(f"rank {dims.rank} {key}: loss {stats['loss']:.9f} grad_norm {gnorm:.9f}", flush=True)
    if tp == 1:
        result.update(forced_routing_steps(layout, dims, ep))
        result.update(routing_replay(layout, dims, ep, 1))
save_file({k: v.contiguous() for k, v in result.items()}, str(Path(args.out) / f"rank{dims.rank}.safetensors"))
# leave together: a rank that exits while a peer still holds live gloo groups can abort in their
# destructors ("terminate called without an active exception", -6; seen in a full suite run)
torch.distributed.barrier()
shutdown()
