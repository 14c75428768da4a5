"""Per-token KL estimators and KL-coefficient controllers.

Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).
Tokens are sampled from the current policy π, so KL(π || π_ref) = E_π[log π/π_ref]. With
``log_ratio = logprobs - ref_logprobs = log π(a_t|s_t) - log π_ref(a_t|s_t)``:

* ``k1 = log_ratio``                          unbiased, high variance, can be negative;
* ``k2 = 0.5 * log_ratio**2``                 biased, low variance, >= 0;
* ``k3 = exp(-log_ratio) - 1 + log_ratio``    unbiased, low variance, >= 0
  (``(q - 1) - log q`` with ``q = π_ref/π``).

``k3`` exponentiates, so its ``log_ratio`` is clamped to ``[-k3_clamp, k3_clamp]``
(default 10: one token then contributes at most ``e^10 - 11 ≈ 2.2e4``, and the value stays
finite even in half precision). Beyond the clamp the gradient is 0; a token that far from
the reference is a divergence to be seen in the metrics, not fixed by this term. The
estimate is computed in at least float32 and returned in that dtype. Outputs are per
token; masking and reduction belong to ``megarl.algo.aggregation``.

Controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
§2.2): the adaptive controller moves β towards a target KL with a clipped proportional
error ``e = clip(KL/KL_target - 1, -0.2, 0.2)`` and ``β ← β (1 + e · n_steps / horizon)``,
where ``n_steps`` is the number of samples since the last update and ``horizon`` the
number of samples over which β may change by about e^0.2. The fixed controller keeps β.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarl.algo.masked import check_same_shape

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive")


def kl_estimate(
    logprobs: torch.Tensor,  # (B, T) log π(a_t|s_t) of the sampled tokens
    ref_logprobs: torch.Tensor,  # (B, T) log π_ref(a_t|s_t) of the same tokens
    kind: str = "k3",
    *,
    k3_clamp: float = 10.0,
) -> torch.Tensor:  # (B, T) per-token estimate of KL(π || π_ref)
    """Per-token KL(π || π_ref) estimate ``k1``, ``k2`` or ``k3`` (see module docstring)."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        if k3_clamp <= 0:
            raise ValueError(f"k3_clamp={k3_clamp} must be > 0")
        lr = log_ratio.clamp(min=-k3_clamp, max=k3_clamp)
        return torch.expm1(-lr) + lr
    raise ValueError(f"unknown KL estimator kind '{kind}'; valid options: {', '.join(KL_KINDS)}")


def _read_coef(state: Mapping[str, float], owner: str) -> float:
    if set(state) != {"kl_coef"}:
        raise ValueError(f"{owner}.load_state_dict expected keys ['kl_coef'], got {sorted(state)}")
    value = float(state["kl_coef"])
    if value < 0:
        raise ValueError(f"{owner}.load_state_dict: kl_coef={value} must be >= 0")
    return value


class FixedKLController:
    """Constant KL coefficient β."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)  # β, unitless multiplier of the KL term

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; same signature as ``AdaptiveKLController.update``."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = _read_coef(state, type(self).__name__)


class AdaptiveKLController:
    """β driven towards ``target_kl`` by a clipped proportional controller (Ziegler 2019)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0")
        if target_kl <= 0:
            raise ValueError(f"target_kl={target_kl} must be > 0")
        if horizon <= 0:
            raise ValueError(f"horizon={horizon} must be > 0 (samples)")
        self.value = float(init_kl_coef)  # β, unitless multiplier of the KL term
        self.target = float(target_kl)  # target KL per sequence (nats)
        self.horizon = int(horizon)  # samples over which β adapts

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update β from the KL measured over the last ``n_steps`` samples."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = _read_coef(state, type(self).__name__)


def make_kl_controller(
    kind: str,
    *,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: int | None = None,
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by the config key ``kind`` ("fixed" or "adaptive")."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"adaptive KL controller needs target_kl and horizon, got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller '{kind}'; valid options: {', '.join(KL_CONTROLLERS)}")
