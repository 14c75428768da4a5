"""The virtual clock (``megarl.coordinator.clock``, #45) against slow obvious references: the
event-driven engine time equals a decode-step-by-step simulation; the training and log-prob
phases are their FLOP formulas; batch-dependence has the roofline's shape (cost per response
falls with the batch where decoding is memory-bound); the committed clocks file loads and is
deterministic per (batch, step); bad files are refused by name."""

import dataclasses
import math
from pathlib import Path

import pytest

from megarl.coordinator.clock import PHASES, Clock
from tests.helpers import ROOT

CLOCKS = ROOT / "benchmarks/ttt/clocks.toml"


def _stepwise_engine_s(c: Clock, lengths: list[int]) -> float:
    """One decode step at a time: FIFO admission into ``slots``, each step the roofline max plus
    the overhead plus the admitted sequences' prefill."""
    p, hw = c.p, c.hw
    bw = hw["hbm_bytes_per_s"] * p["gpus_per_engine"] * p["decode_bw_eff"]
    flops = hw["peak_flops"] * p["gpus_per_engine"] * p["forward_mfu"]
    queue, running, total, slots = list(lengths), [], 0.0, c.slots()
    while queue or running:
        admitted = 0
        while queue and len(running) < slots:
            running.append([0, queue.pop(0)])
            admitted += 1
        context = sum(p["prompt_tokens"] + g for g, _ in running)
        memory = (c.weight_bytes + context * c.kv_bytes_per_token) / bw
        compute = 2 * p["params"] * len(running) / flops
        total += max(memory, compute) + p["decode_step_overhead_s"] + 2 * p["params"] * admitted * p["prompt_tokens"] / flops
        for r in running:
            r[0] += 1
        running = [r for r in running if r[0] < r[1]]
    return total


@pytest.mark.parametrize("name", ["gpu-mid", "gpu-high"])
def test_event_driven_engine_time_equals_step_by_step(name: str) -> None:
    c = Clock.load(CLOCKS, name)
    small = dataclasses.replace(c, p={**c.p, "max_num_seqs": 7, "response_max": 300})  # queueing and the tail
    for clock in (c, small):
        for n, step in ((1, 0), (23, 1), (60, 2)):
            lengths = clock.lengths(n, step)
            assert clock.engine_s(lengths) == pytest.approx(_stepwise_engine_s(clock, lengths), rel=1e-9)


def test_compute_bound_steps_are_charged_their_flops() -> None:
    """A clock whose bandwidth is huge: every step is compute-bound (2·N·running / peak·mfu)."""
    c = Clock.load(CLOCKS, "gpu-mid")
    c = dataclasses.replace(c, hw={**c.hw, "hbm_bytes_per_s": 1e30}, p={**c.p, "decode_step_overhead_s": 0.0,
                                                                        "prompt_tokens": 0.0})  # fmt: skip
    lengths = [5, 3, 3]
    per_token = 2 * c.p["params"] / (c.hw["peak_flops"] * c.p["forward_mfu"])
    assert c.engine_s(lengths) == pytest.approx(per_token * sum(lengths), rel=1e-12)


def test_training_and_logprob_phases_are_their_flop_formulas() -> None:
    c = Clock.load(CLOCKS, "gpu-high")
    t = c.phase_times(100, 3)
    p, peak = c.p, c.hw["peak_flops"] * c.p["train_gpus"]
    tokens = 100 * p["prompt_tokens"] + sum(c.lengths(100, 3))
    assert t["update"] == pytest.approx(6 * p["params"] * tokens / (peak * p["train_mfu"]) + p["train_fixed_s"])
    assert t["logprobs"] == pytest.approx(2 * 2 * p["params"] * tokens / (peak * p["forward_mfu"]) + p["logprob_fixed_s"])
    assert t["other"] == pytest.approx(c.weight_bytes / p["sync_bytes_per_s"] + p["sync_fixed_s"] + p["step_fixed_s"])
    lengths = c.lengths(100, 3)
    assert t["generate"] == max(c.engine_s(lengths[e::8]) for e in range(8))  # the slowest of 8 engines


def test_larger_batches_are_cheaper_per_response_on_the_gpu_clocks() -> None:
    for name in ("gpu-mid", "gpu-high"):
        c = Clock.load(CLOCKS, name)
        per = [sum(c.phase_times(b, 0)[k] for k in PHASES) / b for b in (64, 256, 1024)]
        assert per[0] > per[1] > per[2], (name, per)
        gen = [sum(c.lengths(b, 0)) / c.phase_times(b, 0)["generate"] for b in (128, 1024)]
        assert gen[1] / gen[0] > 2.0, (name, gen)  # the header's figures: 4.3x and 6.1x


