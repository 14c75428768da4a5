"""torchrun worker: a few real GRPO steps (Megatron TP/PP + vLLM), then check that the engine
serves exactly the trainer's weights: sampled-token log-probs and greedy outputs."""

import argparse
import json
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")

from megarl.components import add_reference_and_critic, build  # noqa: E402
from megarl.config import load_config  # noqa: E402
from megarl.loop import rl_step  # noqa: E402
from megarl.model.forward import forward_logprobs, greedy_generate  # noqa: E402
from megarl.warm_start import WarmStartSettings, warm_start  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--set", action="append", default=[])
args = ap.parse_args()

cfg = load_config(None, args.set)
cfg.rollout.engine_logprobs_every = 1  # the batch checked below carries the engine's log-probs
tr = build(cfg)
result: dict = {}
try:
    warm_start(WarmStartSettings.of(cfg), tr.dims, tr.actor, tr.tok, tr.rollouts.train_rows)
    add_reference_and_critic(tr)
    tr.publisher.push()
    steps = [rl_step(tr, s) for s in range(cfg.train.steps)]
    result["versions"] = [m.get("rollout/policy_version", -1.0) for m in steps]
    result["integrity"] = [m["sync/integrity_max_abs_diff"] for m in steps]
    prompts = [tr.tok.encode(r.prompt) for r in tr.rollouts.val_rows[:8]]
    # 1) engine samples + logprobs vs trainer logprobs of the same tokens
    batch, _ = tr.rollouts.collect(999, 8, 4)
    lp = forward_logprobs(tr.actor, batch.tokens, micro_batch_size=cfg.parallel.micro_batch_size,
                          temperature=cfg.rollout.temperature)["logprobs"]
    m = batch.mask.bool()
    result["sampled_logprob_max_abs_diff"] = float((lp[m] - batch.engine_logprobs[m]).abs().max())
    result["sampled_tokens"] = int(m.sum())
    result["batch_version"] = batch.version
    result["trainer_version"] = tr.publisher.version
    # 2) greedy: engine vs Megatron reference decoding
    ours = greedy_generate(tr.actor, prompts, cfg.rollout.max_response_len, tr.tok.eos_id)
    if tr.dims.is_rank0:
        outs, _ = tr.fleet.generate(prompts, n=1, max_tokens=cfg.rollout.max_response_len, temperature=0.0,
                                    top_p=1.0, stop_token_ids=[tr.tok.eos_id])
        result["engine_greedy"] = [o[0]["token_ids"] for o in outs]
        result["engine_versions"] = tr.fleet.versions()
        result["trainer_greedy"] = ours
finally:
    tr.close()
if dist.get_rank() == 0:
    with open(args.out, "w") as fh:
        json.dump(result, fh)

# leave together and tear the groups down explicitly (a rank exiting while its peer still holds
# live gloo groups can abort in their destructors: "terminate called without an active exception")
dist.barrier()
from megarl.distributed import shutdown  # noqa: E402

shutdown()
