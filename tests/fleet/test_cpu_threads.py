"""A CPU engine's torch threads (``megarl.fleet.cpu_threads``, applied by
``megarl.components.engine_threads``): the cores the trainer leaves, shared by the engines."""

import pytest

from megarl.config import RunConfig, load_config


def _cfg(**sections: dict) -> RunConfig:
    return load_config(None, [f"{s}.{k}={v}" for s, kv in sections.items() for k, v in kv.items()])


@pytest.mark.parametrize(
    ("rollout", "cores", "local_ranks", "threads"),
    [
        ({}, 2, 2, 2),  # staleness 0: the trainer waits while the engine generates
        ({"num_engines": 2}, 2, 2, 1),
        ({"num_engines": 3}, 8, 2, 2),
        ({"max_staleness": 1}, 2, 2, 1),  # pipelined: both trainer ranks compute meanwhile, at least 1
        ({"max_staleness": 1, "num_engines": 2}, 8, 2, 3),
        ({"max_staleness": 1}, 16, 4, 12),
        ({"engine_threads": 5}, 2, 2, 5),  # the user's number wins
        ({"engine_tp": 2}, 8, 2, 0),  # vLLM binds TP workers itself
    ],
)
def test_engine_threads_share_the_cores_the_trainer_leaves(rollout: dict, cores: int, local_ranks: int, threads: int) -> None:
    from megarl.components import engine_threads

    assert engine_threads(_cfg(rollout=rollout), cores, local_ranks) == threads


def test_engine_threads_auto_leaves_cuda_engines_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from megarl.components import engine_threads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_threads(_cfg(), 16, 8) == 0
    assert engine_threads(_cfg(rollout={"engine_threads": 4}), 16, 8) == 4
