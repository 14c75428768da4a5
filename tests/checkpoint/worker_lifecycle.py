"""torchrun worker (1 rank) for the checkpoint life cycle: crash mid-save, keep-last-K and
the errors of a bad load. Results go to <out>/<phase>.json (+ safetensors).

--phase crash:  save step 1, take a step, then save step 2 with the fault injection that
                exits every rank after all files are written but before COMPLETE.
--phase verify: the crashed save is invisible, step 1 loads; then keep-last, then errors.
"""

import argparse
import json
import os
import shutil
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megarl.checkpoint import dist_ckpt  # noqa: E402
from megarl.checkpoint.dist_ckpt import (  # noqa: E402
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megarl.checkpoint.hf_io import hf_state_dict  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import set_lr  # noqa: E402
from tests.checkpoint.common import build, sft_step  # noqa: E402


def error_of(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["crash", "verify"], required=True)
    args = ap.parse_args()
    root, out = Path(args.root), Path(args.out)
    from safetensors.torch import save_file

    dims = init_distributed(1, 1, seed=3)
    model, adapter = build(args.hf, dims)
    if args.phase == "crash":
        sft_step(model, 0)
        save_checkpoint(root, {"actor": model}, {"step": 1}, keep_last=2)
        save_file({k: v.clone() for k, v in hf_state_dict(model, adapter).items()}, str(out / "step1.safetensors"))
        sft_step(model, 1)
        os.environ[dist_ckpt.FAULT_ENV] = "before_commit"
        save_checkpoint(root, {"actor": model}, {"step": 2}, keep_last=2)
        raise AssertionError("the fault injection did not stop the save")

    info: dict = {
        "latest_before": str(latest_checkpoint(root)),
        "listing_before": sorted(p.name for p in root.iterdir()),
    }
    info["extra"] = load_checkpoint(root, {"actor": model})
    save_file(hf_state_dict(model, adapter), str(out / "loaded.safetensors"))
    info["partial_error"] = error_of(lambda: load_checkpoint(root / "step_00000002.tmp", {"actor": model}))

    # keep-last-K: 4 more saves with K=2; the crashed tmp dir goes with the first of them
    info["listings"] = []
    for step in range(2, 6):
        sft_step(model, step)
        save_checkpoint(root, {"actor": model}, {"step": step}, keep_last=2)
        info["listings"].append(sorted(p.name for p in root.iterdir()))
    info["latest_after"] = (root / "latest").read_text()
    info["extra_latest"] = load_checkpoint(root, {"actor": model})
    info["extra_by_dir"] = load_checkpoint(root / "step_00000004", {"actor": model})

    # errors
    other, _ = build(args.hf, dims, hidden_size=64)
    info["shape_error"] = error_of(lambda: load_checkpoint(root, {"actor": other}))
    info["name_error"] = error_of(lambda: load_checkpoint(root, {"critic": model}))
    info["missing_error"] = error_of(lambda: load_checkpoint(root / "nope", {"actor": model}))
    broken = root.parent / "broken"
    shutil.copytree(root / "step_00000005", broken / "step_00000005")
    (broken / "step_00000005" / "COMPLETE").unlink()
    info["marker_error"] = error_of(lambda: load_checkpoint(broken / "step_00000005", {"actor": model}))
    info["empty_root_error"] = error_of(lambda: load_checkpoint(broken, {"actor": model}))
    frozen, _ = build(args.hf, dims, trainable=False)  # weights only (like a converted checkpoint)
    save_checkpoint(root.parent / "weights_only", {"actor": frozen}, {"step": 0}, keep_last=1)
    info["no_optimizer_error"] = error_of(lambda: load_checkpoint(root.parent / "weights_only", {"actor": model}))
    info["weights_only_extra"] = load_checkpoint(root.parent / "weights_only", {"actor": model}, load_optimizer=False)

    # a checkpoint taken before the first optimizer step (empty Adam state) resumes too
    for dist_opt in (False, True):
        first, _ = build(args.hf, dims, dist_opt=dist_opt)
        with torch.no_grad():  # differ from the HF init the second model starts from
            for p in first.core.parameters():
                p.add_(0.01)
        set_lr(first, 3e-3)
        save_checkpoint(root.parent / f"fresh_{dist_opt}", {"actor": first}, {"step": 0}, keep_last=1)
        again, _ = build(args.hf, dims, dist_opt=dist_opt)
        load_checkpoint(root.parent / f"fresh_{dist_opt}", {"actor": again})
        losses = [[sft_step(m, s)[0] for s in range(2)] for m in (first, again)]
        a, b = hf_state_dict(first, adapter), hf_state_dict(again, adapter)
        info[f"fresh_{dist_opt}"] = {"losses": losses, "maxdiff": max((a[k] - b[k]).abs().max().item() for k in a)}
    (out / "verify.json").write_text(json.dumps(info, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
