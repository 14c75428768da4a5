"""Resuming trims metrics.jsonl to the checkpoint's step, also when a hard kill cut its last line."""

import json
import logging
from pathlib import Path

import pytest

from megarl.checkpoint.state import trim_metrics


def test_records_after_the_step_and_a_cut_last_line_are_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 0.1 * s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "time": 17964')  # cut mid-record
    with caplog.at_level(logging.WARNING, logger="megarl"):
        trim_metrics(path, 3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    assert f"{path}:6 is not a whole metrics record" in caplog.text
    trim_metrics(path, 3)  # idempotent, nothing more to warn about
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    trim_metrics(tmp_path / "absent.jsonl", 3)  # a run without metrics yet
