"""The sampling seeds of one round: keyed by the round (``rollout.sampling_seed: round``) or by
each prompt's position in the prompt stream (``prompt``).

The engines take one seed per prompt; vLLM seeds a prompt's sample ``j`` with that seed + j
(``vllm.v1.engine.parallel_sampling.ParentRequest``), and a seeded request's tokens depend on
its seed and the logits it sees only, not on its batch (:mod:`megarl.engine.cpu_sampler`).

``round`` (the default): prompt ``i`` of the round is seeded ``s * 100_003 + i`` with
``s = train.seed + 7919 * step + round`` — two runs that take different numbers of prompts a
step give the same prompt different streams.

``prompt``: a prompt's seed is a 48-bit hash of (``train.seed``, its stream position), the
:class:`~megarl.data.prompts.PromptSampler`'s draw index over all epochs (not the step, the
round or the batch size). Two runs with the same ``train.seed`` and data draw the same prompt
at the same position, so its sample ``j`` has the same random stream in both: with the same
weights, the same tokens (coupled responses; arms of a comparison then differ by what they
learn, not by their draws). Positions are checkpointed with the sampler (exact resume).
"""

from __future__ import annotations

import numpy as np

from megarl.engine.cpu_sampler import splitmix64

POSITION_SEED_BITS = 48
"""A prompt seed's width: sample seeds ``seed + j`` and an episode's ``(seed + j) * 1009 + turn``
stay far inside the 64 bits a torch generator takes."""


def round_seed(train_seed: int, step: int, round_count: int) -> int:
    """``rollout.sampling_seed: round``: the round's seed (``round_count`` from 1)."""
    return train_seed + 7919 * step + round_count


def prompt_seeds(sampling_seed: str, train_seed: int, step: int, round_count: int, positions: list[int]) -> list[int]:
    """The per-prompt seeds of a round whose prompts sit at stream ``positions``."""
    if sampling_seed == "prompt":
        return position_seeds(train_seed, positions)
    seed = round_seed(train_seed, step, round_count)
    return [seed * 100_003 + i for i in range(len(positions))]


def position_seeds(train_seed: int, positions: list[int]) -> list[int]:
    """``prompt``: the per-prompt seed of each stream position (a hash: no two positions of a
    run share a stream but by a 2**-48 chance, and no arithmetic pattern links them)."""
    s = np.asarray([train_seed % 2**64] * len(positions), dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = splitmix64(splitmix64(s) ^ p)
    return [int(x) for x in mixed >> np.uint64(64 - POSITION_SEED_BITS)]
