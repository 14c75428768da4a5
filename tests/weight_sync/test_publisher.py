"""When the publisher runs the weight-sync integrity check (`weight_sync.integrity_every`): the
first sync of the process, every N-th version, and the first sync after an engine restart.
The check itself (engine vs trainer log-probs) runs for real in the end-to-end tests; here
the sync and the check are stand-ins so the rule is seen alone."""

from types import SimpleNamespace
from typing import Any

import pytest

import megarl.weight_sync.publisher as publisher_mod
from megarl.config import load_config
from megarl.weight_sync.publisher import PolicyPublisher


class _Sync:
    def push(self, version: int) -> dict[str, float]:
        return {"total_s": 0.0}


def _publisher(sets: list[str], fleet: Any, monkeypatch: Any) -> tuple[PolicyPublisher, list[int]]:
    """A publisher whose integrity check records the version it ran at."""
    checked: list[int] = []
    cfg = load_config(None, sets)
    pub = PolicyPublisher(cfg.weight_sync, actor=None, sync=_Sync(), fleet=fleet,  # type: ignore[arg-type]
                          integrity_tokens=[1, 2], ready=lambda: None, colocate=cfg.rollout.colocate)  # fmt: skip
    monkeypatch.setattr(publisher_mod, "check_integrity", lambda *a: checked.append(pub.version) or 0.0)
    return pub, checked


def _checked_versions(sets: list[str], restart_before: set[int], pushes: int, monkeypatch: Any) -> list[int]:
    fleet = SimpleNamespace(restarts=0, rejoins=0)
    pub, checked = _publisher(sets, fleet, monkeypatch)
    for v in range(1, pushes + 1):
        if v in restart_before:
            fleet.restarts += 1  # an engine was restarted since the last sync (or during this one)
            fleet.rejoins += 1  # ... and serves again (the check follows it back into service)
        out = pub.push()
        assert ("sync/integrity_max_abs_diff" in out) == (checked[-1:] == [v])
    return checked


def test_integrity_every_checks_first_every_nth_and_after_a_restart(monkeypatch: Any) -> None:
    got = _checked_versions(["weight_sync.integrity_every=4"], {6, 7}, 13, monkeypatch)
    assert got == [1, 4, 6, 7, 8, 12]  # 6 and 7: the first syncs after a restart each


def test_integrity_every_one_checks_every_sync_and_off_checks_none(monkeypatch: Any) -> None:
    assert _checked_versions([], set(), 5, monkeypatch) == [1, 2, 3, 4, 5]
    assert _checked_versions(["weight_sync.integrity_check=false"], {3}, 5, monkeypatch) == []


def test_a_resumed_publisher_checks_its_first_sync(monkeypatch: Any) -> None:
    pub, checked = _publisher(["weight_sync.integrity_every=10"], None, monkeypatch)
    pub.load_state_dict({"version": 23})
    for _ in range(8):
        pub.push()
    assert checked == [23, 30]


def test_integrity_every_must_be_positive() -> None:
    from megarl.config import ConfigError, validate

    with pytest.raises(ConfigError, match="weight_sync.integrity_every"):
        validate(load_config(None, ["weight_sync.integrity_every=0"]), 1)
