"""``algo.router_replay: rollout`` reaches the engines' command line: a local fleet's launch
carries ``--return-routes`` (and only then), and the engine server's own parser reads it back."""

from pathlib import Path

import pytest

from megarl.engine.server import parse_args
from megarl.fleet.lifecycle import EngineLaunch


@pytest.mark.parametrize("routes", [True, False])
def test_return_routes_travels_to_the_engine_server(tmp_path: Path, routes: bool) -> None:
    launch = EngineLaunch(
        model_dir=str(tmp_path),
        tp=1,
        kv_cache_gb=0.25,
        seed=0,
        staging_dir=tmp_path,
        lease_s=0.0,
        cpu_gemm="auto",
        cpu_sampler="batched",
        sleep_mode=False,
        return_routes=routes,
        wait_for_model_s=0.0,
        token="t",
        threads=0,
        log_dir=tmp_path,
    )
    cmd = launch.engine(0).launch
    assert cmd[1:3] == ["-m", "megarl.engine.server"]
    assert ("--return-routes" in cmd) is routes
    assert parse_args(cmd[3:]).return_routes is routes
