"""One training micro-batch, megarl's Megatron model vs the same weights in transformers.

Where does the trainer side of a step go? This isolates the model: the same HF folder is
loaded into megarl's Megatron GPTModel (TP=1, local spec, the CPU compat mode) and into
transformers' LlamaForCausalLM; both run forward-only and forward+backward on the same
(rows × seq) token batch with the same number of threads, timed side by side (median of
--repeats). Prints a table and a JSON line of ratios (transformers time / megarl time).

    torchrun --standalone --nproc-per-node=1 benchmarks/train_kernels.py --hf HF_DIR \
        [--rows 32] [--seq 268] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")
from benchmarks.common import table  # noqa: E402


def _time(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, type=Path)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=268)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "unfused"], help="megarl's core attention")
    ap.add_argument("--ops", action="store_true", help="also print the top torch ops of each pass")
    ap.add_argument(
        "--glibc-defaults", action="store_true", help="leave glibc's malloc as it is (the trainer keeps freed memory)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
    from megarl.checkpoint.hf_io import load_hf_tensors, read_hf_folder
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt
    from megarl.model.forward import forward_logprobs, labels_of, vocab_parallel_logprobs
    from megarl.model.train import train_step

    if not args.glibc_defaults and not torch.cuda.is_available():
        from megarl.compat.cpu import keep_freed_memory

        keep_freed_memory()  # what a trainer rank does (parallel.cpu_keep_freed_memory); both models see it
    dims = init_distributed(1, 1, seed=0)
    hf_cfg, hf = read_hf_folder(args.hf)
    mcfg = model_config_from_hf(hf_cfg, ModelConfig(attention=args.attention))
    model = build_gpt(mcfg, ParallelConfig(micro_batch_size=args.rows), dims, optim=OptimConfig(lr=0.0))
    load_hf_tensors(model, LlamaQwen2Adapter(mcfg), hf)
    ref = AutoModelForCausalLM.from_pretrained(str(args.hf), dtype=torch.float32)
    n_params = sum(p.numel() for p in ref.parameters())

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, mcfg.vocab_size, (args.rows, args.seq), generator=g)
    mask = torch.ones(args.rows, args.seq)
    mask[:, -1] = 0

    def m_fwd() -> None:
        forward_logprobs(model, tokens, micro_batch_size=args.rows, temperature=1.0)

    def loss_fn(mb: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp = vocab_parallel_logprobs(logits, labels_of(mb["tokens"]), 1.0)
        return -(lp * mb["mask"]).sum() / mb["mask"].sum(), {}

    def m_train() -> None:
        train_step(model, {"tokens": tokens, "mask": mask}, loss_fn, micro_batch_size=args.rows, lr=0.0)

    def hf_logprobs() -> torch.Tensor:
        logits = ref(input_ids=tokens).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, labels_of(tokens)[..., None])[..., 0]

    def h_fwd() -> None:
        with torch.no_grad():
            hf_logprobs()

    opt = torch.optim.AdamW(ref.parameters(), lr=0.0)

    def h_train() -> None:
        opt.zero_grad()
        loss = -(hf_logprobs() * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()

    ntok = args.rows * args.seq
    rows = []
    for name, m_fn, h_fn, flops_per_tok in (
        ("forward", m_fwd, h_fwd, 2 * n_params),
        ("forward+backward+adam", m_train, h_train, 6 * n_params),
    ):
        tm, th = _time(m_fn, args.repeats), _time(h_fn, args.repeats)
        rows.append(
            {
                "pass": name,
                "megarl_s": tm,
                "transformers_s": th,
                "megarl_GFLOP/s": flops_per_tok * ntok / tm / 1e9,
                "transformers_GFLOP/s": flops_per_tok * ntok / th / 1e9,
                "transformers/megarl": th / tm,
            }
        )
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (
            ("megarl forward", m_fwd),
            ("transformers forward", h_fwd),
            ("megarl forward+backward+adam", m_train),
            ("transformers forward+backward+adam", h_train),
        ):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"--- top ops, {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    if dims.is_rank0:
        print(f"{n_params / 1e6:.1f}M params, {args.rows}×{args.seq} tokens, {args.threads} threads")
        print(table(rows, list(rows[0])))
        print(
            json.dumps(
                {"benchmark": "train_kernels", "ratios": {r["pass"]: round(r["transformers/megarl"], 3) for r in rows}}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
