"""torchrun worker: load an HF model into a TP/PP/DP layout, compute log-probs, take one
optimizer step with a fixed GRPO loss, and save log-probs + updated HF weights (rank 0)."""

import argparse
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from megarl import algo  # noqa: E402
from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf  # noqa: E402
from megarl.checkpoint.hf_io import hf_state_dict, load_hf_tensors, read_hf_folder  # noqa: E402
from megarl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from megarl.distributed import init_distributed  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import _labels, forward_logprobs, train_step, vocab_parallel_logprobs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--hf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--pp", type=int, default=1)
ap.add_argument("--mbs", type=int, default=4)
ap.add_argument("--agg", default="token-mean")
ap.add_argument("--dist-opt", action="store_true")
args = ap.parse_args()

dims = init_distributed(args.tp, args.pp, seed=7)
hf_cfg, hf = read_hf_folder(args.hf)
mcfg = model_config_from_hf(hf_cfg, ModelConfig())
pcfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, micro_batch_size=args.mbs,
                      use_distributed_optimizer=args.dist_opt)
# adam_eps well above fp32 gradient noise: with eps=1e-8 the first Adam step is ~lr·sign(g),
# which turns 1e-9 reduction-order differences in tiny gradients into lr-sized ones.
model = build_gpt(mcfg, pcfg, dims, optim=OptimConfig(lr=1e-3, clip_grad=0.0, adam_eps=1e-4))
adapter = LlamaQwen2Adapter(mcfg)
load_hf_tensors(model, adapter, hf)

g = torch.Generator().manual_seed(123)
B, S = 16, 20
tokens = torch.randint(3, mcfg.vocab_size, (B, S), generator=g)
mask = torch.zeros(B, S)
for b in range(B):  # ragged responses after a 6-token prompt
    mask[b, 5 : 5 + 4 + (b % 9)] = 1.0
rewards = torch.rand(B, generator=g)
group_ids = torch.arange(B) // 4
adv = algo.grpo_advantages(rewards, group_ids)

lp = forward_logprobs(model, tokens, micro_batch_size=args.mbs, temperature=1.0, with_entropy=True)
denom = algo.global_denominator(args.agg, mask, fixed_normalizer=16.0)
per = B // dims.dp
rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
old = lp["logprobs"].clone()


def loss_fn(mb, logits):
    cur = vocab_parallel_logprobs(logits, _labels(mb["tokens"]), 0.7)
    per_tok, _ = algo.policy_loss(cur, mb["old"], algo.sequence_to_token(mb["adv"], mb["mask"]), mb["mask"])
    loss = algo.aggregate(per_tok, mb["mask"], mode=args.agg, global_denominator=denom)
    return loss, {"loss": loss.detach()}


stats, gnorm = train_step(model, {"tokens": tokens[rows], "mask": mask[rows], "adv": adv[rows], "old": old[rows]},
                          loss_fn, micro_batch_size=args.mbs)
sd = hf_state_dict(model, adapter)
if dims.is_rank0:
    from safetensors.torch import save_file

    out = Path(args.out)
    save_file({"logprobs": lp["logprobs"], "entropy": lp["entropy"], "tokens": tokens,
               "loss": torch.tensor([stats["loss"]]), "grad_norm": torch.tensor([gnorm])},
              str(out / "result.safetensors"))
    save_file(sd, str(out / "updated.safetensors"))
