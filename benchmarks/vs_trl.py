"""megarl versus TRL's GRPOTrainer on the same model, task, reward and batch, side by side.

Both trainers start from one HF folder written by megarl's conversion tool (`megarl convert
megarl-to-hf`) from a briefly warm-started megarl checkpoint, use the same SentencePiece
tokenizer (same prompt ids, BOS included), the built-in arithmetic prompts, the same reward
function, prompts × samples per step, response limits, steps, AdamW settings (constant LR,
no weight decay, grad clip 1.0), GRPO group advantages, clip 0.2, k3 KL with β = 0.01 and
token-mean loss (TRL `loss_type="dapo"`). TRL runs as its docs say for CPU: `use_cpu=True`,
fp32, `use_vllm=False` (its vLLM path crashes on the CPU build), all cores to torch, and
gradient checkpointing off (TRL's default is on; memory allows off here, which is faster).

Scales:
  a  the demo model (2 layers × 128), 32 prompts × 16 samples, responses ≤ 6 tokens
  b  a 50M-parameter model (8 layers × 768), 32 prompts × 8 samples, responses of exactly
     256 tokens (EOS suppressed until 256: vLLM min_tokens / HF min_new_tokens), 1.0 when
     the response starts with the answer: generation is real work

Measured per trainer (each in its own process tree, one after the other): per-step wall
time (mean over the steps after the first, and the first), generation tokens/s (response
tokens / generation time), training tokens/s (prompt + response tokens / the rest of the
step), peak RSS summed over the process tree (trainer ranks and engines), mean reward of
the last steps and total wall time. Prints a table and a JSON line of TRL/megarl ratios.

    pip install -r benchmarks/requirements-bench.txt      # trl 1.16.0, py-spy (bench only)
    python benchmarks/vs_trl.py [--scales a,b] [--steps-a 20] [--steps-b 3] [--profile]

`--profile` also samples the megarl run with py-spy (all processes) and prints the top
functions of the trainer rank 0 and of the engine (collapsed stacks under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, table  # noqa: E402

BASE = "examples/grpo_cpu.yaml"
COMMON = [
    "coordinator.enabled=false",
    "train.eval_every=0",
    "optim.lr=1.0e-4",
    "optim.schedule=constant",
    "optim.weight_decay=0.0",
    "optim.clip_grad=1.0",
    "algo.advantage=grpo",
    "algo.loss_agg=token-mean",
    "algo.kl_coef=0.01",
    "algo.kl_estimator=k3",
    "algo.clip_low=0.2",
    "algo.clip_high=0.2",
]
SCALES: dict[str, dict[str, Any]] = {
    "a": {
        "model": [],
        "warm_start": ["warm_start.steps=150"],
        "rollout": {
            "num_prompts": 32,
            "samples_per_prompt": 16,
            "max_prompt_len": 12,
            "max_response_len": 6,
            "min_response_len": 0,
        },
        "micro_batch": 64,
        "reward": "arithmetic",
        "extra": [],
        # tuned: TP is pure overhead for a model this small on CPU; DP2 + big forward-only micro-batches
        "variants": {
            "default": [],
            "tuned": [
                "parallel.tensor_parallel=1",
                "parallel.data_parallel=2",
                "parallel.logprob_micro_batch_size=256",
            ],
        },
    },
    "b": {
        "model": [
            "model.num_layers=8",
            "model.hidden_size=768",
            "model.num_attention_heads=12",
            "model.num_query_groups=4",
            "model.ffn_hidden_size=2048",
            "model.max_position_embeddings=288",
        ],
        "warm_start": ["warm_start.steps=100", "warm_start.lr=3.0e-4"],
        "rollout": {
            "num_prompts": 32,
            "samples_per_prompt": 8,
            "max_prompt_len": 12,
            "max_response_len": 256,
            "min_response_len": 256,
        },
        "micro_batch": 32,
        "reward": "answer_prefix",
        "extra": ["rollout.kv_cache_gb=2.0"],
        # tuned: DP2 (no per-layer activation all-reduces), 16 rows per rank keep 32 in flight like TRL
        "variants": {
            "default": [],
            "tuned": [
                "parallel.tensor_parallel=1",
                "parallel.data_parallel=2",
                "parallel.micro_batch_size=16",
                "parallel.logprob_micro_batch_size=64",
            ],
        },
    },
}


# --------------------------------------------------------------------------- process tree


class PeakRSS:
    """Polls the summed RSS of a process and all its descendants."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def _run(cmd: list[str], log: Path, env: dict[str, str], timeout: int) -> tuple[float, int]:
    """Run to completion; (wall seconds, peak RSS bytes). Raises with the log tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        mem = PeakRSS(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            peak = mem.stop()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{log.read_text()[-3000:]}")
    return wall, peak


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    return env


# --------------------------------------------------------------------------- shared model


def _scale_sets(scale: str) -> list[str]:
    s = SCALES[scale]
    r = [f"rollout.{k}={v}" for k, v in s["rollout"].items()]
    return [
        *COMMON,
        *s["model"],
        *r,
        f"parallel.micro_batch_size={s['micro_batch']}",
        f"reward.fn={s['reward']}",
        *s["extra"],
    ]


def prepare(scale: str, out: Path) -> Path:
    """Warm-start a megarl model, convert its checkpoint with `megarl convert`; the HF folder."""
    hf = out / f"hf_{scale}"
    if (hf / "config.json").exists():
        return hf
    run = out / f"prep_{scale}"
    shutil.rmtree(run, ignore_errors=True)
    s = SCALES[scale]
    sets = [*_scale_sets(scale), *s["warm_start"], "train.steps=0", "train.resume=never", f"train.run_dir={run}"]
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", BASE]
    for x in sets:
        cmd += ["--set", x]
    _run(cmd, out / "logs" / f"prep_{scale}.log", _env(1), 3600)
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "convert",
        "megarl-to-hf",
        "--ckpt",
        str(run / "checkpoints"),
        "--out",
        str(hf),
    ]
    _run(cmd, out / "logs" / f"convert_{scale}.log", _env(1), 1200)
    shutil.copytree(run / "tokenizer", out / f"tokenizer_{scale}", dirs_exist_ok=True)
    return hf


# --------------------------------------------------------------------------- megarl side


def run_megarl(
    scale: str, hf: Path, steps: int, out: Path, profile: bool, variant: str, extra: list[str]
) -> dict[str, Any]:
    run = out / f"megarl_{scale}_{variant}"
    shutil.rmtree(run, ignore_errors=True)
    (run / "tokenizer").mkdir(parents=True)
    shutil.copy(out / f"tokenizer_{scale}" / "tokenizer.model", run / "tokenizer" / "tokenizer.model")
    sets = [
        *_scale_sets(scale),
        f"model.init_from={hf}",
        "warm_start.steps=0",
        f"train.steps={steps}",
        "train.resume=never",
        f"train.run_dir={run}",
        *SCALES[scale]["variants"][variant],
        *extra,
    ]
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", BASE]
    for x in sets:
        cmd += ["--set", x]
    prof = out / f"pyspy_megarl_{scale}_{variant}.txt"
    if profile:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        cmd = [spy, "record", "--subprocesses", "--rate", "25", "--format", "raw", "--output", str(prof), "--", *cmd]
    wall, peak = _run(cmd, out / "logs" / f"megarl_{scale}_{variant}.log", _env(1), 7200)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step/total" in r]
    if len(rows) != steps:
        raise RuntimeError(f"megarl wrote {len(rows)} step rows, want {steps}")
    res = _summarise(
        step_s=[r["timing/step/total"] for r in rows],
        gen_s=[r["timing/step/generate"] for r in rows],
        resp_tokens=[r["rollout/tokens"] for r in rows],
        seq_tokens=[r["rollout/sequence_tokens"] for r in rows],
        rewards=[r["rollout/reward_mean"] for r in rows],
        wall=wall,
        peak=peak,
    )
    res["phases_s"] = {
        k.split("/")[-1]: _mean([r[k] for r in rows[1:] or rows])
        for k in rows[0]
        if k.startswith("timing/step/") and k != "timing/step/total"
    }
    if profile:
        res["profile"] = summarise_profile(prof)
    return res


# --------------------------------------------------------------------------- TRL side


def run_trl(scale: str, hf: Path, steps: int, out: Path) -> dict[str, Any]:
    res_file = out / f"trl_{scale}.json"
    cmd = [
        sys.executable,
        __file__,
        "--_trl-worker",
        scale,
        "--_hf",
        str(hf),
        "--_steps",
        str(steps),
        "--_out",
        str(res_file),
    ]
    wall, peak = _run(cmd, out / "logs" / f"trl_{scale}.log", _env(None), 7200)
    w = json.loads(res_file.read_text())
    return _summarise(w["step_s"], w["gen_s"], w["resp_tokens"], w["seq_tokens"], w["rewards"], wall, peak)


def trl_worker(scale: str, hf: Path, steps: int, res_file: Path) -> None:
    """Runs inside its own process: TRL GRPOTrainer with the settings megarl uses."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.config import DataConfig
    from megarl.data.prompts import load_prompts
    from megarl.data.tokenizer import Tokenizer
    from megarl.rewards.builtin import REWARDS

    torch.set_num_threads(os.cpu_count() or 1)
    s, r = SCALES[scale], SCALES[scale]["rollout"]
    data_cfg = DataConfig(max_operand=20)  # the demo's task (examples/grpo_cpu.yaml)
    train_rows, _ = load_prompts(data_cfg, data_cfg.seed)
    tok = AutoTokenizer.from_pretrained(str(hf))
    tok.pad_token = "<pad>"
    ours = Tokenizer(hf / "tokenizer.model")
    for row in train_rows[:50]:  # the two trainers must see the same prompt ids
        got = tok("<s>" + row.prompt, add_special_tokens=False).input_ids
        if got != ours.encode(row.prompt):
            raise RuntimeError(f"HF tokenizer gives {got} for {row.prompt!r}, megarl {ours.encode(row.prompt)}")
    ds = Dataset.from_dict({"prompt": ["<s>" + x.prompt for x in train_rows], "answer": [x.answer for x in train_rows]})
    fn = REWARDS[s["reward"]]

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [fn(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    batch = r["num_prompts"] * r["samples_per_prompt"]
    mbs = s["micro_batch"]
    cfg = GRPOConfig(
        output_dir=str(res_file.parent / f"trl_{scale}_out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=batch // mbs,
        num_generations=r["samples_per_prompt"],
        max_completion_length=r["max_response_len"],
        generation_kwargs={"min_new_tokens": r["min_response_len"]} if r["min_response_len"] else None,
        temperature=1.0,
        top_p=1.0,
        learning_rate=1.0e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.01,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_dropout=True,
        gradient_checkpointing=False,  # TRL's default is on; memory allows off here, which is faster
        seed=1,
        dataloader_num_workers=0,
    )
    gen_s: list[float] = []
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            gen_s.append(0.0)

        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()]
    )
    inner = trainer.model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            if gen_s:
                gen_s[-1] += time.perf_counter() - t0

    trainer.model.generate = timed_generate  # type: ignore[method-assign]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if len(logs) != steps or len(ends) != steps + 1 or not all(g > 0 for g in gen_s):
        raise RuntimeError(f"TRL logged {len(logs)} steps, {len(ends) - 1} step ends, generation times {gen_s}")
    seq = [h["num_tokens"] for h in logs]  # cumulative prompt + completion tokens
    resp = [h["completions/mean_length"] * batch for h in logs]
    res_file.write_text(
        json.dumps(
            {
                "step_s": [b - a for a, b in zip(ends, ends[1:])],
                "gen_s": gen_s,
                "resp_tokens": resp,
                "seq_tokens": [b - a for a, b in zip([0.0, *seq], seq)],
                "rewards": [h["reward"] for h in logs],
            }
        )
    )


# --------------------------------------------------------------------------- summaries


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _summarise(
    step_s: list[float],
    gen_s: list[float],
    resp_tokens: list[float],
    seq_tokens: list[float],
    rewards: list[float],
    wall: float,
    peak: int,
) -> dict[str, Any]:
    k = slice(1, None) if len(step_s) > 1 else slice(None)  # steady state: after the first step
    gen, step = sum(gen_s[k]), sum(step_s[k])
    last = max(1, min(3, len(rewards)))
    return {
        "step_s": step / len(step_s[k]),
        "first_step_s": step_s[0],
        "gen_tok_s": sum(resp_tokens[k]) / gen,
        "train_tok_s": sum(seq_tokens[k]) / (step - gen),
        "peak_rss_gb": peak / 2**30,
        "reward_last": _mean(rewards[-last:]),
        "wall_s": wall,
        "steps": len(step_s),
    }


def summarise_profile(path: Path, rate: int = 25, top: int = 8) -> dict[str, Any]:
    """py-spy raw (collapsed) stacks of a process tree → per process: CPU-active seconds, the
    megarl/vLLM functions with the most inclusive time and the leaf functions (self time).
    py-spy records only threads that are running, so idle waits do not count."""
    procs: dict[str, dict[str, Counter[str]]] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        pframes = [f for f in frames if f.startswith("process ")]
        if not pframes:
            continue
        cmd = pframes[-1]
        pid = cmd.split(":")[0].removeprefix("process ")
        role = "engine" if "megarl.engine.server" in cmd else ("launcher" if "torch.distributed.run" in cmd else "trainer")
        if role == "trainer" and " -u " not in cmd and "megarl.cli" in cmd and "LOCAL_RANK" not in cmd:
            role = "trainer"
        key = f"{role}[{pid}]"
        funcs = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not funcs:
            continue
        c = procs.setdefault(key, {"incl": Counter(), "self": Counter(), "total": Counter()})
        c["total"]["n"] += int(n)
        names = {_fname(f) for f in funcs}
        for name in names:
            if name.startswith(("megarl/", "vllm/")) or "megatron/" in name:
                c["incl"][name] += int(n)
        c["self"][_fname(funcs[-1])] += int(n)
    out = {}
    for key, c in sorted(procs.items(), key=lambda kv: -kv[1]["total"]["n"]):
        total = c["total"]["n"]
        if total < 20:
            continue
        out[key] = {
            "cpu_s": round(total / rate, 1),
            "inclusive": [(f, round(k / total, 3)) for f, k in c["incl"].most_common(top)],
            "self": [(f, round(k / total, 3)) for f, k in c["self"].most_common(top)],
        }
    return out


def _fname(frame: str) -> str:
    """'PolicyUpdater.__call__ (megarl/update/optimize.py:30)' → 'megarl/update/optimize.py:PolicyUpdater.__call__'."""
    fn, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0]
    for root in ("megarl/", "vllm/", "megatron/", "torch/", "transformers/"):
        if root in file:
            file = root + file.split(root, 1)[1]
            break
    return f"{file}:{fn}"


