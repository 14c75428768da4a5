"""GPU proof: every GPU path megarl can run on a lent device, as one command (< 8 min).

On a CUDA machine (``tools/gpu_check.sh`` installs the carried wheels and calls this):

1. ``pytest -m gpu`` over ``tests/gpu`` (the tests that need vLLM or Transformer Engine skip
   with their reason when those are absent).
2. actor parity: the same tiny actor, weights and batch, one forward/backward/optimizer step
   on CUDA in bf16 (fp32 main params) vs a CPU fp32 reference computed by this script in a
   child process with CUDA hidden; log-probs, loss, grad norm and updated main params must
   agree within the bf16 tolerances stated in ``TOL``.
3. NCCL groups: megarl.distributed with TP=1 on CUDA must pick NCCL; an all-reduce on the
   data-parallel group must sum. Then CPU-tensor collectives on those groups, as megarl's
   rollout broadcast, trainer and checkpoint code run them (NCCL alone refuses CPU tensors;
   megarl.distributed therefore starts the default group as ``cpu:gloo,cuda:nccl``), plus, in
   a child process, the same mixed backend with megatron's own groups.
4. GRPO loop: 5 updates on a synthetic rollout through megarl's advantage / loss / train-step
   / gradient-probe code; finite numbers, loss and objective moving the right way, probe
   |g|² equal to the optimizer's grad norm² (DP = 1), step time and peak memory printed.
5. CUDA IPC wire: an actor weight bucket flattened and shared by ``wire.share_cuda``, opened
   by a second process with ``wire.open_cuda``, checksums equal.
6. Transformer Engine spec / vLLM paths: run when importable, otherwise
   "NOT RUNNABLE on this device: <why>".

Each check prints one line ``PASS|FAIL|NOT RUNNABLE <name>: <numbers>``; a JSON report goes
to ``$OUT/gpu_check.json`` (or ``--report``). Exit codes: 0 no check failed; 1 a check failed;
2 a required Python module is missing (the message names what to carry); 3 no CUDA device
(without ``--cpu-dry-run``).

``--cpu-dry-run`` runs the same checks with device = CPU and fp32 on both sides (tolerances
``TOL_FP32``), so every code path except the CUDA-only ones is exercised on a CPU machine
(``tests/tools/test_gpu_check.py``); ``--dry-run-dtype bf16`` adds megatron's bf16 training
path (bf16 params, fp32 main params) on CPU against the fp32 reference with the bf16 ``TOL``.

On the lent device (see docs/GPU.md): here ``tools/gpu_check_prepare.sh``, then the device
tool with ``carry=[".whl"]`` and the command ``bash tools/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXIT_FAIL, EXIT_MISSING, EXIT_NO_CUDA = 1, 2, 3
REQUIRED = {
    "torch": "nothing: a CUDA build of torch must already be installed there",
    "numpy": "numpy",
    "packaging": "packaging",
    "yaml": "PyYAML",
    "setuptools": "setuptools",
    "megatron.core": "megatron-core==0.16.1",
}
"""Modules the checks import → the distribution to carry when one is missing (megatron imports
numpy, packaging and torch.utils.cpp_extension, which imports setuptools; megarl.config yaml).
Found by running the dry run in a venv holding only torch's own dependencies plus these."""
PYTEST_NEEDS = "pytest pluggy iniconfig pygments safetensors"
"""What the pytest check imports beyond REQUIRED (tests/gpu/test_transports_gpu.py: safetensors)."""
TOL = {
    "logprob_max": 0.05,
    "logprob_mean": 0.01,
    "loss_abs": 0.01,
    "grad_norm_rel": 0.02,
    "main_param_max": 2e-3,
    "update_cos": 0.99,
}
"""bf16 (GPU) vs fp32 (CPU). bf16 keeps 8 mantissa bits (relative step 2^-8 ≈ 0.0039) and every
layer's activations are rounded to it, so log-probs may differ by a few 1e-3 per token (the
same check with megatron's bf16 path on CPU measured max 1.9e-3, mean 5.4e-4 on 2026-11-30;
GPU kernels round differently, hence the margin); one Adam step with lr = 1e-3 moves each
fp32 main param by ≤ ~lr, so where a tiny gradient's sign flips two runs may differ by up to
2·lr, while the update directions must stay aligned (cosine; CPU bf16 measured 0.9999)."""
TOL_FP32 = {
    "logprob_max": 1e-5,
    "logprob_mean": 1e-6,
    "loss_abs": 1e-6,
    "grad_norm_rel": 1e-5,
    "main_param_max": 1e-6,
    "update_cos": 0.99999,
}
"""fp32 vs fp32 on CPU (--cpu-dry-run): the same arithmetic, so only reduction order may differ."""


