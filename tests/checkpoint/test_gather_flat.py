"""``gather_flat`` (the weight sync's TP gather, several tensors per collective) returns on
its destination rank what one ``all_gather`` per tensor returns, and nothing on the others,
for any chunk size, mixed dtypes and shapes, either rank as the destination — run on two
real gloo ranks."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.checkpoint.hf_io import gather_flat

WORLD = 2


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(5, 3, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.randint(0, 1000, (3, 2), generator=g),
        torch.randn(2, 2, 2, generator=g),
        torch.randn(11, generator=g),
    ]


def _worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mine = _tensors(rank)
    expect = []
    for t in mine:
        parts = [torch.empty_like(t.contiguous()) for _ in range(WORLD)]
        dist.all_gather(parts, t.contiguous())
        expect.append(parts)
    results = {}
    for dst in (0, 1):
        for chunk in (1, 40, 64 << 20):  # one tensor per collective, a few, all of one dtype at once
            got = gather_flat(mine, None, dst=dst, chunk_bytes=chunk)
            if rank != dst:
                results[dst, chunk] = got == []
                continue
            assert len(got) == len(mine)
            results[dst, chunk] = all(
                len(g) == WORLD
                and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(g, e))
                for g, e in zip(got, expect)
            )
    assert gather_flat([], None) == []
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_flat_gather_equals_one_gather_per_tensor(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_worker, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results == {(d, c): True for d in (0, 1) for c in (1, 40, 64 << 20)}, (rank, results)
    # the other rank's tensors really arrived (not this rank's twice)
    assert not torch.equal(_tensors(0)[0], _tensors(1)[0])


if __name__ == "__main__":
    pytest.main([__file__])
