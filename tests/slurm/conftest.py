"""The session's local SLURM cluster (tests/slurm/local_cluster.py).

Unavailable (not root, no apt, install or start failed): the tests skip with the reason,
except under CI (``CI=true``), where they fail with it: CI must never go green by skipping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.local_cluster import ClusterUnavailable, LocalSlurm, check_host, ensure_hosts_entry, install_packages


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    cluster: LocalSlurm | None = None
    try:
        check_host()
        install_packages()
        ensure_hosts_entry()
        # Short base path: slurmd puts unix sockets under its spool dir (108-byte limit).
        cluster = LocalSlurm(Path(tmp_path_factory.mktemp("slurm")))
        cluster.start()
    except ClusterUnavailable as e:
        if cluster is not None:
            cluster.stop()
        if _in_ci():
            pytest.fail(f"local SLURM cluster unavailable under CI=true: {e}", pytrace=False)
        pytest.skip(f"local SLURM cluster unavailable: {e}")
    assert cluster is not None
    yield cluster
    cluster.stop()