class Report:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], tuple[str, str, dict[str, Any]]]) -> None:
        """``fn`` returns (status, one-line summary, numbers); an exception is a FAIL."""
        t0 = time.perf_counter()
        try:
            status, summary, numbers = fn()
        except Exception as e:  # a check that crashes is a failed check, reported with its error
            import traceback

            traceback.print_exc()
            status, summary, numbers = "FAIL", f"{type(e).__name__}: {e}", {}
        seconds = time.perf_counter() - t0
        print(f"{status} {name}: {summary} [{seconds:.1f} s]", flush=True)
        self.results.append({"check": name, "status": status, "summary": summary, "seconds": seconds, **numbers})

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.results if r["status"] == "FAIL"]


def missing_modules() -> list[str]:
    return [f"{mod} (carry {dist})" for mod, dist in REQUIRED.items() if importlib.util.find_spec(mod) is None]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _judge(checks: dict[str, bool]) -> str:
    return "PASS" if all(checks.values()) else "FAIL"


# ---------------------------------------------------------------------------------------- checks


def check_pytest_gpu() -> tuple[str, str, dict[str, Any]]:
    probe = subprocess.run([sys.executable, "-c", "import pytest, safetensors"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit {probe.returncode}"
        return "NOT RUNNABLE", f"not runnable on this device: {why} (carry wheels of {PYTEST_NEEDS})", {}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", "tests/gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    for line in lines[-30:]:
        print(f"    | {line}")
    summary = lines[-1] if lines else ""
    if proc.returncode not in (0, 5):
        summary += f" (exit {proc.returncode}) {proc.stderr.strip()[-400:]}"
    # 0 = all selected passed or skipped; 5 = nothing collected
    return (
        ("PASS" if proc.returncode in (0, 5) else "FAIL"),
        f"pytest -m gpu tests/gpu → {summary}",
        {"returncode": proc.returncode},
    )


def cpu_reference(path: Path) -> None:
    """Child process (CUDA hidden): build the actor, take the reference step, save everything."""
    import torch

    from tools import gpu_check_actor as ga

    actor = ga.build_actor(ga.init_dims(), "fp32")
    init = ga.weights_of(actor)
    torch.save({"init": init, **ga.reference_step(actor)}, path)


def check_actor_parity(dtype: str, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    import torch

    from tools import gpu_check_actor as ga

    ref_path = workdir / "cpu_reference.pt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(free_port()), "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--cpu-reference", str(ref_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return "FAIL", f"CPU reference process exited {proc.returncode}: {proc.stderr.strip()[-600:]}", {}
    ref = torch.load(ref_path)
    tol = TOL if dtype == "bf16" else TOL_FP32
    actor = ga.build_actor(_dims(), dtype, weights=ref["init"])
    got = ga.reference_step(actor)
    mask = ref["mask"].bool()
    lp_diff = torch.cat([(got[k] - ref[k]).abs()[mask] for k in ("logprobs", "logprobs_after")])
    update_dot = update_ref = update_got = 0.0
    param_max = 0.0
    for name, w0 in ref["init"].items():
        d_ref, d_got = ref["main_params"][name] - w0, got["main_params"][name] - w0
        update_dot += float((d_ref.double() * d_got.double()).sum())
        update_ref += float((d_ref.double() ** 2).sum())
        update_got += float((d_got.double() ** 2).sum())
        param_max = max(param_max, float((got["main_params"][name] - ref["main_params"][name]).abs().max()))
    n = {
        "dtype": f"{dtype} on {actor.dims.device} vs fp32 on cpu",
        "logprob_max": float(lp_diff.max()),
        "logprob_mean": float(lp_diff.mean()),
        "loss": got["loss"],
        "loss_ref": ref["loss"],
        "loss_abs": abs(got["loss"] - ref["loss"]),
        "grad_norm": got["grad_norm"],
        "grad_norm_ref": ref["grad_norm"],
        "grad_norm_rel": abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30),
        "main_param_max": param_max,
        "update_cos": update_dot / max((update_ref * update_got) ** 0.5, 1e-30),
        "tolerance": tol,
    }
    ok = {k: (n[k] >= v if k == "update_cos" else n[k] <= v) for k, v in tol.items()}
    ok["moved"] = update_ref > 0 and update_got > 0
    text = (
        f"{n['dtype']}: logprob |Δ| (before and after the step) max {n['logprob_max']:.2e} (≤{tol['logprob_max']:g}) mean "
        f"{n['logprob_mean']:.2e} (≤{tol['logprob_mean']:g}); loss {n['loss']:.6f} vs {n['loss_ref']:.6f} "
        f"(|Δ|≤{tol['loss_abs']:g}); grad norm {n['grad_norm']:.5f} vs {n['grad_norm_ref']:.5f}; "
        f"main params after 1 step |Δ| max {n['main_param_max']:.2e} (≤{tol['main_param_max']:g}), "
        f"update cosine {n['update_cos']:.6f} (≥{tol['update_cos']:g})"
    )
    _ACTOR["actor"] = actor
    return _judge(ok), text, n


def check_process_groups(device_run: bool) -> tuple[str, str, dict[str, Any]]:
    import torch
    import torch.distributed as dist

    dims = _dims()
    backend = dist.get_backend(dims.dp_group)
    want = "nccl" if device_run else "gloo"
    x = torch.full((4,), 3.0, device=dims.device)
    dist.all_reduce(x, group=dims.dp_group)
    dist.all_reduce(x, group=dims.tp_group)
    ok = {"backend": want in str(backend), "sum": bool((x == 3.0).all()), "tp": dims.tp == 1 and dims.world_size == 1}
    text = (
        f"init_distributed(tp=1, pp=1) on {dims.device}: backend {backend} (want {want}), world "
        f"{dims.world_size}, TP {dims.tp} DP {dims.dp}; all-reduce over DP and TP groups = {x[0].item():g} (want 3)"
    )
    return _judge(ok), text, {"backend": backend, "device": str(dims.device)}


CPU_COLLECTIVE_SITES = (
    "rollout/batch.py (rollout batch broadcast), trainer.py (sample counts, timings, validation), "
    "checkpoint/state.py (preemption flag), weight_sync/sync.py (integrity probe)"
)
"""megarl code that runs collectives on CPU tensors over the default / DP group."""


def mixed_backend_probe() -> None:
    """Child process: a default group with a backend per device, megatron's groups on it, and
    CPU + CUDA collectives over each (the candidate fix for CPU-tensor collectives on CUDA)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(0)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    for name, group in (
        ("world", None),
        ("dp", ps.get_data_parallel_group()),
        ("tp", ps.get_tensor_model_parallel_group()),
    ):
        for dev in ("cpu", "cuda"):
            t = torch.full((2,), 2.0, device=dev)
            dist.all_reduce(t, group=group)
            dist.broadcast(t, src=0, group=group)
            if float(t[0]) != 2.0:
                raise RuntimeError(f"{name} group, {dev} tensor: all-reduce gave {float(t[0])}, want 2")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    print("mixed-backend: ok")


def check_cpu_collectives(device_run: bool) -> tuple[str, str, dict[str, Any]]:
    """megarl broadcasts / all-reduces CPU tensors (CPU_COLLECTIVE_SITES) over groups that are
    NCCL on CUDA; run the same on megarl's groups. With CUDA, a child process also tries the
    candidate fix (default backend ``cpu:gloo,cuda:nccl``) and its result is printed."""
    import torch
    import torch.distributed as dist

    dims = _dims()
    errors = {}
    for name, group in (("default", None), ("dp", dims.dp_group)):
        t = torch.full((3,), 2.0)
        try:
            dist.broadcast(t, src=0, group=group)
            dist.all_reduce(t, group=group)
            if float(t[0]) != 2.0:
                errors[name] = f"all-reduce gave {float(t[0])}, want 2"
        except Exception as e:  # the failure is the finding: report it with its message
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    text = (
        f"CPU tensors over megarl's default and DP groups ({dist.get_backend()}): "
        f"{'ok' if not errors else errors}; used by {CPU_COLLECTIVE_SITES}"
    )
    n: dict[str, Any] = {"errors": errors}
    if device_run:
        env = {
            **os.environ,
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "PYTHONPATH": _pythonpath(),
        }
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--mixed-backend-probe"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        ok = proc.returncode == 0 and "mixed-backend: ok" in proc.stdout
        n["mixed_backend_fix_works"] = ok
        text += (
            "; candidate fix init_process_group(backend='cpu:gloo,cuda:nccl') + megatron groups: CPU and "
            f"CUDA collectives {'work' if ok else 'FAIL: ' + proc.stderr.strip()[-300:]}"
        )
    return ("PASS" if not errors else "FAIL"), text, n


def check_grpo_loop(dtype: str, steps: int) -> tuple[str, str, dict[str, Any]]:
    import math

    import torch

    from tools import gpu_check_actor as ga

    dims = _dims()
    if dims.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dims.device)
    actor = ga.build_actor(dims, dtype)
    r = ga.grpo_loop(actor, steps)
    peak = torch.cuda.max_memory_allocated(dims.device) / 2**20 if dims.device.type == "cuda" else float("nan")
    finite = all(math.isfinite(v) for k in ("loss", "grad_norm", "probe_local_sq") for v in r[k])
    # DP = 1: the probe's local |g|² before the (trivial) reduce is the optimizer's grad norm²
    probe_rel = max(abs(s - g * g) / max(g * g, 1e-30) for s, g in zip(r["probe_local_sq"], r["grad_norm"]))
    step_s = sorted(r["seconds"])[len(r["seconds"]) // 2]
    ok = {
        "finite": finite,
        "loss_falls": r["loss"][-1] < r["loss"][0],
        "objective_rises": r["objective_after"] > r["objective_before"],
        "probe_matches_grad_norm": probe_rel <= (1e-3 if dtype == "bf16" else 1e-5),
        "probe_microbatches": all(k == ga.BATCH // ga.MBS for k in r["probe_mb"]),
    }
    n = {**r, "probe_rel": probe_rel, "median_step_s": step_s, "peak_mem_mib": peak, "checks": ok}
    losses = ", ".join(f"{v:.5f}" for v in r["loss"])
    text = (
        f"{steps} updates ({dtype} on {dims.device}): loss [{losses}]; "
        f"J=ΣA·logπ {r['objective_before']:.4f} → {r['objective_after']:.4f}; probe |g|² vs grad_norm² rel "
        f"{probe_rel:.1e}, {r['probe_mb'][0]} micro-batch norms/step; median step {step_s * 1e3:.1f} ms; "
        f"peak CUDA memory {peak:.1f} MiB; failed: {[k for k, v in ok.items() if not v] or 'none'}"
    )
    return _judge(ok), text, n


def check_cuda_ipc(device_run: bool) -> tuple[str, str, dict[str, Any]]:
    if not device_run:
        return "NOT RUNNABLE", "not runnable on this device: CUDA IPC needs a CUDA device (dry run)", {}
    import torch

    from megarl.engine import wire

    actor = _ACTOR.get("actor")
    if actor is None:
        return "FAIL", "no actor from the parity check to share", {}
    named = [(n, p.detach()) for n, p in actor.model.core.named_parameters()]
    buf, records = wire.flatten(named)
    handle = wire.share_cuda(buf)
    want = {n: float(t.double().sum()) for n, t in named}
    code = (
        "import json,sys;from megarl.engine import wire;m=json.load(sys.stdin);"
        "b=wire.open_cuda(m['handle']);"
        "print(json.dumps({n:float(t.double().sum()) for n,t in wire.unflatten(b,m['records'])}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        input=json.dumps({"handle": handle, "records": records}),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    torch.cuda.synchronize()
    if proc.returncode != 0:
        return "FAIL", f"receiver exited {proc.returncode}: {proc.stderr.strip()[-600:]}", {}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = [n for n in want if n not in got or abs(got[n] - want[n]) > 1e-6 * max(1.0, abs(want[n]))]
    text = (
        f"{len(records)} tensors, {buf.numel()} bytes shared as one buffer; receiver's per-tensor sums "
        f"{'all equal' if not bad else 'differ for ' + ', '.join(bad[:5])}"
    )
    return ("PASS" if not bad else "FAIL"), text, {"bytes": buf.numel(), "mismatched": bad}


def check_transformer_engine(device_run: bool) -> tuple[str, str, dict[str, Any]]:
    if not device_run:
        return "NOT RUNNABLE", "not runnable on this device: Transformer Engine needs CUDA (dry run)", {}
    if importlib.util.find_spec("transformer_engine") is None:
        return (
            "NOT RUNNABLE",
            "not runnable on this device: transformer_engine is not installed (its wheels "
            "exceed the 64 MiB a device call may carry)",
            {},
        )
    import torch

    from megarl.model.builder import build_gpt
    from megarl.model.forward import forward_logprobs
    from tools import gpu_check_actor as ga

    cfg = ga.run_config("bf16")
    cfg.model.transformer_impl = "transformer_engine"
    model = build_gpt(cfg.model, cfg.parallel, _dims(), optim=cfg.optim)
    tokens = ga.synthetic_rollout(3)["tokens"].to(model.dims.device)
    lp = forward_logprobs(model, tokens, micro_batch_size=ga.MBS, temperature=1.0)["logprobs"][:, :-1]
    ok = bool(torch.isfinite(lp).all() and (lp < 0).all())
    return ("PASS" if ok else "FAIL"), f"TE layer spec bf16 forward: log-probs finite and < 0: {ok}", {}


def check_vllm(device_run: bool, pytest_status: str) -> tuple[str, str, dict[str, Any]]:
    """With vLLM present its paths are tests/gpu/test_transports_gpu.py, run by the pytest check."""
    import torch

    if not device_run:
        return "NOT RUNNABLE", "not runnable on this device: vLLM weight sync and sleep/wake need CUDA (dry run)", {}
    if importlib.util.find_spec("vllm") is None:
        return (
            "NOT RUNNABLE",
            "not runnable on this device: vllm is not installed (its wheels exceed the "
            "64 MiB a device call may carry); NCCL/CUDA-IPC pushes into an engine and sleep/wake untested",
            {},
        )
    extra = "" if torch.cuda.device_count() >= 2 else "; the NCCL push also needs a second GPU (skipped)"
    return (
        pytest_status,
        f"vllm present: tests/gpu/test_transports_gpu.py ran in the pytest check ({pytest_status}){extra}",
        {},
    )


# ---------------------------------------------------------------------------------------- driver

_ACTOR: dict[str, Any] = {}
_DIMS: dict[str, Any] = {}


def _dims() -> Any:
    if "dims" not in _DIMS:
        from tools import gpu_check_actor as ga

        _DIMS["dims"] = ga.init_dims()
    return _DIMS["dims"]


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every check on CPU in fp32 (no CUDA needed)")
    ap.add_argument(
        "--dry-run-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="dtype of the dry run's device side (bf16: megatron's bf16 path on CPU vs the fp32 reference)",
    )
    ap.add_argument("--steps", type=int, default=5, help="updates in the GRPO loop check")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-time budget the whole run must fit")
    ap.add_argument("--report", default="", help="JSON report path (default $OUT/gpu_check.json when $OUT is set)")
    ap.add_argument("--cpu-reference", default="", help=argparse.SUPPRESS)
    ap.add_argument("--mixed-backend-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    missing = missing_modules()
    if missing:
        print(
            f"gpu_check: missing Python modules on this machine: {', '.join(missing)}. Download their wheels "
            "with tools/gpu_check_prepare.sh and carry .whl (docs/GPU.md).",
            flush=True,
        )
        return EXIT_MISSING
    if args.cpu_reference:
        cpu_reference(Path(args.cpu_reference))
        return 0
    if args.mixed_backend_probe:
        mixed_backend_probe()
        return 0
    if args.cpu_dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: hidden for real
    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda}); nothing "
            f"to prove here. Run with --cpu-dry-run to exercise the checks on CPU. Exit {EXIT_NO_CUDA}.",
            flush=True,
        )
        return EXIT_NO_CUDA
    device_run = not args.cpu_dry_run
    dtype = "bf16" if device_run else args.dry_run_dtype
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    gpu = torch.cuda.get_device_name(0) if device_run else "none (cpu dry run)"
    print(
        f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"device {gpu}, budget {args.budget_s:.0f} s",
        flush=True,
    )
    t0 = time.perf_counter()
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        report.run("pytest-gpu", check_pytest_gpu)
        report.run("actor-parity", lambda: check_actor_parity(dtype, Path(tmp)))
        report.run("process-groups", lambda: check_process_groups(device_run))
        report.run("grpo-loop", lambda: check_grpo_loop(dtype, args.steps))
        report.run("cpu-tensor-collectives", lambda: check_cpu_collectives(device_run))
        report.run("cuda-ipc-wire", lambda: check_cuda_ipc(device_run))
        report.run("transformer-engine", lambda: check_transformer_engine(device_run))
        pytest_status = report.results[0]["status"]
        report.run("vllm-paths", lambda: check_vllm(device_run, pytest_status))
    total = time.perf_counter() - t0
    report.run(
        "budget",
        lambda: (
            "PASS" if total <= args.budget_s else "FAIL",
            f"total {total:.1f} s of {args.budget_s:.0f} s",
            {"total_s": total},
        ),
    )
    out = args.report or (str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "")
    if out:
        Path(out).write_text(json.dumps({"device_run": device_run, "results": report.results}, indent=1, default=str))
    failed = report.failed
    print(
        f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all runnable checks passed'} "
        f"(total {total:.1f} s)",
        flush=True,
    )
    from megarl.distributed import shutdown

    shutdown()
    return EXIT_FAIL if failed else 0


if __name__ == "__main__":
    sys.exit(main())
