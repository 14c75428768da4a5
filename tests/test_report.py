"""megarl/report.py: B_noise with its band, the chosen batch and — with ``--sweep`` — the
time-to-target sweep's optimum batch and fitted B_crit, drawn from real files through the CLI."""

import html
import json
import re
from pathlib import Path

import pytest

from megarl import cli


def _run_with_coordinator(run: Path) -> None:
    run.mkdir()
    lines = [{"step": 0, "val/reward": 0.3}]
    for s in range(1, 9):
        lines.append(
            {
                "step": s,
                "rollout/reward_mean": 0.3 + 0.01 * s,
                "coord/b_noise/actor": 300.0 + 10 * s,
                "coord/b_noise_low/actor": 200.0 + 10 * s,
                "coord/b_noise_high/actor": 450.0 + 10 * s,
                "coord/batch": 128.0 if s < 5 else 512.0,
                "coord/lr/actor": 1e-4,
            }
        )
    nan = float("nan")  # a last step without an estimate: the report shows step 8's, band and all
    lines.append({"step": 9, "coord/b_noise/actor": nan, "coord/b_noise_low/actor": nan, "coord/batch": 512.0})
    lines.append({"step": 9, "val/reward": 0.4})  # the final validation: a record of its own
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _table(page: Path) -> dict[str, str]:
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", page.read_text())
    return {html.unescape(k): html.unescape(v) for k, v in rows}


def test_report_shows_b_noise_band_chosen_batch_and_the_sweep_optimum(tmp_path: Path) -> None:
    _run_with_coordinator(tmp_path / "run")
    sweep = tmp_path / "bench"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(
        json.dumps({"best": {"variant": "sweep_p16_m1", "batch": 256, "lr": 7.07e-5}, "b_crit": 420.0})
    )
    assert cli.main(["report", str(tmp_path / "run")]) == 0
    plain = _table(tmp_path / "run" / "report" / "report.html")
    assert plain["B_noise actor (responses, step 8)"] == "380 (band 280 .. 530)"
    assert plain["coord/batch (last)"] == "512"
    assert not any("sweep" in k for k in plain)
    lines = (
        (tmp_path / "run" / "metrics.jsonl")
        .read_text()
        .replace('"coord/b_noise_high/actor": 530.0', '"coord/b_noise_high/actor": Infinity')
    )
    (tmp_path / "run" / "metrics.jsonl").write_text(lines)
    assert cli.main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "r_inf")]) == 0
    assert _table(tmp_path / "r_inf" / "report.html")["B_noise actor (responses, step 8)"] == "380 (band 280 .. inf)"
    assert cli.main(["report", str(tmp_path / "run"), "--sweep", str(sweep), "--out", str(tmp_path / "r2")]) == 0
    rows = _table(tmp_path / "r2" / "report.html")
    assert rows["sweep optimum batch (responses)"] == "256 at lr 7.07e-05"
    assert rows["chosen batch / sweep optimum"] == "2"
    assert rows["B_crit fitted on the sweep (responses)"] == "420"
    panel = next((tmp_path / "r2").glob("*critical*.png"))
    assert panel.stat().st_size > 1000


