"""``megarl report RUN_DIR``: the run as plots (PNG) and one self-contained HTML page.

Panels: rollout reward and validation reward; KL; the coordinator's B_noise per model with
its approximate band next to the chosen batch; where measured, the noise split by prompt
(σ_b² between, σ_w² within, the within share, samples per prompt); learning rate per model; throughput (gen
tokens/s, responses/s); a MoE actor's expert load (busiest expert over the mean, per layer) and
dead experts, and with routing replay the share of tokens whose live experts differed; the
step-time split. Reads ``metrics.jsonl`` only — and, with ``--sweep DIR``, the ``sweep.json`` that ``benchmarks/time_to_target.py`` writes in its output
folder, so the batch the coordinator chose can be read against the best fixed batch of a
sweep and the critical batch fitted from it (both drawn as lines on the B_noise panel and
listed in the summary).
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megarl.errors import ReportError
from megarl.metrics import read_metrics


def _series(recs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(float(r["step"]))
            ys.append(float(v))
    return xs, ys


def _keys(recs: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in recs for k in r if k.startswith(prefix)})


SWEEP_FILE = "sweep.json"
"""Written by benchmarks/time_to_target.py: {"best": {"batch", "lr", "variant", ...}, "b_crit", ...}."""


def read_sweep(folder: str | Path) -> dict[str, Any]:
    """The sweep summary in ``folder``; :class:`ReportError` names what is missing."""
    path = Path(folder) / SWEEP_FILE
    if not path.is_file():
        raise ReportError(
            f"--sweep {folder}: no {SWEEP_FILE} there (benchmarks/time_to_target.py --out {folder} writes it)"
        )
    try:
        sweep = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    best = sweep.get("best") if isinstance(sweep, dict) else None
    if not isinstance(best, dict) or not isinstance(best.get("batch"), (int, float)):
        raise ReportError(f"{path}: expected 'best' with a numeric 'batch' (the sweep's optimum), found {best!r}")
    return dict(sweep)


def _panels(recs: list[dict[str, Any]]) -> list[tuple[str, list[tuple[str, str]], dict[str, Any]]]:
    """(title, [(metric key, label)], options) per panel."""
    panels: list[tuple[str, list[tuple[str, str]], dict[str, Any]]] = [
        ("Reward", [("rollout/reward_mean", "rollout (sampled)"), ("val/reward", "validation (greedy)")], {}),
        ("KL to reference", [(k, k) for k in ("train/kl", "train/kl_reward") if _keys(recs, k)], {}),
    ]
    models = sorted({k.split("/")[-1] for k in _keys(recs, "coord/b_noise/")})
    if models:
        lines = [(f"coord/b_noise/{m}", f"B_noise {m}") for m in models] + [("coord/batch", "chosen batch")]
        panels.append(("Critical batch (responses)", lines, {"log": True, "bands": models}))
    split = sorted({k.split("/")[-1] for k in _keys(recs, "coord/noise_within/")})
    if split:  # the noise split by prompt (coordinator.noise_split or choose=prompts_and_samples)
        lines = [(f"coord/noise_{part}/{m}", f"{part} {m}") for m in split for part in ("between", "within")]
        panels.append(("Gradient noise by prompt: σ_b² between, σ_w² within (per unit)", lines, {}))
        lines = [(f"coord/noise_within_share/{m}", f"within share {m}") for m in split]
        lines += [("coord/samples_per_prompt", "samples per prompt")] if _keys(recs, "coord/samples_per_prompt") else []
        panels.append(("Within-prompt share of the noise; samples per prompt", lines, {}))
    lr_keys = _keys(recs, "coord/lr/") or [k for k in ("train/lr", "critic/lr") if _keys(recs, k)]
    panels.append(("Learning rate", [(k, k) for k in lr_keys], {"log": True}))
    panels.append(("Generation throughput", [("coord/gen_tokens_per_s", "gen tokens/s (model)")], {}))
    if _keys(recs, "env/turns_mean"):  # multi-turn episodes (env.fn / env.agent)
        panels.append(("Episodes", [("env/turns_mean", "turns"), ("env/tool_calls_mean", "tool calls")], {}))
        panels.append(
            (
                "Environment (fraction)",
                [
                    ("env/tool_error_rate", "tool error rate"),
                    ("env/truncated_frac", "truncated"),
                    ("env/time_frac", "step share waiting on environments"),
                ],
                {},
            )
        )
    if _keys(recs, "moe/load_max_over_mean"):  # a mixture-of-experts actor (megarl.model.expert_load)
        layers = _keys(recs, "moe/load_max_over_mean/")  # each layer's line up to 8 layers, else the worst's
        lines = (
            [(k, k.split("/")[-1]) for k in layers] if len(layers) <= 8 else [("moe/load_max_over_mean", "worst layer")]
        )
        panels.append(("Expert load (busiest expert / mean)", lines, {}))
        panels.append(("Dead experts (no token in the step)", [("moe/dead_experts", "all layers")], {}))
    if _keys(recs, "moe/route_mismatch"):  # MoE routing replay (megarl.model.routes)
        layers = _keys(recs, "moe/route_mismatch/")
        lines = [(k, k.split("/")[-1]) for k in layers] if len(layers) <= 8 else [("moe/route_mismatch", "mean")]
        panels.append(("Routing replay: share of tokens whose live experts differ", lines, {}))
    if _keys(recs, "moe/engine_route_mismatch"):  # algo.router_replay: rollout (megarl.model.routes)
        layers = _keys(recs, "moe/engine_route_mismatch/")
        lines = [(k, k.split("/")[-1]) for k in layers] if len(layers) <= 8 else [("moe/engine_route_mismatch", "mean")]
        panels.append(("Engine vs trainer routing: share of tokens whose old-forward experts differ", lines, {}))
    panels.append(
        (
            "Step time split (s)",
            [(k, k.split("/")[-1]) for k in _keys(recs, "timing/step/") if not k.endswith("total")],
            {"stack": True},
        )
    )
    return panels


def draw(run_dir: str | Path, out_dir: str | Path | None = None, sweep_dir: str | Path | None = None) -> Path:
    """Write report.html and one PNG per panel; returns the HTML path. ``sweep_dir``: a
    time-to-target benchmark folder whose sweep optimum (and fitted B_crit) is shown too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    recs = read_metrics(run)
    sweep = read_sweep(sweep_dir) if sweep_dir is not None else None
    if not recs:
        raise ReportError(f"{run}/metrics.jsonl has no records: the run logged no step yet")
    out = Path(out_dir) if out_dir else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    images: list[tuple[str, Path]] = []
    for i, (title, lines, opts) in enumerate(_panels(recs)):
        fig, ax = plt.subplots(figsize=(7, 3.4))
        drawn = 0
        if opts.get("stack"):
            steps = [float(r["step"]) for r in recs if "timing/step/update" in r]
            ys = [[float(r.get(k, 0.0)) for r in recs if "timing/step/update" in r] for k, _ in lines]
            if steps:
                ax.stackplot(steps, *ys, labels=[lab for _, lab in lines])
                drawn = 1
        else:
            for key, label in lines:
                xs, vals = _series(recs, key)
                if xs:
                    ax.plot(xs, vals, label=label, marker="." if len(xs) < 30 else None)
                    drawn += 1
            for m in opts.get("bands", []):
                low = dict(zip(*_series(recs, f"coord/b_noise_low/{m}")))
                high = dict(zip(*_series(recs, f"coord/b_noise_high/{m}")))
                xs = sorted(set(low) & set(high))  # steps where both band ends are finite
                if xs:
                    ax.fill_between(xs, [low[x] for x in xs], [high[x] for x in xs], alpha=0.2, label=f"band {m}")
            if opts.get("bands") and sweep is not None:
                ax.axhline(sweep["best"]["batch"], color="k", ls="--", lw=1, label="sweep optimum batch")
                if sweep.get("b_crit"):
                    ax.axhline(sweep["b_crit"], color="k", ls=":", lw=1, label="B_crit fitted on the sweep")
        if not drawn:
            plt.close(fig)
            continue
        if opts.get("log"):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{i:02d}_{title.split()[0].lower()}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        images.append((title, path))
    last = recs[-1]
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary(recs, last, sweep)
    )
    body = "".join(
        f"<h3>{html.escape(t)}</h3><img src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>"
        for t, p in images
    )
    page = out / "report.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>megarl report: {html.escape(str(run))}</title>"
        "<style>body{font-family:sans-serif;max-width:900px;margin:auto}td{padding:2px 8px}</style></head>"
        f"<body><h1>megarl run {html.escape(run.name)}</h1><table>{rows}</table>{body}</body></html>"
    )
    return page


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _expert_rows(recs: list[dict[str, Any]]) -> Iterable[tuple[str, str]]:
    """A MoE actor's expert health: the last step's, and how many steps had a dead expert."""
    steps = [r for r in recs if _finite(r.get("moe/dead_experts"))]
    if not steps:
        return
    last = steps[-1]
    yield f"expert load, busiest / mean, worst layer (step {last['step']})", f"{last['moe/load_max_over_mean']:.4g}"
    yield f"dead experts (step {last['step']})", f"{last['moe/dead_experts']:.0f}"
    dead = sum(1 for r in steps if r["moe/dead_experts"] > 0)
    yield "steps with a dead expert", f"{dead} of {len(steps)}"


