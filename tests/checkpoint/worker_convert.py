"""torchrun worker (TP=2 × PP=2) for the conversion tools, both families in one launch.

For each <base>/<arch>/hf: ``hf-to-megarl`` at TP2 PP2 → <arch>/ckpt; a TP2 PP2 model loads
that checkpoint and computes log-probs of fixed tokens (rank 0 saves them); then
``megarl-to-hf`` at TP2 PP2 → <arch>/hf_rt.
"""

import argparse
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megarl.checkpoint.dist_ckpt import checkpoint_model_config, load_checkpoint  # noqa: E402
from megarl.config import ParallelConfig  # noqa: E402
from megarl.convert import main as convert  # noqa: E402
from megarl.distributed import init_distributed, shutdown  # noqa: E402
from megarl.model.builder import build_gpt  # noqa: E402
from megarl.model.forward import forward_logprobs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    args = ap.parse_args()
    dims = init_distributed(2, 2, seed=0)  # the tool reuses this process group
    for arch in args.archs:
        d = Path(args.base) / arch
        assert convert(["hf-to-megarl", "--hf", str(d / "hf"), "--out", str(d / "ckpt"), "--tp", "2", "--pp", "2"]) == 0
        mcfg = checkpoint_model_config(d / "ckpt")
        model = build_gpt(mcfg, ParallelConfig(tensor_parallel=2, pipeline_parallel=2), dims, trainable=False)
        load_checkpoint(d / "ckpt", {"actor": model}, load_optimizer=False)
        tokens = torch.randint(0, mcfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(5))
        lp = forward_logprobs(model, tokens, micro_batch_size=2, temperature=1.0)["logprobs"]
        if dims.is_rank0:
            from safetensors.torch import save_file

            save_file({"tokens": tokens, "logprobs": lp}, str(d / "megatron_logprobs.safetensors"))
        assert (
            convert(["megarl-to-hf", "--ckpt", str(d / "ckpt"), "--out", str(d / "hf_rt"), "--tp", "2", "--pp", "2"])
            == 0
        )
    shutdown()


if __name__ == "__main__":
    main()
