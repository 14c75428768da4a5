"""Typed records that flow between the phases of one RL step, and inside the update (phase 4):
the rows it trains on and the loss terms its loss functions report.

Token layout is the one of ``megarl.model.forward``: per-token tensors are (B, S) and
position t refers to the prediction of ``tokens[:, t+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass
class Turn:
    """One turn of an episode: the engine's generated ids and the observation ids after them
    (``megarl.rollout.episode``; agent sessions record the same, ``megarl.rewards.agent_session``)."""

    ids: list[int]
    """The engine's generated ids of this turn (its stop token included when it stopped on one)."""
    logprobs: list[float]
    """The engine's log-prob of each generated id (empty when not asked for)."""
    truncated: bool = False
    """The turn hit its token limit (``finish_reason == "length"``)."""
    observation: list[int] = field(default_factory=list)
    """Ids appended after the turn: the environment's answer and the next turn's opening."""


@dataclass
class RolloutBatch:
    """One step's samples, identical on every trainer rank after broadcast."""

    tokens: torch.Tensor  # (B, S) long, prompt + response, right-padded with pad id
    mask: torch.Tensor  # (B, S) float, 1 where tokens[t+1] is a response token
    engine_logprobs: torch.Tensor | None  # (B, S) float, log π_engine(tokens[t+1]) at masked positions
    """None on steps that did not ask the engines (``rollout.engine_logprobs_every``)."""
    rewards: torch.Tensor  # (B,) float, scalar reward per response
    group_ids: torch.Tensor  # (B,) long, prompt index: samples of one prompt share it
    response_lens: torch.Tensor  # (B,) long, response tokens incl. EOS
    truncated: torch.Tensor  # (B,) bool, hit max_response_len without EOS
    version: int
    """Policy version of the weights that sampled this batch (the oldest, if its samples differ)."""
    texts: list[str] = field(default_factory=list)
    """Decoded responses (rank 0 only; for logs)."""
    versions: torch.Tensor | None = None  # (B,) long, policy version that sampled each response
    """None: every response was sampled by ``version``."""
    turn_rewards: torch.Tensor | None = None  # (B, S) float, each reward where the token that earned it is predicted
    """Multi-turn episodes: an environment's step reward at its turn's last generated token, the
    rest of the episode's reward at its last one (each row sums to ``rewards``); None: each
    row's reward at its last response token."""
    routes: torch.Tensor | None = None  # (B, S, L, k) int16, the engine's experts of tokens[b, t]
    """MoE routing replay from the engines (``algo.router_replay: rollout``): every decoder
    layer's top-k experts (global ids) per token as vLLM routed it, -1 where it did not
    (padding, a row's last token); ``megarl.rollout.routes``. None otherwise."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def sample_versions(self) -> torch.Tensor:  # (B,) long
        return self.versions if self.versions is not None else torch.full((self.size,), self.version)

    def rows(self, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        out = {"tokens": self.tokens[index], "mask": self.mask[index]}
        if self.engine_logprobs is not None:
            out["engine_logprobs"] = self.engine_logprobs[index]
        return out


@dataclass
class PolicyEval:
    """Phase 2's forward-only passes over a rollout (each present only when the step needs it)."""

    old_logprobs: torch.Tensor | None = None  # (B, S) log π_old(a_t|s_t), the trainer's actor before the update
    ref_logprobs: torch.Tensor | None = None  # (B, S) log π_ref(a_t|s_t), the frozen reference
    old_values: torch.Tensor | None = None  # (B, S) V_old(s_t), the critic before the update
    routes: torch.Tensor | None = None  # (B, S, L, k) int, the experts π_old sent each token to
    """MoE routing replay: this rank's pipeline stage's L MoE layers, -1 where not recorded
    (``megarl.model.routes``); ``algo.router_replay: trainer`` records them in the old forward,
    ``rollout`` takes them from the engines (the old forward replays them too)."""
    route_mismatch: dict[str, float] = field(default_factory=dict)
    """``rollout``: ``moe/engine_route_mismatch*``, the old forward's live experts vs the engines'."""


@dataclass
class Advantages:
    """Phase 3's output: what the update trains on."""

    adv: torch.Tensor  # (B, S) per-token advantages, or (B,) per-sequence (broadcast over the mask)
    mask: torch.Tensor  # (B, S) response tokens that count (overlong-filtered rows zeroed)
    returns: torch.Tensor | None = None  # (B, S) value targets (critic), None without a critic


