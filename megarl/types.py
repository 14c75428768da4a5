"""Typed records that flow between the phases of one RL step.

Token layout is the one of ``megarl.model.forward``: per-token tensors are (B, S) and
position t refers to the prediction of ``tokens[:, t+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def rows(self) -> dict[str, torch.Tensor]:
        """The present tensors by name (the loss functions' micro-batch keys)."""
        named = {"old_logprobs": self.old_logprobs, "ref_logprobs": self.ref_logprobs, "old_values": self.old_values}
        return {k: v for k, v in named.items() if v is not None}


@dataclass
class Advantages:
    """Phase 3's output: what the update trains on."""

    adv: torch.Tensor  # (B, S) per-token advantages, or (B,) per-sequence (broadcast over the mask)
    mask: torch.Tensor  # (B, S) response tokens that count (overlong-filtered rows zeroed)
    returns: torch.Tensor | None = None  # (B, S) value targets (critic), None without a critic

    def rows(self) -> dict[str, torch.Tensor]:
        out = {"adv": self.adv, "mask": self.mask}
        if self.returns is not None:
            out["returns"] = self.returns
        return out


@dataclass
class LossStats:
    """One model's loss statistics over a step's updates, reduced exactly: ``sums`` add up over
    micro-batches, DP ranks and updates; ``maxima`` take the maximum."""

    loss: float = 0.0  # sum over updates of each update's (globally normalised) loss
    grad_norm: float = 0.0  # sum over updates of the global gradient norm
    tokens: float = 0.0  # response tokens the sums are over
    updates: int = 0
    sums: dict[str, float] = field(default_factory=dict)  # e.g. clipfrac, kl, entropy (× tokens)
    maxima: dict[str, float] = field(default_factory=dict)  # e.g. engine_prob_ratio

    def add(self, stats: dict[str, float], grad_norm: float) -> None:
        """Fold one update's reduced stats (``train_step``: ``*_max`` maxima, else sums) in."""
        self.updates += 1
        self.grad_norm += grad_norm
        for k, v in stats.items():
            if k == "loss":
                self.loss += v
            elif k == "tokens":
                self.tokens += v
            elif k.endswith("_max"):
                name = k.removesuffix("_max")
                self.maxima[name] = max(self.maxima.get(name, -float("inf")), v)
            else:
                name = k.removesuffix("_sum")
                self.sums[name] = self.sums.get(name, 0.0) + v

    def means(self) -> dict[str, float]:
        """Per-token means of the sums, per-update means of loss and grad norm, and the maxima."""
        n, tok = max(self.updates, 1), max(self.tokens, 1.0)
        out = {"loss": self.loss / n, "grad_norm": self.grad_norm / n}
        out.update({k: v / tok for k, v in self.sums.items()})
        out.update({f"{k}_max": v for k, v in self.maxima.items()})
        return out
