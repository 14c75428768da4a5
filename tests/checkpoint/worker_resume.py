"""torchrun worker for exact resume and resharding.

--phase train:  K steps, save checkpoint (step K), K more steps → reference losses/weights.
--phase resume: load the step-K checkpoint in this fresh process, run the last K steps →
                same losses/weights; then (--reshard-tp/--reshard-pp) re-initialise the
                process groups at another layout, load the same checkpoint, compare its
                weights and take one more step (step K).
Results go to <out>/<phase>*.safetensors (rank 0) and <out>/<phase>.json.
"""

import argparse
import json
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megarl.checkpoint.dist_ckpt import last_load_times, last_save_times, load_checkpoint, save_checkpoint  # noqa: E402
from megarl.checkpoint.hf_io import hf_state_dict  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import set_lr  # noqa: E402
from tests.checkpoint.common import build, sft_step  # noqa: E402


def save_results(out: Path, tag: str, weights: dict, info: dict, rank0: bool) -> None:
    if rank0:
        from safetensors.torch import save_file

        save_file(weights, str(out / f"{tag}.safetensors"))
        (out / f"{tag}.json").write_text(json.dumps(info, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["train", "resume"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dist-opt", action="store_true")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reshard-tp", type=int, default=0)
    ap.add_argument("--reshard-pp", type=int, default=1)
    args = ap.parse_args()
    out, k = Path(args.out), args.k

    dims = init_distributed(args.tp, args.pp, seed=11)
    model, adapter = build(args.hf, dims, dist_opt=args.dist_opt)
    info: dict = {"losses": [], "grad_norms": []}
    if args.phase == "train":
        set_lr(model, 2e-3)  # not the config's lr: the checkpoint must carry it
        for step in range(k):
            sft_step(model, step)
        t = time.perf_counter()
        save_checkpoint(args.root, {"actor": model}, {"step": k, "note": "resume-test"}, keep_last=2)
        info["save_s"] = time.perf_counter() - t
        info["save_times"] = dict(last_save_times)
        info["rng_after_save"] = torch.rand(4).tolist()
        torch.manual_seed(999)  # the reference must not depend on RNG continuity...
    else:
        t = time.perf_counter()
        extra = load_checkpoint(args.root, {"actor": model})
        info["load_s"] = time.perf_counter() - t
        info["load_times"] = dict(last_load_times)
        info["extra"] = extra
        info["rng_after_load"] = torch.rand(4).tolist()  # ...but a resumed run must restore it
        info["lr_after_load"] = model.optimizer.param_groups[0]["lr"]
        torch.manual_seed(999)
    for step in range(k, 2 * k):
        loss, gn = sft_step(model, step)
        info["losses"].append(loss)
        info["grad_norms"].append(gn)
        if step == k:
            w1 = {n: t.clone() for n, t in hf_state_dict(model, adapter).items()}  # not live views
    final = hf_state_dict(model, adapter)
    save_results(out, args.phase, {**final, **{f"first:{n}": t for n, t in w1.items()}}, info, dims.is_rank0)

    if args.phase == "resume" and args.reshard_tp:
        shutdown()
        dims = init_distributed(args.reshard_tp, args.reshard_pp, seed=11)
        model, adapter = build(args.hf, dims, dist_opt=args.dist_opt)
        info = {}
        extra = load_checkpoint(args.root, {"actor": model})
        info["extra"] = extra
        loaded = {n: t.clone() for n, t in hf_state_dict(model, adapter).items()}
        loss, gn = sft_step(model, k)
        info["losses"], info["grad_norms"] = [loss], [gn]
        after = hf_state_dict(model, adapter)
        save_results(out, "reshard", {**after, **{f"loaded:{n}": t for n, t in loaded.items()}}, info, dims.is_rank0)
    shutdown()


if __name__ == "__main__":
    main()