@dataclass
class UpdateRows:
    """The rows phase 4 trains on: one rollout's tokens, its advantages and phase 2's passes.

    The update cuts them by row — mini-batches, each DP rank's share, micro-batches — with
    :meth:`select` and :meth:`narrow` (``megarl.model.rows.RowRecord``); every field is cut
    alike, so row i of each tensor always belongs to the same sample. Optional fields are
    None when the step did not compute them (and stay None through every cut)."""

    tokens: torch.Tensor  # (n, S) long, prompt + response, right-padded
    mask: torch.Tensor  # (n, S) float, response tokens that count (``Advantages.mask``)
    adv: torch.Tensor  # (n, S) per-token advantages, or (n,) per-sequence (broadcast over the mask)
    returns: torch.Tensor | None = None  # (n, S) value targets; with a critic
    old_logprobs: torch.Tensor | None = None  # (n, S) log π_old(a_t|s_t); when phase 2 computed it
    ref_logprobs: torch.Tensor | None = None  # (n, S) log π_ref(a_t|s_t); with a KL term
    old_values: torch.Tensor | None = None  # (n, S) V_old(s_t); with a critic
    engine_logprobs: torch.Tensor | None = None  # (n, S) log π_engine(a_t|s_t); steps that asked the engines
    routes: torch.Tensor | None = None  # (n, S, L, k) int, π_old's experts per token, replayed; with R3

    @classmethod
    def of(cls, batch: RolloutBatch, adv: Advantages, ev: PolicyEval) -> UpdateRows:
        return cls(
            tokens=batch.tokens,
            mask=adv.mask,
            adv=adv.adv,
            returns=adv.returns,
            old_logprobs=ev.old_logprobs,
            ref_logprobs=ev.ref_logprobs,
            old_values=ev.old_values,
            engine_logprobs=batch.engine_logprobs,
            routes=ev.routes,
        )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, index: slice | torch.Tensor) -> UpdateRows:
        """The rows ``index`` (a slice or a (k,) long tensor of row indices) of every field."""
        return replace(self, **{name: v[index] for name, v in self._present()})

    def narrow(self, width: int) -> UpdateRows:
        """Per-token fields cut to their first ``width`` columns; per-row (n,) fields kept."""
        return replace(self, **{name: v[:, :width] for name, v in self._present() if v.dim() >= 2})

    def _present(self) -> list[tuple[str, torch.Tensor]]:
        return [(f.name, v) for f in fields(self) if (v := getattr(self, f.name)) is not None]

    def critic_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(old_values, returns): what the value loss needs, present whenever there is a critic."""
        if self.old_values is None or self.returns is None:
            raise ValueError(
                "the critic's update needs old_values (phase 2) and returns (phase 3); "
                f"got old_values={'set' if self.old_values is not None else None}, "
                f"returns={'set' if self.returns is not None else None}"
            )
        return self.old_values, self.returns


def maximum() -> Any:
    """A :class:`LossTerms` field that reduces by its maximum (over micro-batches, DP ranks and
    a step's updates); every other term is a sum."""
    return field(default=None, metadata={"reduce": "max"})


@dataclass
class LossTerms:
    """What a loss function reports about one micro-batch besides the loss it returns.

    Each term is a SUM over the micro-batch's response tokens — so it reduces exactly over any
    split of the rows and the step's per-token mean is Σ term / Σ tokens — except the fields
    declared with :func:`maximum`. ``megarl.model.train.train_step`` reduces the terms of every
    micro-batch and DP rank into the update's (the same record, each term then a () float64
    tensor); :class:`LossStats` folds a step's updates. None: not computed this step."""

    loss: torch.Tensor  # () the loss already divided by its global denominator (sums to the update's)
    tokens: torch.Tensor  # () response tokens (mask sum) the sums run over

    def present(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(field name, value, reduces by maximum) of every computed field, in field order."""
        out = [(f.name, getattr(self, f.name), f.metadata.get("reduce") == "max") for f in fields(self)]
        return [(name, v, is_max) for name, v, is_max in out if v is not None]

    def extra(self) -> list[tuple[str, torch.Tensor, bool]]:
        """:meth:`present` without ``loss`` and ``tokens`` (the subclass's own terms)."""
        return self.present()[len(fields(LossTerms)) :]


@dataclass
class PolicyTerms(LossTerms):
    """The policy loss's terms; each field name is its logged metric (``train/<name>``)."""

    clipfrac: torch.Tensor  # () Σ over tokens of the clipped fraction (its per-token mean is logged)
    engine_logprob_absdiff: torch.Tensor | None = None  # () Σ |log π_train − log π_engine|; steps with engine log-probs
    engine_prob_ratio_max: torch.Tensor | None = maximum()  # () max π_train/π_engine over tokens; as above
    entropy: torch.Tensor | None = None  # () Σ entropy; with algo.entropy_coef > 0
    kl: torch.Tensor | None = None  # () Σ KL(π‖π_ref) estimate; with algo.kl_mode loss
    old_kl_k3: torch.Tensor | None = None  # () Σ k3 estimate of KL(π_old‖π_θ); when phase 2 took π_old


@dataclass
class ValueTerms(LossTerms):
    """The value loss's terms; each field name is its logged metric (``critic/<name>``)."""

    value_mean: torch.Tensor  # () Σ V(s_t) over tokens
    value_mse: torch.Tensor  # () Σ (V(s_t) − R_t)² over tokens


@dataclass
class LossStats:
    """One model's loss statistics over a step's updates, reduced exactly: ``sums`` add up over
    micro-batches, DP ranks and updates; ``maxima`` take the maximum (by :class:`LossTerms`
    field name, which is the metric's)."""

    loss: float = 0.0  # sum over updates of each update's (globally normalised) loss
    grad_norm: float = 0.0  # sum over updates of the global gradient norm
    tokens: float = 0.0  # response tokens the sums are over
    updates: int = 0
    sums: dict[str, float] = field(default_factory=dict)  # e.g. clipfrac, kl, entropy (× tokens)
    maxima: dict[str, float] = field(default_factory=dict)  # e.g. engine_prob_ratio_max

    def add(self, terms: LossTerms, grad_norm: float) -> None:
        """Fold one update's reduced terms (``train_step``'s) in."""
        self.updates += 1
        self.grad_norm += grad_norm
        self.loss += float(terms.loss)
        self.tokens += float(terms.tokens)
        for name, v, is_max in terms.extra():
            if is_max:
                self.maxima[name] = max(self.maxima.get(name, -float("inf")), float(v))
            else:
                self.sums[name] = self.sums.get(name, 0.0) + float(v)

    def means(self) -> dict[str, float]:
        """Per-token means of the sums, per-update means of loss and grad norm, and the maxima."""
        n, tok = max(self.updates, 1), max(self.tokens, 1.0)
        out = {"loss": self.loss / n, "grad_norm": self.grad_norm / n}
        out.update({k: v / tok for k, v in self.sums.items()})
        out.update(self.maxima)
        return out