def test_report_sweep_errors_name_the_file(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _run_with_coordinator(tmp_path / "run")
    assert cli.main(["report", str(tmp_path / "run"), "--sweep", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip()
    assert err == (
        f"megarl: report error: --sweep {tmp_path}: no sweep.json there "
        f"(benchmarks/time_to_target.py --out {tmp_path} writes it)"
    )
    (tmp_path / "sweep.json").write_text(json.dumps({"best": {"lr": 1e-4}}))
    assert cli.main(["report", str(tmp_path / "run"), "--sweep", str(tmp_path)]) == 2
    assert "expected 'best' with a numeric 'batch'" in capfd.readouterr().err


def test_report_shows_what_episodes_did(tmp_path: Path) -> None:
    """A multi-turn run's report: panels for turns and tool calls and for the environment's
    error, truncation and time shares, and their means over the run in the table."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {
            "step": s,
            "rollout/reward_mean": 0.1 * s,
            "env/turns_mean": 2.0 + s,
            "env/tool_calls_mean": 1.0 + s,
            "env/tool_error_rate": 0.1 * s,
            "env/truncated_frac": 0.25,
            "env/time_frac": 0.05 * s,
            "env/failures": float(s),
            "timing/step/update": 0.5,
        }
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert cli.main(["report", str(run)]) == 0
    rows = _table(run / "report" / "report.html")
    assert rows["turns per episode (mean of 2 steps)"] == "3.50"
    assert rows["tool calls per episode (mean of 2 steps)"] == "2.50"
    assert rows["tool error rate (mean of 2 steps)"] == "15.0%"
    assert rows["episodes truncated (mean of 2 steps)"] == "25.0%"
    assert rows["step share waiting on environments (mean of 2 steps)"] == "7.5%"
    assert rows["episodes failed in their environment"] == "3"
    titles = re.findall(r"<h3>(.*?)</h3>", (run / "report" / "report.html").read_text())
    assert "Episodes" in titles and "Environment (fraction)" in titles
    single = tmp_path / "single"  # a single-turn run: no episode panels, no rows
    single.mkdir()
    (single / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    assert cli.main(["report", str(single)]) == 0
    assert "Episodes" not in (single / "report" / "report.html").read_text()


def test_report_draws_expert_load_and_dead_experts(tmp_path: Path) -> None:
    """A MoE run's ``moe/*`` metrics (``megarl.model.expert_load``): a panel per layer's load and
    one of dead experts, and the last step's values in the table; with routing replay a panel of
    the route mismatch per layer, and with the engines' routes one of engine vs trainer."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 0, "val/reward": 0.1}]
    for s in range(1, 6):
        dead = 2.0 if s in (3, 4) else 0.0
        lines.append(
            {
                "step": s,
                "rollout/reward_mean": 0.1,
                "moe/load_max_over_mean/layer0": 1.5 + 0.1 * s,
                "moe/load_max_over_mean/layer1": 1.2,
                "moe/load_max_over_mean": 1.5 + 0.1 * s,
                "moe/dead_experts": dead,
                "moe/route_mismatch/layer0": 0.01 * s,  # routing replay (megarl.model.routes)
                "moe/route_mismatch/layer1": 0.02,
                "moe/route_mismatch": (0.01 * s + 0.02) / 2,
                "moe/engine_route_mismatch/layer0": 0.03,  # the engines' routes (algo.router_replay: rollout)
                "moe/engine_route_mismatch": 0.03,
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert cli.main(["report", str(run)]) == 0
    rows = _table(run / "report" / "report.html")
    assert rows["expert load, busiest / mean, worst layer (step 5)"] == "2"
    assert rows["dead experts (step 5)"] == "0"
    assert rows["steps with a dead expert"] == "2 of 5"
    for name in ("expert", "dead", "routing", "engine"):
        assert next((run / "report").glob(f"*_{name}.png")).stat().st_size > 1000


def test_report_shows_the_noise_split_by_prompt(tmp_path: Path) -> None:
    """coord/noise_between|within|within_share (the noise split) and coord/samples_per_prompt
    (choose=prompts_and_samples): two panels and the last step's within share in the table."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {
            "step": s,
            "rollout/reward_mean": 0.2,
            "coord/b_noise/actor": 300.0,
            "coord/batch": 128.0,
            "coord/noise_between/actor": -0.5 + s,  # a noisy σ_b² can come out negative: drawn on a linear axis
            "coord/noise_within/actor": 40.0,
            "coord/noise_within_share/actor": 0.6 + 0.05 * s,
            "coord/samples_per_prompt": 8.0 if s < 3 else 16.0,
        }
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert cli.main(["report", str(run)]) == 0
    page = run / "report" / "report.html"
    rows = _table(page)
    assert rows["noise within prompts, share of actor's (step 3)"] == "75.0%"
    assert rows["coord/samples_per_prompt (last)"] == "16"
    titles = re.findall(r"<h3>(.*?)</h3>", page.read_text())
    assert any(t.startswith("Gradient noise by prompt") for t in titles), titles
    assert any(t.startswith("Within-prompt share") for t in titles), titles
    plain = tmp_path / "plain"  # no split measured: no such panels
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    assert cli.main(["report", str(plain)]) == 0
    assert "Gradient noise by prompt" not in (plain / "report" / "report.html").read_text()