def test_deterministic_per_step_and_jitter_is_five_percent_lognormal() -> None:
    c = Clock.load(CLOCKS, "gpu-mid")
    assert c.phase_times(256, 7) == c.phase_times(256, 7) and c.lengths(256, 7) != c.lengths(256, 8)
    t = c.phase_times(256, 7)
    logs = [math.log(c.shown(t, s)["generate"] / t["generate"]) for s in range(2000)]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    assert abs(mean) < 0.005 and sd == pytest.approx(0.05, rel=0.06)
    shown = c.shown(t, 3)
    assert shown["update_fixed"] / t["update_fixed"] == pytest.approx(shown["update"] / t["update"])
    assert c.shown(t, 3) == c.shown(t, 3)


def test_the_committed_file_is_hashed_and_bad_files_refused(tmp_path: Path) -> None:
    import hashlib

    c = Clock.load(CLOCKS, "gpu-mid")
    assert c.sha256 == hashlib.sha256(CLOCKS.read_bytes()).hexdigest()
    assert 1 <= c.slots() <= c.p["max_num_seqs"]
    with pytest.raises(ValueError, match=r"no \[clock.gpu-low\]"):
        Clock.load(CLOCKS, "gpu-low")
    bad = tmp_path / "bad.toml"
    bad.write_text(CLOCKS.read_text().replace("train_mfu = 0.35", "train_mfu = -1", 1))
    with pytest.raises(ValueError, match=r"\['train_mfu'\] must be numbers >= 0"):
        Clock.load(bad, "gpu-mid")
    bad.write_text(CLOCKS.read_text().replace("epochs = 1\n", "", 1))
    with pytest.raises(ValueError, match=r"lacks \['epochs'\]"):
        Clock.load(bad, "gpu-mid")


def test_a_run_under_a_virtual_clock_shows_the_coordinator_its_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEGARL_VIRTUAL_CLOCK``: the planner's observe hands the coordinator the clock's phase
    times (jittered, with their fixed parts) instead of the machine's, and logs ``vclock/step_s``
    (the unjittered step); without the variable, nothing changes."""
    import torch
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.coordinator import clock as clock_mod
    from megarl.distributed import ParallelDims
    from megarl.planning import Planner, PlanSettings

    cfg = load_config(None, ["coordinator.enabled=true", "coordinator.min_prompts=4", "rollout.num_prompts=8",
                             "rollout.samples_per_prompt=16", "parallel.micro_batch_size=16"])  # fmt: skip
    machine = {"generate": 9.0, "logprobs": 2.0, "update": 5.0, "sync": 1.0}
    work = {"update": 4.0, "logprobs": 1.5}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = dist.group.WORLD
        dims = ParallelDims(1, 0, 1, 1, 1, 0, 0, 0, w, w, w, w, torch.device("cpu"), None, False)
        seen = {}
        for spec in ("", f"{CLOCKS}#gpu-mid"):
            monkeypatch.setenv(clock_mod.ENV, spec)
            planner = Planner(PlanSettings.of(cfg), dp=1, models=["actor"])
            assert planner.coord is not None
            monkeypatch.setattr(planner.coord, "observe", lambda step, grads, timings, norms, spec=spec: seen.update({spec: timings}))
            planner.observe(3, 128, 4000, machine, dims, work)
            m = planner.metrics()
            if spec:
                c = Clock.load(CLOCKS, "gpu-mid")
                virtual = c.phase_times(128, 3)
                assert m["vclock/step_s"] == pytest.approx(sum(virtual[k] for k in PHASES))
                shown = c.shown(virtual, 3)
                t = seen[spec]
                assert (t.generate_s, t.logprobs_s, t.train_s, t.other_s) == pytest.approx(
                    (shown["generate"], shown["logprobs"], shown["update"], shown["other"]))
                assert (t.train_fixed_s, t.logprobs_fixed_s) == pytest.approx((shown["update_fixed"], shown["logprobs_fixed"]))
            else:
                assert "vclock/step_s" not in m
                t = seen[spec]
                assert (t.generate_s, t.train_s, t.other_s, t.train_fixed_s) == (9.0, 5.0, 1.0, 1.0)
        monkeypatch.setenv(clock_mod.ENV, "benchmarks/ttt/clocks.toml")
        with pytest.raises(ValueError, match="expected PATH#CLOCK"):
            Planner(PlanSettings.of(cfg), dp=1, models=["actor"])
    finally:
        dist.destroy_process_group()
