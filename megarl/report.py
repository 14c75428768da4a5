"""``megarl report RUN_DIR``: the run as plots (PNG) and one self-contained HTML page.

Panels: rollout reward and validation reward; KL; the coordinator's B_noise per model with
its approximate band next to the chosen batch; learning rate per model; throughput (gen
tokens/s, responses/s) and the step-time split. Reads ``metrics.jsonl`` only.
"""

from __future__ import annotations

import base64
import html
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
    lr_keys = _keys(recs, "coord/lr/") or [k for k in ("train/lr", "critic/lr") if _keys(recs, k)]
    panels.append(("Learning rate", [(k, k) for k in lr_keys], {"log": True}))
    panels.append(("Generation throughput", [("coord/gen_tokens_per_s", "gen tokens/s (model)")], {}))
    panels.append(
        (
            "Step time split (s)",
            [(k, k.split("/")[-1]) for k in _keys(recs, "timing/step/") if not k.endswith("total")],
            {"stack": True},
        )
    )
    return panels


def draw(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.html and one PNG per panel; returns the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    recs = read_metrics(run)
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
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in _summary(recs, last))
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


def _summary(recs: list[dict[str, Any]], last: dict[str, Any]) -> Iterable[tuple[str, float]]:
    vals = [r["val/reward"] for r in recs if "val/reward" in r]
    if vals:
        yield "validation reward (first)", vals[0]
        yield "validation reward (last)", vals[-1]
    yield "steps", float(max(r["step"] for r in recs))
    for k in ("coord/batch", "train/lr"):
        if k in last:
            yield k + " (last)", last[k]
