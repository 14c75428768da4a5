"""torchrun worker (one gloo rank): the grad probe's noise split by prompt on a tiny megatron
model against brute force. 16 responses in GRPO groups of 4, micro-batches of 2: each probe part
is one group (2 micro-batches), its halves one micro-batch each. The probe reads one update;
brute force then takes each response's own gradient (one backward per row, the same global
token-mean denominator, LR 0 so every gradient is at the same weights) and sums them by group
and half. Saves both (rank 0)."""

import argparse
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from megarl import algo  # noqa: E402
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs  # noqa: E402
from megarl.model.grad_stats import GradProbe  # noqa: E402
from megarl.model.train import train_step  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()

B, S, GROUP, MBS = 16, 20, 4, 2
dims = init_distributed(1, 1, seed=7)
hf_cfg, hf = read_hf_folder(args.hf)
mcfg = model_config_from_hf(hf_cfg, ModelConfig())
model = build_gpt(mcfg, ParallelConfig(micro_batch_size=MBS), dims, optim=OptimConfig(lr=1e-3, clip_grad=1e9))
load_hf_tensors(model, LlamaQwen2Adapter(mcfg), hf)

g = torch.Generator().manual_seed(5)
tokens = torch.randint(3, mcfg.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses: a group's halves hold different token counts
    mask[b, 5 : 5 + 3 + (b * 7) % 11] = 1.0
adv = algo.grpo_advantages(torch.rand(B, generator=g), torch.arange(B) // GROUP)
old = forward_logprobs(model, tokens, micro_batch_size=MBS, temperature=1.0)["logprobs"]
denom = algo.global_denominator("token-mean", mask)


def loss_fn(mb, logits):
    cur = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
    per_tok, _ = algo.policy_loss(cur, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
    loss = algo.aggregate(per_tok, mb["mask"], mode="token-mean", global_denominator=denom)
    return loss, {"loss": loss.detach()}


def rows(sl):
    return {"tokens": tokens[sl], "mask": mask[sl], "adv": adv[sl], "old": old[sl]}


model.probe = GradProbe(dims, microbatch=True, microbatches_per_part=GROUP // MBS, split=True)
model.probe.start()
_, gnorm = train_step(model, rows(slice(0, B)), loss_fn, micro_batch_size=MBS, lr=0.0)
result = {
    "probe/part_sq": torch.tensor(model.probe.mb_sq, dtype=torch.float64),
    "probe/split_sq": torch.tensor(model.probe.split_sq, dtype=torch.float64),
    "probe/global_sq": torch.tensor([gnorm**2], dtype=torch.float64),
    "units": mask.sum(1),
}
model.probe.active = False
per_sample = []  # (B, params) float64: each response's own gradient (over D, the batch's denominator)
for i in range(B):
    train_step(model, rows(slice(i, i + 1)), loss_fn, micro_batch_size=1, lr=0.0)
    per_sample.append(torch.cat([p.main_grad.detach().double().flatten() for p in model.core.parameters()]))
grads = torch.stack(per_sample).view(B // GROUP, 2, GROUP // 2, -1).sum(2)  # (groups, halves, params)
result["brute/part_sq"] = (grads.sum(1) ** 2).sum(-1)
result["brute/split_sq"] = ((grads[:, 0] - grads[:, 1]) ** 2).sum(-1)
result["brute/global_sq"] = (grads.sum((0, 1)) ** 2).sum().reshape(1)
if dims.is_rank0:
    from safetensors.torch import save_file

    save_file(result, str(Path(args.out) / "result.safetensors"))
shutdown()