def summary(
    recs: list[dict[str, Any]], last: dict[str, Any], sweep: dict[str, Any] | None = None
) -> Iterable[tuple[str, str]]:
    """(label, value) rows of the report's table."""
    vals = [r["val/reward"] for r in recs if "val/reward" in r]
    if vals:
        yield "validation reward (first)", f"{vals[0]:.6g}"
        yield "validation reward (last)", f"{vals[-1]:.6g}"
    yield "steps", f"{max(r['step'] for r in recs)}"
    for m in sorted({k.split("/")[-1] for k in _keys(recs, "coord/b_noise/")}):
        keys = (f"coord/b_noise/{m}", f"coord/b_noise_low/{m}", f"coord/b_noise_high/{m}")
        rec = next((r for r in reversed(recs) if _finite(r.get(keys[0]))), None)
        if rec is None:
            yield f"B_noise {m} (responses)", "no estimate yet"
            continue
        lo, hi = rec.get(keys[1]), rec.get(keys[2])
        # the high end is inf while |G|² is not yet resolved from zero: shown as such
        band = f"band {lo:.4g} .. {hi:.4g}" if _finite(lo) and _finite(hi) or hi == math.inf else "no band yet"
        yield f"B_noise {m} (responses, step {rec['step']})", f"{rec[keys[0]]:.4g} ({band})"
    for m in sorted({k.split("/")[-1] for k in _keys(recs, "coord/noise_within_share/")}):  # the noise split
        rec = next((r for r in reversed(recs) if _finite(r.get(f"coord/noise_within_share/{m}"))), None)
        if rec is not None:
            yield (
                f"noise within prompts, share of {m}'s (step {rec['step']})",
                f"{rec[f'coord/noise_within_share/{m}']:.1%}",
            )
    env = [r for r in recs if _finite(r.get("env/turns_mean"))]
    if env:  # episodes: means over the run's steps
        for key, label, fmt in (
            ("env/turns_mean", "turns per episode", "{:.2f}"),
            ("env/tool_calls_mean", "tool calls per episode", "{:.2f}"),
            ("env/tool_error_rate", "tool error rate", "{:.1%}"),
            ("env/truncated_frac", "episodes truncated", "{:.1%}"),
            ("env/time_frac", "step share waiting on environments", "{:.1%}"),
        ):
            vals = [float(r[key]) for r in env if _finite(r.get(key))]
            if vals:
                yield f"{label} (mean of {len(vals)} steps)", fmt.format(sum(vals) / len(vals))
        yield "episodes failed in their environment", f"{sum(float(r.get('env/failures', 0.0)) for r in env):.0f}"
    yield from _expert_rows(recs)
    for k in (
        "coord/batch",
        "coord/samples_per_prompt",
        "train/lr",
    ):  # the last step's (the final record is often validation only)
        v = next((r[k] for r in reversed(recs) if _finite(r.get(k))), None)
        if v is not None:
            yield k + " (last)", f"{v:.6g}"
    if sweep is not None:
        best = sweep["best"]
        yield (
            "sweep optimum batch (responses)",
            f"{best['batch']:.6g}" + (f" at lr {best['lr']:.4g}" if isinstance(best.get("lr"), (int, float)) else ""),
        )
        chosen = next((r["coord/batch"] for r in reversed(recs) if _finite(r.get("coord/batch"))), None)
        if chosen is not None:
            yield "chosen batch / sweep optimum", f"{chosen / best['batch']:.3g}"
        b_crit = sweep.get("b_crit")
        if isinstance(b_crit, (int, float)):
            yield "B_crit fitted on the sweep (responses)", f"{b_crit:.4g}"
        else:
            yield "B_crit fitted on the sweep", f"not identified ({sweep.get('fit_refused') or 'no fit'})"
