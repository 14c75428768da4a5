"""Finding the LR multiplier online (`coordinator.lr_search`, docs/COORDINATOR.md §3).

The √ rule moves the LR with the batch from (b_ref, lr_ref); it cannot tell that lr_ref itself
is off. The step tells: with Δθ_t = θ_{t+1} − θ_t ∝ ε_t (SGD exactly; Adam given its moments),

    ∂L(θ_{t+1}) / ∂ log ε_t = ∇L(θ_{t+1}) · Δθ_t,

the hypergradient of Baydin et al. 2018 (arXiv 1703.04782) taken in log ε. The gradient at
θ_{t+1} is measured on the next rollout's fresh samples, so g_{t+1}·Δθ_t is an unbiased estimate
of it. On a local quadratic, E[∇L(θ_{t+1})·Δθ_t] = −E[−G·Δθ] + E[ΔθᵀHΔθ] vanishes exactly at the
step size that minimises the expected loss after the step — McCandlish et al.'s
ε_opt = |G|²/(GᵀHG + tr(HΣ)/B) for SGD, noise included — is negative below it (the loss still
falls along the step: raise ε) and positive above it (overshoot: lower ε).

The signal is the cosine cos(g_{t+1}, Δθ_t) (scale-free across batch and LR changes), and the
multiplier M follows it like Adam on one scalar: with m, v the bias-corrected EMAs of the
cosine and its square,

    log M ← clip(log M − rate · m/√v, ±log range).

m/√v is ±1 when the sign is consistent (M moves by e^rate a step) and ~0 when noise dominates,
where log M random-walks by about rate·√((1−β)/(1+β)) a step. One-step-greedy LRs shrink near
a noise floor (Wu et al. 2018, short-horizon bias); ``range`` bounds how far M can go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class LrSearch:
    """The LR multiplier of one model, driven by its step cosines."""

    rate: float = 0.1
    """Largest change of log M per step."""
    beta: float = 0.9
    """EMA decay per step of the cosine and its square."""
    range: float = 8.0
    """M stays in [1/range, range]."""
    log_mult: float = 0.0
    m: float = 0.0
    v: float = 0.0
    steps: int = 0

    def update(self, cosine: float) -> None:
        if not (math.isfinite(cosine) and -1.0 - 1e-6 <= cosine <= 1.0 + 1e-6):
            raise ValueError(f"step cosine {cosine} must be finite and in [-1, 1]")
        self.steps += 1
        self.m = self.beta * self.m + (1 - self.beta) * cosine
        self.v = self.beta * self.v + (1 - self.beta) * cosine * cosine
        if self.v <= 0:
            return  # every cosine so far exactly 0: no direction to move
        bias = 1 - self.beta**self.steps
        step = (self.m / bias) / math.sqrt(self.v / bias)
        bound = math.log(self.range)
        self.log_mult = min(bound, max(-bound, self.log_mult - self.rate * step))

    @property
    def multiplier(self) -> float:
        return math.exp(self.log_mult)

    @property
    def mean_cosine(self) -> float | None:
        """Bias-corrected EMA of the cosine (None before the first reading)."""
        return self.m / (1 - self.beta**self.steps) if self.steps else None

    def state_dict(self) -> dict[str, Any]:
        return {"log_mult": self.log_mult, "m": self.m, "v": self.v, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log_mult, self.m, self.v = float(state["log_mult"]), float(state["m"]), float(state["v"])
        self.steps = int(state["steps"])
