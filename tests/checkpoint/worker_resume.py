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
import multiprocessing
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megarl.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint  # noqa: E402
from megarl.checkpoint.hf_io import hf_state_dict  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import set_lr  # noqa: E402
from tests.checkpoint.common import build, sft_step  # noqa: E402


def save_results(out: Path, tag: str, weights: dict, info: dict, rank0: bool) -> None:
    if rank0:
        from safetensors.torch import save_file

        save_file(weights, str(out / f"{tag}.safetensors"))
        (out / f"{tag}.json").write_text(json.dumps(info, indent=1))


def adam_steps(model) -> list[float]:
    """Distinct Adam step counts in this rank's optimizer state."""
    opt = getattr(model.optimizer, "chained_optimizers", [model.optimizer])[0]
    return sorted({float(s["step"]) for s in opt.optimizer.state.values()})


def numels(model) -> dict:
    """Elements of this rank's model shard and of the optimizer's (main) params."""
    opt = getattr(model.optimizer, "chained_optimizers", [model.optimizer])[0]
    return {
        "model": sum(p.numel() for p in model.core.parameters()),
        "optimizer": sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"]),
    }


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
    info: dict = {"losses": [], "grad_norms": [], "numel_rank0": numels(model)}
    saved: dict = {}
    if args.phase == "train":
        set_lr(model, 2e-3)  # not the config's lr: the checkpoint must carry it
        for step in range(k):
            sft_step(model, step)
        saved = {f"ckpt:{n}": t.clone() for n, t in hf_state_dict(model, adapter).items()}
        t0 = time.perf_counter()
        save_checkpoint(args.root, {"actor": model}, {"step": k, "note": "resume-test"}, keep_last=2)
        info["save_s"] = time.perf_counter() - t0
        info["children_after_save"] = len(multiprocessing.active_children())  # no writer/Manager processes
        info["rng_after_save"] = torch.rand(4).tolist()
        torch.manual_seed(999)  # the reference must not depend on RNG continuity...
    else:
        t0 = time.perf_counter()
        extra = load_checkpoint(args.root, {"actor": model})
        info["load_s"] = time.perf_counter() - t0
        info["extra"] = extra
        info["rng_after_load"] = torch.rand(4).tolist()  # ...but a resumed run must restore it
        info["lr_after_load"] = model.optimizer.param_groups[0]["lr"]
        torch.manual_seed(999)
    for step in range(k, 2 * k):
        loss, gn = sft_step(model, step)
        info["losses"].append(loss)
        info["grad_norms"].append(gn)
        if step == k:
            info["adam_steps_after_first"] = adam_steps(model)
            w1 = {n: t.clone() for n, t in hf_state_dict(model, adapter).items()}  # not live views
    final = hf_state_dict(model, adapter)
    save_results(out, args.phase, {**final, **saved, **{f"first:{n}": t for n, t in w1.items()}}, info, dims.is_rank0)

    if args.phase == "resume" and args.reshard_tp:
        dims = init_distributed(args.reshard_tp, args.reshard_pp, seed=11)
        model, adapter = build(args.hf, dims, dist_opt=args.dist_opt)
        t0 = time.perf_counter()
        info = {"extra": load_checkpoint(args.root, {"actor": model}), "load_s": time.perf_counter() - t0}
        loaded = {n: t.clone() for n, t in hf_state_dict(model, adapter).items()}
        loss, gn = sft_step(model, k)
        info.update(losses=[loss], grad_norms=[gn], adam_steps_after_first=adam_steps(model), numel_rank0=numels(model))
        after = hf_state_dict(model, adapter)
        save_results(out, "reshard", {**after, **{f"loaded:{n}": t for n, t in loaded.items()}}, info, dims.is_rank0)
    shutdown()


if __name__ == "__main__":
    main()
