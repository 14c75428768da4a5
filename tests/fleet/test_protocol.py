"""The weight-update protocol's bookkeeping (``megarl.fleet.protocol``), without engines: the
fleet counts no versions of its own — its version is that of the last update it committed,
recorded with that update's replay; an opened or cancelled update changes neither. (The
phases against real engines: ``tests/fleet/test_fleet.py``.)"""

from megarl.fleet.client import EngineClient
from megarl.fleet.fleet import Fleet
from megarl.fleet.protocol import Committed


def test_the_fleet_version_is_the_last_committed_update() -> None:
    f = Fleet([], request_timeout_s=5, start_timeout_s=5)
    assert f.version == -1 and f.last_commit == Committed(-1)

    def replay(engines: list[EngineClient]) -> None:
        pass

    f.open_update(3)
    f.cancel_update()
    assert f.version == -1  # opened, then dropped: nothing committed
    f.open_update(3)
    f.close_update(3, replay)
    assert f.version == 3 and f.last_commit == Committed(3, replay)
    f.open_update(4, begin=False)
    f.cancel_update()
    assert f.version == 3 and f.last_commit.replay is replay
