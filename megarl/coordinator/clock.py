"""A virtual clock: what an RL step's phases would cost on a GPU fleet, as a function of its batch.

The time-to-target benchmark (#45) learns for real on this CPU but charges each step the time a
cost model gives, so that the coordinator's batch choice is judged where a larger batch is
cheaper per sample (bandwidth-bound decoding), as on GPUs — on this CPU step time is nearly
linear in the batch. The model and its public sources live in one file
(``benchmarks/ttt/clocks.toml``, whose header states every formula); this module evaluates it.
Pure Python: no torch, no process groups; the same (file, clock, batch, step) gives the same times.

Generation is simulated decode step by decode step on each engine (continuous batching): the
running sequences decode one token per step, a finished one frees its slot for the next queued
sequence, whose prefill is charged to that step. A step costs

    max((weights + Σ running contexts · KV bytes per token) / (HBM B/s · decode_bw_eff),
        2 · params · running / (peak · forward_mfu)) + decode_step_overhead_s,

the roofline of one forward over the running batch plus the engine's fixed per-step work.
Responses' lengths are drawn from the clock's log-normal with a generator seeded by the step,
so two runs that train the same batch at the same step are charged the same time, and a fixed
setting can be re-costed afterwards from its recorded batches.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

ENV = "MEGARL_VIRTUAL_CLOCK"
"""``PATH#CLOCK`` (e.g. ``benchmarks/ttt/clocks.toml#gpu-mid``): the run charges each step this
clock's time — the coordinator sees its phase times, and ``vclock/step_s`` is logged (benchmarks)."""

JITTER = 0.05
"""Log-normal spread of the phase times the coordinator is shown (σ of their logarithm)."""

PHASES = ("generate", "logprobs", "update", "other")

_REQUIRED = (
    "params layers kv_heads head_dim bytes_per_value engines gpus_per_engine train_gpus max_num_seqs "
    "prompt_tokens response_median response_sigma response_max decode_bw_eff decode_step_overhead_s "
    "forward_mfu train_mfu epochs logprob_forwards train_fixed_s logprob_fixed_s sync_fixed_s "
    "sync_bytes_per_s step_fixed_s"
).split()


