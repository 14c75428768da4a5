"""The virtual clock vs a real GPU (#45 item 6): decode, log-prob and training time of the
``gpu-mid`` model at three batch sizes, beside what ``benchmarks/ttt/clocks.toml`` charges.

The clock (``megarl.coordinator.clock``) was fixed before any run that uses it; this script does
not change it. It measures, on a lent CUDA device, the three things the clock's ``gpu-mid`` model
prices, for a model of Qwen2.5-1.5B's shape (random bf16 weights: timing does not depend on their
values; no download):

1. **decode step** — one token for ``n`` running sequences with ``context`` ids of KV cache each:
   every layer's GEMMs over the batch, attention over the cache (``scaled_dot_product_attention``),
   the LM head. Plain eager torch: no paged KV, no CUDA graphs — vLLM's step is at least as fast,
   so a measured step *slower* than the clock's says the clock is optimistic only if vLLM's
   launch overhead (``decode_step_overhead_s``, an assumption) is not what makes the difference.
   Compared with the clock's roofline ``max(memory, compute) + overhead`` for the same (n, context).
2. **log-probs** — megarl's ``forward_logprobs`` (megatron-core GPTModel) over B sequences of
   prompt + mean-response ids. A line ``t = fixed + tokens / rate`` fitted over the three B gives
   the implied MFU and fixed time beside the clock's ``forward_mfu`` and ``logprob_fixed_s``.
3. **training** — one megarl ``train_step`` (GRPO policy loss, megatron DDP + Adam, bf16 with
   fp32 main params) on the same batch: the implied ``train_mfu`` and ``train_fixed_s``.

Prints one ``MEASURED <phase> ...`` line per measurement, a summary table, and writes
``$OUT/gpu_clock_check.json`` (or ``--report``); exit 0 when it ran, 1 on an error, 3 without
CUDA (unless ``--cpu-dry-run``: a tiny model and tiny batches on CPU in fp32, so the path is
tested here — ``tests/tools/test_gpu_clock_check.py``; its numbers mean nothing).

On the lent device (docs/GPU.md): ``tools/gpu_check_prepare.sh`` here, then the device tool with
``carry=[".whl"]`` and the command ``bash tools/gpu_check.sh --script gpu_clock_check.py``
(~3 min on an H100: building the 1.5 B model and its optimizer dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLOCKS = ROOT / "benchmarks" / "ttt" / "clocks.toml"
EXIT_FAIL, EXIT_NO_CUDA = 1, 3


@dataclass(frozen=True)
class Shape:
    """The model timed (megarl ``model`` fields) and the batches it is timed at."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    prompt: int
    response: int
    """Ids per sequence: the clock's prompt_tokens and (rounded) mean response."""
    batches: tuple[int, int, int]
    micro_batch: int
    decode_contexts: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


GPU_MID = Shape(28, 1536, 12, 2, 8960, 151936, prompt=150, response=280, batches=(128, 512, 1024),
                micro_batch=4, decode_contexts=(150, 430))  # fmt: skip
"""Qwen2.5-1.5B (config.json: 28 layers, hidden 1536, 12 heads, 2 KV heads, intermediate 8960,
vocab 151936, tied embeddings) — the clocks file's [QWEN15]; 280 ≈ its clipped log-normal's mean
response (median 250, σ 0.5); decode at the first and the last context of a mean response."""
DRY = Shape(2, 64, 4, 2, 128, 96, prompt=6, response=10, batches=(4, 8, 16), micro_batch=4, decode_contexts=(6, 16))


def parameters(s: Shape) -> int:
    """Parameters of a Qwen2-style model of shape ``s`` (tied embeddings, QKV biases)."""
    kv = s.num_query_groups * s.head_dim
    attn = s.hidden_size * (s.hidden_size + 2 * kv) + (s.hidden_size + 2 * kv) + s.hidden_size * s.hidden_size
    mlp = 3 * s.hidden_size * s.ffn_hidden_size
    return s.num_layers * (attn + mlp + 2 * s.hidden_size) + s.vocab_size * s.hidden_size + s.hidden_size


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def clock_decode_step_s(clock: Any, n: int, context: int) -> float:
    """The clock's price of one decode step with ``n`` sequences of ``context`` cached ids each
    (``Clock.engine_s``'s per-step term, without the queue)."""
    p, hw = clock.p, clock.hw
    bw = hw["hbm_bytes_per_s"] * p["gpus_per_engine"] * p["decode_bw_eff"]
    flops = hw["peak_flops"] * p["gpus_per_engine"] * p["forward_mfu"]
    memory = (clock.weight_bytes + n * context * clock.kv_bytes_per_token) / bw
    compute = 2 * p["params"] * n / flops
    return max(memory, compute) + p["decode_step_overhead_s"]


