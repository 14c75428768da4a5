"""Fleet generation throughput versus rollout batch (concurrent sequences), side by side.

A random Llama-style model (default 4 layers × 256 wide, vocab 2048 — real work for the CPU
engine) is served by megarl's own engine server and fleet client; for each batch size the
same request is timed (fixed-length responses via ignore_eos, plus a long-tail variant where
one sequence in the batch is 4× longer). Prints a table and a JSON line of tokens/s ratios
to the smallest batch. The seed study saw up to 2.29× on GPUs.

    python benchmarks/generation_throughput.py [--batches 1,4,16,64,256] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402


def make_model(path: Path, layers: int, hidden: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.engine.staging import MANIFEST

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in model.state_dict().items()}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from megarl.fleet.fleet import Fleet

    tmp = Path(tempfile.mkdtemp(prefix="megarl_genbench_"))
    model = make_model(tmp / "hf", args.layers, args.hidden, args.vocab)
    fleet = Fleet.start_local(model, 1, 1, 1.0, tmp / "logs", seed=0)
    rows = []
    try:
        assert fleet.staging_dir is not None  # engines read weight files only from the run's staging folder
        staged = [shutil.copy(f, fleet.staging_dir / f.name) for f in sorted(model.glob("*.safetensors"))]
        fleet.update_weights(1, [str(f) for f in staged])
        prompt = list(range(3, 35))
        fleet.generate([prompt], n=1, max_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True)
        for b in [int(x) for x in args.batches.split(",")]:
            for variant in ("uniform", "long_tail"):
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    if variant == "uniform":
                        fleet.generate([prompt] * b, n=1, max_tokens=args.tokens, temperature=1.0, top_p=1.0,
                                       stop_token_ids=[], ignore_eos=True, seeds=list(range(b)))
                        toks = b * args.tokens
                    else:  # one straggler 4× longer than the rest: the step waits for it
                        fleet.generate([prompt] * b, n=1, max_tokens=args.tokens, temperature=1.0, top_p=1.0,
                                       stop_token_ids=[], ignore_eos=True, seeds=list(range(b)))
                        fleet.generate([prompt], n=1, max_tokens=3 * args.tokens, temperature=1.0, top_p=1.0,
                                       stop_token_ids=[], ignore_eos=True)
                        toks = b * args.tokens + 3 * args.tokens
                    best = min(best, time.perf_counter() - t0)
                rows.append({"batch": b, "variant": variant, "seconds": best, "tokens_per_s": toks / best})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        fleet.shutdown()
    for variant in ("uniform", "long_tail"):
        base = next(r for r in rows if r["variant"] == variant)["tokens_per_s"]
        for r in rows:
            if r["variant"] == variant:
                r["ratio_vs_smallest"] = r["tokens_per_s"] / base
    print(table(rows, ["batch", "variant", "seconds", "tokens_per_s", "ratio_vs_smallest"]))
    ratios = {f"{r['variant']}/b{r['batch']}": round(r["ratio_vs_smallest"], 3) for r in rows}
    print(json.dumps({"benchmark": "generation_throughput", "model": f"{args.layers}Lx{args.hidden}",
                      "tokens": args.tokens, "ratios_vs_smallest": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
