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
    engine_logprobs: torch.Tensor  # (B, S) float, log π_engine(tokens[t+1]) at masked positions
    rewards: torch.Tensor  # (B,) float, scalar reward per response
    group_ids: torch.Tensor  # (B,) long, prompt index: samples of one prompt share it
    response_lens: torch.Tensor  # (B,) long, response tokens incl. EOS
    truncated: torch.Tensor  # (B,) bool, hit max_response_len without EOS
    version: int
    """Policy version of the weights that sampled this batch."""
    texts: list[str] = field(default_factory=list)
    """Decoded responses (rank 0 only; for logs)."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, index: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[index], "mask": self.mask[index], "engine_logprobs": self.engine_logprobs[index]}


@dataclass
class StepPlan:
    """What the next step does: decided by the coordinator (or fixed by config)."""

    num_prompts: int
    samples_per_prompt: int
    lr: dict[str, float]
    """Learning rate per trained model name ('actor', 'critic')."""
    dp_shares: list[float] | None = None
    """Fraction of the batch per DP rank (None = equal)."""
