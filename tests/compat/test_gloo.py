"""``megarl.compat.gloo``: the uneven all-gather and reduce-scatter that megatron's SP × EP token
dispatch needs, on two real gloo ranks (whose own uneven ``all_gather`` refuses the parts),
against what they must equal: the parts in rank order, and each rank's part of the sum."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.compat.gloo import gather_uneven, reduce_scatter_uneven

WORLD = 2
SIZES = [3, 5]  # rows of rank 0 and rank 1


def _part(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(10 + rank))


def _worker(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    results = {"gather": gather_uneven(_part(rank, SIZES[rank]), SIZES, group)}
    whole = _part(rank, sum(SIZES))  # every rank's full tensor, summed then split by SIZES
    results["reduce_scatter"] = reduce_scatter_uneven(whole, SIZES, group)
    try:  # what gloo does with the uneven parts itself (the reason for the patch)
        dist.all_gather([torch.empty(n, 4) for n in SIZES], _part(rank, SIZES[rank]), group=group)
        results["gloo_refuses"] = torch.tensor(False)
    except RuntimeError as e:
        results["gloo_refuses"] = torch.tensor("invalid tensor size" in str(e))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("gloo")
    init = f"file://{out / 'store'}"
    mp.start_processes(_worker, args=(init, str(out)), nprocs=WORLD, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_uneven_gather_returns_the_parts_in_rank_order(ranks: list[dict[str, torch.Tensor]]) -> None:
    expect = torch.cat([_part(r, n) for r, n in enumerate(SIZES)])
    for got in ranks:
        assert torch.equal(got["gather"], expect)
        assert bool(got["gloo_refuses"])


def test_uneven_reduce_scatter_keeps_each_ranks_part_of_the_sum(ranks: list[dict[str, torch.Tensor]]) -> None:
    total = sum(_part(r, sum(SIZES)) for r in range(WORLD))
    assert isinstance(total, torch.Tensor)
    assert torch.allclose(ranks[0]["reduce_scatter"], total[: SIZES[0]], rtol=0, atol=1e-6)
    assert torch.allclose(ranks[1]["reduce_scatter"], total[SIZES[0] :], rtol=0, atol=1e-6)
    assert ranks[1]["reduce_scatter"].shape == (SIZES[1], 4)
