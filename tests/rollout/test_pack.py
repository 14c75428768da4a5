"""Packing a round's samples into (B, S) tensors: the batched packer equals a slow row-by-row
reference on random ragged batches (empty responses included), and the flat buffer that
``broadcast_batch`` ships restores every tensor exactly."""

import random

import torch

from megarl.data.prompts import PromptRecord
from megarl.rollout.batch import batch_from_flat, batch_to_flat
from megarl.rollout.sampling import Group, pack_groups, pack_sequences


def _reference(groups: list[Group], pad_id: int) -> dict[str, torch.Tensor]:
    """The obvious loop: one row at a time."""
    rows = [(g.prompt_ids, ids, lp, tr) for g in groups for ids, lp, tr in g.samples]
    S = max(len(p) + len(r) for p, r, _, _ in rows)
    tokens = torch.full((len(rows), S), pad_id, dtype=torch.long)
    mask, elp = torch.zeros(len(rows), S), torch.zeros(len(rows), S)
    for b, (p, r, lp, _) in enumerate(rows):
        tokens[b, : len(p) + len(r)] = torch.tensor(p + r)
        for j in range(len(r)):
            mask[b, len(p) - 1 + j] = 1.0
            elp[b, len(p) - 1 + j] = lp[j]
    return {"tokens": tokens, "mask": mask, "engine_logprobs": elp}


def _groups(rng: random.Random) -> list[Group]:
    groups = []
    for _ in range(rng.randrange(1, 6)):
        prompt = [rng.randrange(300) for _ in range(rng.randrange(1, 12))]
        samples = []
        for _ in range(rng.randrange(1, 5)):
            k = rng.randrange(0, 7)
            samples.append(([rng.randrange(300) for _ in range(k)], [-rng.random() for _ in range(k)], k == 6))
        rewards = [rng.random() for _ in samples]
        groups.append(Group(PromptRecord("q", "a", "f:1"), prompt, samples, ["t"] * len(samples), rewards))
    return groups


def test_pack_groups_equals_row_by_row_reference() -> None:
    rng = random.Random(0)
    for _ in range(40):
        groups = _groups(rng)
        batch = pack_groups(groups, pad_id=7, version=3)
        for name, want in _reference(groups, pad_id=7).items():
            got = getattr(batch, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        rows = [s for g in groups for s in g.samples]
        assert batch.response_lens.tolist() == [len(ids) for ids, _, _ in rows]
        assert batch.truncated.tolist() == [tr for _, _, tr in rows]
        assert batch.group_ids.tolist() == [i for i, g in enumerate(groups) for _ in g.samples]
        assert batch.rewards.tolist() == torch.tensor([x for g in groups for x in g.rewards]).tolist()
    tokens, mask = pack_sequences([([1, 2], []), ([3], [4, 5])], pad_id=0)
    assert tokens.tolist() == [[1, 2, 0], [3, 4, 5]] and mask.tolist() == [[0, 0, 0], [1, 1, 0]]


def test_flat_buffer_restores_the_batch_exactly() -> None:
    rng = random.Random(1)
    for _ in range(10):
        batch = pack_groups(_groups(rng), pad_id=0, version=5)
        batch.tokens[0, 0] = 151_935  # a large vocabulary id survives float64
        back = batch_from_flat(batch_to_flat(batch), batch.size, batch.tokens.shape[1], 5)
        for name in ("tokens", "mask", "engine_logprobs", "rewards", "group_ids", "response_lens", "truncated"):
            got, want = getattr(back, name), getattr(batch, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert back.version == 5
        assert back.versions is not None and back.versions.tolist() == [5] * batch.size  # filled in


def test_a_batch_without_engine_logprobs_packs_and_travels_without_them() -> None:
    """A step that did not ask the engines (``rollout.engine_logprobs_every``): no log-prob
    tensor, a shorter flat buffer, every other tensor as with them."""
    rng = random.Random(2)
    for _ in range(10):
        groups = _groups(rng)
        full = pack_groups(groups, pad_id=0, version=4)
        bare = pack_groups(groups, pad_id=0, version=4, logprobs=False)
        assert bare.engine_logprobs is None and "engine_logprobs" not in bare.rows(slice(None))
        B, S = full.size, full.tokens.shape[1]
        flat = batch_to_flat(bare)
        assert flat.numel() == batch_to_flat(full).numel() - B * S
        back = batch_from_flat(flat, B, S, 4, has_logprobs=False)
        assert back.engine_logprobs is None
        for name in ("tokens", "mask", "rewards", "group_ids", "response_lens", "truncated", "versions"):
            got, want = getattr(back, name), getattr(full, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_engine_routes_sit_under_their_tokens() -> None:
    """``algo.router_replay: rollout``: each sample's engine routes (prompt + response - 1 rows,
    as vLLM returns them) land at the columns of the tokens they were routed for, -1 beyond
    (the last token, padding); here each route is a function of its token, so any shift shows."""
    rng = random.Random(2)
    L, k, E = 3, 2, 64

    def routes_of(ids: list[int]) -> torch.Tensor:  # (len - 1, L, k): every token but the last
        t = torch.tensor(ids[:-1], dtype=torch.long)[:, None, None]
        return ((t + torch.arange(L)[None, :, None] * 7 + torch.arange(k)[None, None, :]) % E).to(torch.int16)

    for _ in range(20):
        groups = _groups(rng)
        for g in groups:
            g.routes = [routes_of(g.prompt_ids + ids) for ids, _, _ in g.samples]
        batch = pack_groups(groups, pad_id=7, version=3)
        assert batch.routes is not None and batch.routes.shape == (*batch.tokens.shape, L, k)
        lengths = [len(g.prompt_ids) + len(ids) for g in groups for ids, _, _ in g.samples]
        for b, n in enumerate(lengths):
            assert torch.equal(batch.routes[b, : n - 1], routes_of(batch.tokens[b, :n].tolist()))
            assert (batch.routes[b, n - 1 :] == -1).all()
    assert pack_groups(_groups(rng), pad_id=7, version=3).routes is None  # a dense run's batch


def test_engine_routes_longer_than_the_sample_are_refused() -> None:
    import pytest

    from megarl.errors import RolloutError

    g = Group(PromptRecord("q", "a", "f:1"), [1, 2], [([3], [-0.1], False)], ["t"], [1.0])
    g.routes = [torch.zeros(4, 2, 2, dtype=torch.int16)]  # 4 rows for 3 tokens
    with pytest.raises(RolloutError, match="routes for 4 tokens, it has 3"):
        pack_groups([g], pad_id=0, version=0)