@dataclass(frozen=True)
class Clock:
    """One ``[clock.NAME]`` of a clocks file, with its hardware."""

    name: str
    p: dict[str, float]
    hw: dict[str, float]
    sha256: str
    """Of the whole file: results carry it, so a changed model is a new clock."""

    @classmethod
    def load(cls, path: str | Path, name: str) -> Clock:
        raw = Path(path).read_bytes()
        doc = tomllib.loads(raw.decode())
        clocks = doc.get("clock", {})
        if name not in clocks:
            raise ValueError(f"{path}: no [clock.{name}] (has {sorted(clocks)})")
        p = dict(clocks[name])
        hw_name = p.pop("hardware")
        missing = [k for k in _REQUIRED if k not in p]
        if missing:
            raise ValueError(f"{path}: [clock.{name}] lacks {missing}")
        bad = [k for k in _REQUIRED if not (isinstance(p[k], (int, float)) and p[k] >= 0)]
        if bad:
            raise ValueError(f"{path}: [clock.{name}] {bad} must be numbers >= 0")
        hw = dict(doc["hardware"][hw_name])
        return cls(name, {k: float(v) for k, v in p.items()}, {k: float(v) for k, v in hw.items()},
                   hashlib.sha256(raw).hexdigest())  # fmt: skip

    # -- the model's pieces ---------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        return self.p["params"] * self.p["bytes_per_value"]

    @property
    def kv_bytes_per_token(self) -> float:
        p = self.p
        return 2 * p["layers"] * p["kv_heads"] * p["head_dim"] * p["bytes_per_value"]

    def slots(self) -> int:
        """Sequences one engine runs at once: vLLM's max_num_seqs, or fewer when the KV cache
        (the GPU memory vLLM takes, less the weights) holds fewer of prompt + mean response
        (vLLM allocates KV as sequences grow; preemption when the tail outgrows it is not
        modelled)."""
        p, hw = self.p, self.hw
        per_engine = hw["hbm_bytes"] * hw["memory_fraction"] * p["gpus_per_engine"] - self.weight_bytes
        mean = self.mean_response()
        kv_tokens = per_engine / self.kv_bytes_per_token
        return max(1, min(int(p["max_num_seqs"]), int(kv_tokens // (p["prompt_tokens"] + mean))))

    def mean_response(self) -> float:
        """Mean of the clipped log-normal response length (numerically, fixed grid)."""
        p = self.p
        mu, s = math.log(p["response_median"]), p["response_sigma"]
        n, normal = 2000, NormalDist()
        total = 0.0
        for i in range(n):  # midpoint quantiles of the normal
            z = normal.inv_cdf((i + 0.5) / n)
            total += min(max(math.exp(mu + s * z), 1.0), p["response_max"])
        return total / n

    def lengths(self, responses: int, step: int) -> list[int]:
        """The step's response lengths (seeded by the clock and the step)."""
        p = self.p
        rng = random.Random(f"{self.name}:{step}")
        mu, s = math.log(p["response_median"]), p["response_sigma"]
        return [int(min(max(round(math.exp(rng.gauss(mu, s))), 1), p["response_max"])) for _ in range(responses)]

    def engine_s(self, lengths: list[int]) -> float:
        """One engine's time to generate responses of ``lengths`` (FIFO, continuous batching).

        Event-driven: between two events (a sequence ends, freeing its slot for the next one) the
        running set is fixed, so over those k steps the context grows by ``running`` tokens a
        step and the steps' memory term is linear in the step — summed in closed form against
        the constant compute term (the max of the two)."""
        p, hw = self.p, self.hw
        tp = p["gpus_per_engine"]
        bw = hw["hbm_bytes_per_s"] * tp * p["decode_bw_eff"]
        flops = hw["peak_flops"] * tp * p["forward_mfu"]
        prompt, kvb, slots = p["prompt_tokens"], self.kv_bytes_per_token, self.slots()
        queue = list(reversed(lengths))  # pop() takes the next in order
        running: list[tuple[int, int]] = []  # heap of (finishing step, length)
        step, context, total = 0, 0.0, 0.0
        while queue or running:
            admitted = 0
            while queue and len(running) < slots:
                n = queue.pop()
                heapq.heappush(running, (step + n, n))
                context += prompt
                admitted += 1
            n_run = len(running)
            k = running[0][0] - step  # steps until the next sequence ends (>= 1)
            a = (self.weight_bytes + context * kvb) / bw  # memory time of this event's first step
            b = n_run * kvb / bw  # its growth per step
            c = 2 * p["params"] * n_run / flops  # compute time of every step here
            j0 = min(k, max(0, math.ceil((c - a) / b))) if b > 0 else (k if a < c else 0)
            total += j0 * c + (k - j0) * a + b * (k * (k - 1) - j0 * (j0 - 1)) / 2
            total += k * p["decode_step_overhead_s"] + 2 * p["params"] * admitted * prompt / flops
            step += k
            context += k * n_run
            while running and running[0][0] == step:
                _, n = heapq.heappop(running)
                context -= prompt + n
        return total

    def phase_times(self, responses: int, step: int) -> dict[str, float]:
        """Seconds of each phase (``generate``, ``logprobs``, ``update``, ``other``) of a step that
        trains ``responses`` responses, and the fixed parts of update and log-probs."""
        p, hw = self.p, self.hw
        lengths = self.lengths(responses, step)
        engines = int(p["engines"])
        generate = max(self.engine_s(lengths[e::engines]) for e in range(engines)) if responses else 0.0
        tokens = responses * p["prompt_tokens"] + sum(lengths)
        peak = hw["peak_flops"] * p["train_gpus"]
        update = 6 * p["params"] * tokens * p["epochs"] / (peak * p["train_mfu"]) + p["train_fixed_s"]
        logprobs = p["logprob_forwards"] * 2 * p["params"] * tokens / (peak * p["forward_mfu"]) + p["logprob_fixed_s"]
        other = self.weight_bytes / p["sync_bytes_per_s"] + p["sync_fixed_s"] + p["step_fixed_s"]
        return {"generate": generate, "logprobs": logprobs, "update": update, "other": other,
                "update_fixed": p["train_fixed_s"], "logprobs_fixed": p["logprob_fixed_s"]}  # fmt: skip

    def shown(self, times: dict[str, float], step: int) -> dict[str, float]:
        """``times`` as the coordinator sees them: each phase × exp(JITTER · z), z seeded by the
        step and the phase (the fixed parts scaled with their phase)."""
        out = dict(times)
        for phase in PHASES:
            z = random.Random(f"jitter:{self.name}:{step}:{phase}").gauss(0.0, 1.0)
            f = math.exp(JITTER * z)
            out[phase] = times[phase] * f
            if f"{phase}_fixed" in times:
                out[f"{phase}_fixed"] = times[f"{phase}_fixed"] * f
        return out


def from_env() -> Clock | None:
    """The clock :data:`ENV` names, or None when it is unset."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    path, sep, name = spec.rpartition("#")
    if not sep or not path:
        raise ValueError(f"{ENV}={spec!r}: expected PATH#CLOCK, e.g. benchmarks/ttt/clocks.toml#gpu-mid")
    return Clock.load(path, name)