# -- measurements ------------------------------------------------------------------------
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: Any, fn: Any, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (one untimed call first)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def decode_step_s(s: Shape, n: int, context: int, device: Any, dtype: Any, repeats: int) -> float:
    """Seconds of one eager decode step (module docstring, 1.) for ``n`` sequences."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)
    h, d, heads, kvh = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_query_groups

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02

    layers = [
        {
            "qkv": w(h + 2 * kvh * d, h),
            "bias": w(h + 2 * kvh * d),
            "o": w(h, h),
            "gate_up": w(2 * s.ffn_hidden_size, h),
            "down": w(h, s.ffn_hidden_size),
            "k": w(n, kvh, context, d),
            "v": w(n, kvh, context, d),
        }  # fmt: skip
        for _ in range(s.num_layers)
    ]
    emb = w(s.vocab_size, h)
    x0 = w(n, h)

    def step() -> torch.Tensor:
        x = x0
        for L in layers:
            y = F.rms_norm(x, (h,))
            qkv = F.linear(y, L["qkv"], L["bias"])
            q = qkv[:, :h].view(n, heads, 1, d)
            attn = F.scaled_dot_product_attention(q, L["k"], L["v"], enable_gqa=True)
            x = x + F.linear(attn.reshape(n, h), L["o"])
            gate, up = F.linear(F.rms_norm(x, (h,)), L["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return F.linear(F.rms_norm(x, (h,)), emb).argmax(-1)

    with torch.no_grad():
        return _timed(device, step, repeats)


def build_actor(s: Shape, dtype: str) -> tuple[Any, Any, Any]:
    """(config, process groups, model): megarl's actor of shape ``s`` (megatron GPTModel, DDP,
    Adam) on this process's device."""
    from megarl.config import RunConfig
    from megarl.distributed import init_distributed
    from megarl.model.builder import build_gpt

    cfg = RunConfig()
    m = cfg.model
    m.arch, m.num_layers, m.hidden_size, m.ffn_hidden_size = "qwen2", s.num_layers, s.hidden_size, s.ffn_hidden_size
    m.num_attention_heads, m.num_query_groups, m.vocab_size = s.num_attention_heads, s.num_query_groups, s.vocab_size
    m.max_position_embeddings, m.tie_embeddings, m.dtype = 4096, True, dtype  # (qwen2: QKV biases)
    cfg.parallel.micro_batch_size = s.micro_batch
    cfg.optim.clip_grad = 1.0
    dims = init_distributed(1, 1, seed=5)
    return cfg, dims, build_gpt(cfg.model, cfg.parallel, dims, optim=cfg.optim, seed=5)


def phase_times(s: Shape, cfg: Any, dims: Any, model: Any, batch: int, repeats: int) -> tuple[float, float]:
    """(log-prob forward s, train step s) of ``batch`` sequences of prompt + response ids."""
    import torch

    from megarl.model.forward import forward_logprobs
    from megarl.model.train import train_step
    from megarl.types import UpdateRows
    from megarl.update.losses import policy_loss_fn

    dev = dims.device
    g = torch.Generator().manual_seed(batch)
    seq = s.prompt + s.response
    tokens = torch.randint(0, s.vocab_size, (batch, seq), generator=g).to(dev)
    mask = torch.zeros(batch, seq, device=dev)
    mask[:, s.prompt - 1 : seq - 1] = 1.0  # mask[:, t] marks tokens[t + 1]: the response's ids

    def logprobs() -> torch.Tensor:
        return forward_logprobs(model, tokens, micro_batch_size=s.micro_batch, temperature=1.0)["logprobs"]

    t_lp = _timed(dev, logprobs, repeats)
    old = logprobs()
    adv = torch.randn(batch, generator=g).to(dev)
    rows = UpdateRows(tokens=tokens, mask=mask, adv=adv, old_logprobs=old, engine_logprobs=old)
    loss_fn = policy_loss_fn(cfg.algo, 1.0, dims.tp_group, float(mask.sum()))
    t_tr = _timed(dev, lambda: train_step(model, rows, loss_fn, micro_batch_size=s.micro_batch), max(1, repeats - 1))
    return t_lp, t_tr