METRICS = ["step_s", "first_step_s", "gen_tok_s", "train_tok_s", "peak_rss_gb", "reward_last", "wall_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="a,b")
    ap.add_argument("--steps-a", type=int, default=20)
    ap.add_argument("--steps-b", type=int, default=3)
    ap.add_argument("--variants", default="default,tuned", help="megarl settings to run (SCALES[...]['variants'])")
    ap.add_argument("--megarl-set", action="append", default=[], help="extra override for every megarl run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    ap.add_argument("--profile", action="store_true", help="sample the megarl runs with py-spy (slows them)")
    ap.add_argument("--label", default="", help="tag stored with the results (e.g. before/after)")
    ap.add_argument("--no-trl", action="store_true", help="megarl only (exploring settings; no ratios)")
    ap.add_argument("--_trl-worker", dest="trl_worker")
    ap.add_argument("--_hf", type=Path)
    ap.add_argument("--_steps", type=int)
    ap.add_argument("--_out", type=Path)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args._hf, args._steps, args._out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    results: dict[str, Any] = {"label": args.label, "megarl_set": args.megarl_set}
    rows = []
    for scale in args.scales.split(","):
        steps = args.steps_a if scale == "a" else args.steps_b
        hf = prepare(scale, args.out)
        res: dict[str, Any] = {}
        if not args.no_trl:
            res["trl"] = run_trl(scale, hf, steps, args.out)
        for v in variants:
            res[f"megarl[{v}]"] = run_megarl(scale, hf, steps, args.out, args.profile, v, args.megarl_set)
        results[scale] = res
        for m in METRICS:
            row: dict[str, Any] = {"scale": scale, "metric": m, "TRL": res.get("trl", {}).get(m)}
            for v in variants:
                g = res[f"megarl[{v}]"][m]
                row[f"megarl[{v}]"] = g
                row[f"TRL/megarl[{v}]"] = row["TRL"] / g if row["TRL"] is not None and g else None
            rows.append(row)
        for v in variants:
            r = res[f"megarl[{v}]"]
            print(
                f"scale {scale} megarl[{v}] phases (s/step): {json.dumps({k: round(x, 3) for k, x in r['phases_s'].items()})}"
            )
            for key, p in r.get("profile", {}).items():
                print(f"scale {scale} megarl[{v}] py-spy {key}: {p['cpu_s']} CPU-s")
                print(f"   inclusive: {p['inclusive']}")
                print(f"   self:      {p['self']}")
    cols = ["scale", "metric", "TRL", *[f"megarl[{v}]" for v in variants], *[f"TRL/megarl[{v}]" for v in variants]]
    print(table(rows, cols))
    (args.out / f"results{'_' + args.label if args.label else ''}.json").write_text(json.dumps(results, indent=1))
    ratios = {
        f"{r['scale']}/{r['metric']}/{v}": round(r[f"TRL/megarl[{v}]"], 3)
        for r in rows
        for v in variants
        if r[f"TRL/megarl[{v}]"] is not None
    }
    print(json.dumps({"benchmark": "vs_trl", "label": args.label, "ratios_trl_over_megarl": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
