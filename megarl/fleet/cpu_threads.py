"""How many torch threads a CPU engine gets: one rule for the engines the trainer starts
(:func:`megarl.components.engine_threads`) and those the SLURM scripts start
(``slurm/engine_task.sh``, per node). Pure arithmetic: importing it starts nothing."""

from __future__ import annotations


def cpu_engine_threads(threads: int, max_staleness: int, cores: int, engines: int, trainer_ranks: int) -> int:
    """Torch threads of each of ``engines`` CPU engines on a host with ``cores`` CPUs and
    ``trainer_ranks`` trainer ranks: ``rollout.engine_threads`` when set, else (0 = auto) the
    cores shared by the engines, less the trainer ranks when they compute while the fleet
    generates (``max_staleness`` > 0); at least 1. One rule for the engines the trainer starts
    (:func:`megarl.components.engine_threads`) and those the SLURM scripts start
    (``slurm/engine_task.sh``, per node)."""
    if threads:
        return threads
    busy = trainer_ranks if max_staleness > 0 else 0
    return max(1, (cores - busy) // engines)
