"""Weight sync (Megatron shards → HF names → vLLM engine) for ~10M, ~100M, ~400M models.

For each size, in one run, side by side:
  bucketed  megarl's shm path: gather + map + pack into `--bucket-mb` safetensors buckets in
            /dev/shm, then begin → load (validated, staged) → commit (one reload_weights)
  http      the same buckets as safetensors bytes in request bodies (engines on other hosts)
  naive     one file and one load request per tensor, then commit (the per-tensor RPC path)
  memcpy    the machine's single-thread copy bandwidth on a 256 MB buffer (numpy)
Prints a table and a JSON line of ratios: effective GB/s over memcpy GB/s, naive/bucketed,
http/bucketed. (The sizes are named by their order of magnitude: "10M" has 8.1M parameters.)

    python benchmarks/weight_sync.py [--sizes 10M,100M,400M] [--bucket-mb 256] [--transports shm,http]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import table  # noqa: E402

SIZES = {  # layers, hidden, ffn, heads, kv groups, vocab
    "10M": (4, 256, 1024, 4, 2, 8192),
    "100M": (12, 768, 2048, 12, 4, 16384),
    "400M": (24, 1024, 4096, 16, 8, 32000),
}


def memcpy_gbps() -> float:
    import numpy as np

    a = np.ones(256 * 2**20 // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10M,100M,400M")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--transports", default="shm,http", help="shm first (the reference), then others")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from safetensors.torch import save_file

    from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.distributed import init_distributed
    from megarl.engine.staging import MANIFEST
    from megarl.fleet.fleet import Fleet
    from megarl.model.builder import build_gpt
    from megarl.weight_sync.sync import WeightSync

    dims = init_distributed(1, 1, seed=0)
    rows = []
    bw = memcpy_gbps()
    for name in args.sizes.split(","):
        layers, hidden, ffn, heads, groups, vocab = SIZES[name]
        mcfg = ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                           num_query_groups=groups, vocab_size=vocab, max_position_embeddings=256)
        model = build_gpt(mcfg, ParallelConfig(), dims, trainable=False)
        n_params = sum(p.numel() for p in model.core.parameters())
        adapter = LlamaQwen2Adapter(mcfg)
        tmp = Path(tempfile.mkdtemp(prefix=f"megarl_syncbench_{name}_"))
        hf_dir = tmp / "hf"
        hf_dir.mkdir()
        adapter.hf_config(2, 1, 0).save_pretrained(str(hf_dir))
        from megarl.checkpoint.hf_io import gather_hf_tensors

        named = gather_hf_tensors(model, adapter)
        (hf_dir / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in named}))
        nbytes = sum(v.numel() * v.element_size() for _, v in named)
        fleet = Fleet.start_local(hf_dir, 1, 1, 0.5, tmp / "logs", seed=0, start_timeout_s=600)
        try:
            timed: dict[str, tuple[float, dict[str, float]]] = {}
            version = 0
            for transport in args.transports.split(","):
                # shm writes into the fleet's private staging folder (the only one engines read)
                sync = WeightSync(model, adapter, fleet, args.bucket_mb, transport=transport)
                t = []
                for _ in range(3):  # the first is a warm-up (first reload allocates)
                    version += 1
                    t0 = time.perf_counter()
                    stats = sync.push(version)
                    t.append((time.perf_counter() - t0, stats))
                timed[transport] = min(t[1:], key=lambda x: x[0])
                sync.cleanup()
            best, stats = timed["shm"]
            # naive: one file + one load request per tensor
            assert fleet.staging_dir is not None
            ndir = fleet.staging_dir / f"bench_{name}_naive"
            ndir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            files = []
            for i, (k, v) in enumerate(gather_hf_tensors(model, adapter)):
                f = ndir / f"t{i}.safetensors"
                save_file({k: v}, str(f))
                files.append(str(f))
            for e in fleet.engines:
                e.post("/weights/begin", {"version": 9}, 600)
                for f in files:
                    e.post("/weights/load", {"version": 9, "files": [f]}, 600)
                e.post("/weights/commit", {"version": 9}, 600)
            naive = time.perf_counter() - t0
            shutil.rmtree(ndir, ignore_errors=True)
        finally:
            fleet.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
        rows.append({"model": name, "params_M": n_params / 1e6, "GB": nbytes / 1e9, "bucketed_s": best,
                     "gather_s": stats["gather_s"], "write_s": stats["write_s"],
                     "engine_update_s": stats.get("fleet_update_s"), "eff_GBps": nbytes / best / 1e9,
                     "memcpy_GBps": bw, "eff/memcpy": nbytes / best / 1e9 / bw, "naive_s": naive,
                     "naive/bucketed": naive / best, "tensors": len(named)}
                    | {f"{k}_s": v[0] for k, v in timed.items() if k != "shm"}
                    | {f"{k}/bucketed": v[0] / best for k, v in timed.items() if k != "shm"})
        print(json.dumps(rows[-1]), flush=True)
        del model
    print(table(rows, ["model", "params_M", "GB", "tensors", "bucketed_s", "gather_s", "write_s", "engine_update_s",
                       "eff_GBps", "memcpy_GBps", "eff/memcpy", "naive_s", "naive/bucketed"]
                + [c for t in args.transports.split(",")[1:] for c in (f"{t}_s", f"{t}/bucketed")]))
    print(json.dumps({"benchmark": "weight_sync", "bucket_mb": args.bucket_mb,
                      "eff_over_memcpy": {r["model"]: round(r["eff/memcpy"], 4) for r in rows},
                      "naive_over_bucketed": {r["model"]: round(r["naive/bucketed"], 3) for r in rows}}
                     | {f"{t}_over_bucketed": {r["model"]: round(r[f"{t}/bucketed"], 3) for r in rows}
                        for t in args.transports.split(",")[1:]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
