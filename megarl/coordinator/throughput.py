"""Online models of step time as a function of the rollout batch, for goodput planning.

Each phase is modelled as affine in the batch B (responses per step):

    t(B) = alpha + beta·B        [seconds]

alpha is the fixed cost (weight sync, latency of the longest sequence, kernel launches),
beta the marginal cost per response. This is the throughput model Pollux fits (Qiao et al., OSDI'21,
§3.2, without its sync-overlap term). Each batch size keeps its own last `window` times, and
the coefficients come from least squares over the batch sizes seen, each at its mean time
t̄_B with weight n_B (its number of kept times — the same fit as over the raw points),
constrained to alpha >= 0 and beta >= 0 (time never falls as the batch grows):

    beta = Σn(B-B̄)(t̄_B-t̄)/Σn(B-B̄)²,  alpha = t̄ - beta·B̄;   if beta < 0: beta = 0, alpha = t̄;
    if alpha < 0: alpha = 0, beta = Σn·B·t̄_B/Σn·B².

Why per batch size: with one sliding window over steps, 32 steps at one batch erase every
other batch from the fit, which then rests on its prior or on two neighbouring batches whose
noisy times give any slope — the old demo's 512 → 1024 → 512 flips and a run that went back
to 1024 each time it had forgotten that 1024 was slow. Kept per size, a batch once measured
stays measured (its times refresh whenever it is used again).

Prior with fewer than 2 distinct B values (the batch has never changed): the mean time t̄ at
the one batch B̄ is split into a fixed part f: alpha = f·t̄, beta = (1-f)·t̄/B̄. This prior is
what makes the first batch change possible at all; once the batch has changed, the fit takes
over. f is measured where the phase can tell: a phase made of micro-batches (the log-prob
forwards, the update) reports with each time the seconds it spent outside its micro-batch
work (optimizer step, pipeline fill and drain, bookkeeping), whose share of the time is the
fixed fraction at that batch (the mean over the last `window` steps). Elsewhere (generation)
f is `prior_fixed_fraction`. The measured share matters: on a CPU the update is ~all
micro-batch work, and a 30 % prior called a third of it fixed, which made 2× the batch look
~15 % cheaper per response than it was — the demo's one excursion 512 → 1024 → 512 (session 18).

Eras. Times of a batch size measured long ago compare with today's only if the machine still
runs at the speed it ran then. On a shared machine it does not (this project's CPUs: the same
demo step took 0.5 s, then 1.4 s, within one run), and a fit of a fast era's size against a slow
era's swings between "all fixed cost" and "all marginal": it moved the demo's batch 512 ↔ 1024
three times in one run. So each new time is tested against its size's kept times
(`LinearTimeModel.era_changed`): when the mean of the last ``ERA_RECENT`` moved by more than
``ERA_Z`` standard errors and by more than ``ERA_REL`` relative, a new era began. The times of
every other size, and this size's from before (the latest ones nearer the old mean included),
are then dropped. A change of the machine's
speed scales alpha and beta alike and leaves alpha/beta — the shape the goodput optimum
B* = √(alpha·B_noise/beta) depends on — unchanged, so until a second size is measured in the new
era the model keeps the shape of its last fit over two or more sizes (instead of the prior),
at the current size's new time.

Invariants: pure Python, deterministic; `state_dict()` holds only JSON types and restores an
identical model.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

ERA_RECENT = 3
"""Times a change of era is judged on (the size's latest)."""
ERA_Z = 4.0
"""How many standard errors the latest times' mean must move from the earlier kept times' mean."""
ERA_REL = 0.15
"""And by how much relative to it: a GPU's 1 % jitter shifting significantly is not a new era."""


class LinearTimeModel:
    """Least squares t(B) = alpha + beta·B over per-batch-size mean times, with a prior for one size."""

    def __init__(self, *, window: int = 32, prior_fixed_fraction: float = 0.3):
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 observations")
        if not 0.0 <= prior_fixed_fraction < 1.0:
            raise ValueError(f"prior_fixed_fraction={prior_fixed_fraction} must be in [0, 1)")
        self.window = window
        self.prior_fixed_fraction = prior_fixed_fraction
        self._obs: dict[float, deque[float]] = {}
        self._shape: float | None = None
        """alpha/beta of the last fit over two or more sizes (inf: no marginal cost)."""
        self._fixed: deque[float] = deque(maxlen=window)
        """Measured fixed shares of the phase's time (`observe`'s fixed_s / seconds)."""
        self.eras = 0
        """Changes of era seen (`era_changed`)."""
        self._coef: tuple[float, float] | None = None

    def observe(self, b: float, seconds: float, fixed_s: float | None = None) -> None:
        """Record that a phase with batch b took `seconds`, `fixed_s` of them (when measured)
        outside its per-sample work."""
        if not b > 0:
            raise ValueError(f"batch b={b} must be > 0")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds={seconds} must be finite and >= 0")
        if fixed_s is not None and not (fixed_s >= 0 and math.isfinite(fixed_s)):
            raise ValueError(f"fixed_s={fixed_s} must be finite and >= 0")
        if fixed_s is not None and seconds > 0:  # clocks read apart: a share above 1 is 1
            self._fixed.append(min(1.0, fixed_s / seconds))
        b = float(b)
        times = self._obs.setdefault(b, deque(maxlen=self.window))
        times.append(float(seconds))
        means = self.era_changed(times)
        if means is not None:  # keep the latest times nearer the new mean than the old one
            m0, m1 = means
            new = [t for t in list(times)[-ERA_RECENT:] if abs(t - m1) < abs(t - m0)] or [times[-1]]
            self._obs = {b: deque(new, maxlen=self.window)}
            self.eras += 1
        self._coef = self._fit()

    @staticmethod
    def era_changed(times: deque[float]) -> tuple[float, float] | None:
        """(old mean, new mean) if the mean of the last ERA_RECENT ``times`` differs from the
        mean of the others (at least 2·ERA_RECENT of them) by more than ERA_Z standard errors
        (their spread) and by more than ERA_REL of it; else None."""
        k = ERA_RECENT
        if len(times) < 3 * k:
            return None
        ts = list(times)
        before, recent = ts[:-k], ts[-k:]
        m0, m1 = sum(before) / len(before), sum(recent) / k
        var = sum((t - m0) ** 2 for t in before) / (len(before) - 1)
        se = math.sqrt(var * (1 / k + 1 / len(before)))
        return (m0, m1) if abs(m1 - m0) > max(ERA_Z * se, ERA_REL * m0) else None

    @property
    def ready(self) -> bool:
        """True once at least one observation exists (predictions need one)."""
        return self._coef is not None

    @property
    def num_distinct_batches(self) -> int:
        """Distinct B values measured (>= 2 means a real fit, else the prior)."""
        return len(self._obs)

    def _fit(self) -> tuple[float, float] | None:
        if not self._obs:
            return None
        pts = [(b, len(ts), sum(ts) / len(ts)) for b, ts in self._obs.items()]  # (B, n_B, t̄_B)
        n = sum(w for _, w, _ in pts)
        b_mean = sum(w * b for b, w, _ in pts) / n
        t_mean = sum(w * t for _, w, t in pts) / n
        if len(pts) < 2:  # the last fit's shape (one era ago, or before the batch changed), else the prior
            shape = self._shape
            f = self.fixed_fraction if shape is None else (1.0 if math.isinf(shape) else shape / (shape + b_mean))
            return f * t_mean, (1.0 - f) * t_mean / b_mean
        sxx = sum(w * (b - b_mean) ** 2 for b, w, _ in pts)
        sxy = sum(w * (b - b_mean) * (t - t_mean) for b, w, t in pts)
        beta = sxy / sxx
        alpha = t_mean - beta * b_mean
        if beta < 0.0:
            alpha, beta = t_mean, 0.0
        elif alpha < 0.0:
            alpha, beta = 0.0, sum(w * b * t for b, w, t in pts) / sum(w * b * b for b, w, _ in pts)
        self._shape = alpha / beta if beta > 0 else math.inf
        return alpha, beta

    @property
    def fixed_fraction(self) -> float:
        """The prior's fixed share of the time at one size: measured (mean of the last `window`
        shares `observe` was given), else `prior_fixed_fraction`."""
        return sum(self._fixed) / len(self._fixed) if self._fixed else self.prior_fixed_fraction

    def coefficients(self) -> tuple[float, float]:
        """(alpha seconds, beta seconds per sample); raises before the first observation."""
        if self._coef is None:
            raise ValueError("LinearTimeModel has no observations yet; call observe() first")
        return self._coef

    def predict(self, b: float) -> float:
        """Predicted seconds for batch b."""
        alpha, beta = self.coefficients()
        return alpha + beta * b

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "window": self.window,
            "prior_fixed_fraction": self.prior_fixed_fraction,
            "obs": [[b, list(ts)] for b, ts in self._obs.items()],  # insertion order: an identical fit
            "shape": "inf" if self._shape == math.inf else self._shape,  # strict JSON has no Infinity
            "eras": self.eras,
            "fixed": list(self._fixed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (window and prior come from the state)."""
        self.window = int(state["window"])
        self.prior_fixed_fraction = float(state["prior_fixed_fraction"])
        self._obs = {float(b): deque((float(t) for t in ts), maxlen=self.window) for b, ts in state["obs"]}
        shape = state.get("shape")  # absent in states saved before eras: no shape kept
        self.eras = int(state.get("eras", 0))
        self._shape = None if shape is None else float(shape)
        self._fixed = deque((float(f) for f in state.get("fixed", ())), maxlen=self.window)  # absent before session 19
        self._coef = self._fit()


class Ema:
    """Bias-corrected EMA of a scalar (raw/(1-beta^t)); `value` is None before any update."""

    def __init__(self, beta: float):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"ema beta={beta} must be in [0, 1)")
        self.beta = beta
        self.raw = 0.0
        self.steps = 0

    def update(self, x: float) -> None:
        """Add one value."""
        self.raw = self.beta * self.raw + (1.0 - self.beta) * x
        self.steps += 1

    @property
    def value(self) -> float | None:
        """Bias-corrected average (None before the first update)."""
        if self.steps == 0:
            return None
        return self.raw / (1.0 - self.beta**self.steps)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"beta": self.beta, "raw": self.raw, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.beta = float(state["beta"])
        self.raw = float(state["raw"])
        self.steps = int(state["steps"])


class StepTimeModel:
    """Step time t(B) = t_generate(B) + t_logprobs(B) + t_train(B) + t_other, B in responses.

    `generate`, `logprobs` (the old-policy / reference / value forward passes over the whole
    rollout, linear in B like training) and `train` are `LinearTimeModel`s over responses;
    `other` (scoring, advantages, weight sync) is a bias-corrected EMA, treated as
    batch-independent. Counting the log-prob phase as constant would make large batches look
    cheaper per response than they are and bias the goodput argmax high (for t = α + β·B,
    B* = √(α·B_noise/β): moving a linear cost into α raises α and lowers β). Tokens per response are tracked to report generation
    tokens/s and to convert a token-unit noise scale to responses.
    """

    def __init__(self, *, window: int = 32, prior_fixed_fraction: float = 0.3, ema_beta: float = 0.9):
        self.generate = LinearTimeModel(window=window, prior_fixed_fraction=prior_fixed_fraction)
        self.logprobs = LinearTimeModel(window=window, prior_fixed_fraction=prior_fixed_fraction)
        self.train = LinearTimeModel(window=window, prior_fixed_fraction=prior_fixed_fraction)
        self._other = Ema(ema_beta)
        self._tokens_per_response = Ema(ema_beta)

    def observe(
        self,
        *,
        responses: int,
        tokens: int,
        generate_s: float,
        train_s: float,
        other_s: float,
        logprobs_s: float = 0.0,
        train_fixed_s: float | None = None,
        logprobs_fixed_s: float | None = None,
    ) -> None:
        """Record one step's phase times for a rollout of `responses` responses (``*_fixed_s``:
        the part of a phase outside its micro-batch work, when measured)."""
        if responses <= 0:
            raise ValueError(f"rollout_responses={responses} must be > 0")
        if tokens < 0:
            raise ValueError(f"rollout_tokens={tokens} must be >= 0")
        if not other_s >= 0:
            raise ValueError(f"other_s={other_s} must be >= 0")
        self.generate.observe(responses, generate_s)
        self.logprobs.observe(responses, logprobs_s, logprobs_fixed_s)
        self.train.observe(responses, train_s, train_fixed_s)
        self._other.update(other_s)
        self._tokens_per_response.update(tokens / responses)

    @property
    def ready(self) -> bool:
        """True once a step was observed."""
        return self.generate.ready and self.train.ready

    @property
    def eras(self) -> int:
        """Changes of the machine's speed seen, over the phases (`LinearTimeModel.era_changed`)."""
        return self.generate.eras + self.logprobs.eras + self.train.eras

    @property
    def tokens_per_response(self) -> float | None:
        """Smoothed generated tokens per response (None before the first step)."""
        return self._tokens_per_response.value

    def predict(self, b: float) -> float:
        """Predicted seconds per step with b responses."""
        other = self._other.value or 0.0
        return self.generate.predict(b) + self.logprobs.predict(b) + self.train.predict(b) + other

    def throughput(self, b: float) -> float:
        """Predicted responses per second at batch b."""
        return b / self.predict(b)

    def generation_tokens_per_s(self, b: float) -> float:
        """Predicted generated tokens per second of generation time at batch b."""
        tpr = self.tokens_per_response or 0.0
        t = self.generate.predict(b)
        return b * tpr / t if t > 0 else math.inf

    def train_s_per_sample(self, b: float) -> float:
        """Predicted training seconds per response at batch b."""
        return self.train.predict(b) / b

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "generate": self.generate.state_dict(),
            "logprobs": self.logprobs.state_dict(),
            "train": self.train.state_dict(),
            "other": self._other.state_dict(),
            "tokens_per_response": self._tokens_per_response.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.generate.load_state_dict(state["generate"])
        self.logprobs.load_state_dict(state["logprobs"])
        self.train.load_state_dict(state["train"])
        self._other.load_state_dict(state["other"])
        self._tokens_per_response.load_state_dict(state["tokens_per_response"])
