"""The engines' MoE routes in the batch (``algo.router_replay: rollout``).

vLLM returns, per sample, the experts every token it fed through the model was sent to:
``routed_experts`` (rows, layers, top-k) with rows = prompt + response − 1 (the last sampled
token is never fed), layers = every decoder layer of the HF model (global index; a dense layer's
rows are meaningless and never read) and expert ids logical and global (before vLLM's EPLB
mapping). A batch row is ``prompt ⊕ response`` from column 0 (``megarl.rollout.sampling``), so
row r of a sample's routes belongs at column r: :func:`place_routes` writes them there, -1
beyond (padding, and the last token: such tokens route live in the trainer and are not
counted). ``RolloutBatch.routes`` is then cut with the tokens everywhere after.
"""

from __future__ import annotations

import torch

from megarl.errors import RolloutError


def place_routes(routes: list[torch.Tensor], lengths: list[int], S: int) -> torch.Tensor:
    """Samples' engine routes ``routes[b]`` (rows_b, L, k) → (B, S, L, k) int16, row b's at
    columns [0, rows_b), -1 elsewhere; ``lengths[b]``: the sample's prompt + response tokens
    (its routes may not cover more)."""
    if not routes:
        raise RolloutError("no samples to place routes for")
    shapes = {tuple(r.shape[1:]) for r in routes}
    if len(shapes) != 1:
        raise RolloutError(f"engine routes differ in (layers, top-k) across samples: {sorted(shapes)}")
    (Lk,) = shapes
    out = torch.full((len(routes), S, *Lk), -1, dtype=torch.int16)
    for b, (r, n) in enumerate(zip(routes, lengths, strict=True)):
        if r.shape[0] > n:
            raise RolloutError(f"sample {b}: the engine returned routes for {r.shape[0]} tokens, it has {n}")
        out[b, : r.shape[0]] = r.to(torch.int16)
    return out