# -- the run -----------------------------------------------------------------------------
def run(dry: bool, repeats: int) -> dict[str, Any]:
    import torch

    from megarl.coordinator.clock import Clock

    s = DRY if dry else GPU_MID
    clock = Clock.load(CLOCKS, "gpu-mid")
    params = parameters(s)
    if dry:  # price the tiny model with the same hardware, so every formula runs
        clock = replace(clock, p={**clock.p, "params": float(params), "layers": float(s.num_layers),
                                  "kv_heads": float(s.num_query_groups), "head_dim": float(s.head_dim)})  # fmt: skip
    out: dict[str, Any] = {"clock_sha256": clock.sha256, "params": params, "clock_params": clock.p["params"],
                           "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "decode": [],
                           "batches": []}  # fmt: skip
    device = torch.device("cpu" if dry else "cuda")
    wdtype = torch.float32 if dry else torch.bfloat16
    for context in s.decode_contexts:
        for n in s.batches:
            t = decode_step_s(s, n, context, device, wdtype, repeats + 2)
            c = clock_decode_step_s(clock, n, context)
            out["decode"].append({"n": n, "context": context, "measured_s": t, "clock_s": c})
            print(f"MEASURED decode n={n} context={context}: {t * 1e3:.2f} ms a step; clock {c * 1e3:.2f} ms "
                  f"(measured / clock {t / c:.2f})", flush=True)  # fmt: skip
        if not dry:
            torch.cuda.empty_cache()
    cfg, dims, model = build_actor(s, "fp32" if dry else "bf16")
    out["model_params"] = sum(p.numel() for p in model.core.parameters())
    if out["model_params"] != params:
        raise ValueError(f"the megatron model has {out['model_params']} parameters, the shape's count is {params}")
    for b in s.batches:
        t_lp, t_tr = phase_times(s, cfg, dims, model, b, repeats)
        tokens = b * (s.prompt + s.response)
        out["batches"].append({"batch": b, "tokens": tokens, "logprob_s": t_lp, "train_s": t_tr})
        print(f"MEASURED batch={b} ({tokens} ids): log-prob forward {t_lp:.3f} s, train step {t_tr:.3f} s", flush=True)
    out["fit"] = implied(clock, out["batches"])
    return out


def implied(clock: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
    """The clock parameters the measurements imply (lines over the batches) beside the clock's."""
    peak, p = clock.hw["peak_flops"] * clock.p["train_gpus"], clock.p
    xs = [float(r["tokens"]) for r in rows]
    lp_fixed, lp_per = fit_line(xs, [r["logprob_s"] for r in rows])
    tr_fixed, tr_per = fit_line(xs, [r["train_s"] for r in rows])
    return {
        "forward_mfu": 2 * p["params"] / (lp_per * peak) if lp_per > 0 else float("nan"),
        "clock_forward_mfu": p["forward_mfu"],
        "logprob_fixed_s": lp_fixed,
        "clock_logprob_fixed_s_per_forward": p["logprob_fixed_s"] / max(p["logprob_forwards"], 1.0),
        "train_mfu": 6 * p["params"] * p["epochs"] / (tr_per * peak) if tr_per > 0 else float("nan"),
        "clock_train_mfu": p["train_mfu"],
        "train_fixed_s": tr_fixed,
        "clock_train_fixed_s": p["train_fixed_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="a tiny model on CPU (tests the path; no meaning)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median)")
    ap.add_argument("--report", default="", help="JSON report path (default $OUT/gpu_clock_check.json)")
    a = ap.parse_args(argv)
    import torch

    if not a.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_clock_check: no CUDA device (use --cpu-dry-run to test the path on CPU)")
        return EXIT_NO_CUDA
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    t0 = time.perf_counter()
    try:
        out = run(a.cpu_dry_run, a.repeats)
    except Exception as e:  # one line a human can act on, then the traceback
        print(f"FAIL gpu_clock_check: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        return EXIT_FAIL
    out["wall_s"] = time.perf_counter() - t0
    f = out["fit"]
    print(f"implied forward MFU {f['forward_mfu']:.3f} (clock {f['clock_forward_mfu']}), fixed "
          f"{f['logprob_fixed_s']:.3f} s a forward (clock {f['clock_logprob_fixed_s_per_forward']}); "
          f"train MFU {f['train_mfu']:.3f} (clock {f['clock_train_mfu']}), fixed {f['train_fixed_s']:.3f} s "
          f"(clock {f['clock_train_fixed_s']}); {out['wall_s']:.0f} s in all")  # fmt: skip
    report = Path(a.report or Path(os.environ.get("OUT", ".")) / "gpu_clock_check.json")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(out, indent=1))
    print(json.dumps({"decode_ratio": [round(r["measured_s"] / r["clock_s"], 3) for r in out["decode"]],
                      **{k: round(v, 4) for k, v in f.items()}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
