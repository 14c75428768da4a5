"""`make test` runs the suite as two pytest processes side by side (the Makefile's SHARD_E2E and
SHARD_REST): every test file is in exactly one of them, so none is skipped and none runs twice."""

import subprocess
from pathlib import Path

from tests.helpers import ROOT


def _files(args: list[str]) -> set[Path]:
    """The test files pytest collects for ``args`` (paths, and ``--ignore=PATH``)."""
    ignored = {(ROOT / a.split("=", 1)[1]).resolve() for a in args if a.startswith("--ignore=")}
    out: set[Path] = set()
    for a in args:
        if a.startswith("-"):
            continue
        p = (ROOT / a).resolve()
        found = sorted(p.rglob("test_*.py")) if p.is_dir() else [p]
        out |= {f for f in found if f not in ignored and not any(d in ignored for d in f.parents)}
    return out


def test_every_test_file_is_in_exactly_one_shard() -> None:
    printed = subprocess.run(["make", "-s", "print-shards"], cwd=ROOT, capture_output=True, text=True, check=True)
    shards = dict(line.split(": ", 1) for line in printed.stdout.strip().splitlines())
    e2e, rest = _files(shards["e2e"].split()), _files(shards["rest"].split())
    everything = {f.resolve() for f in (ROOT / "tests").rglob("test_*.py")}
    assert e2e and rest and not e2e & rest, sorted(map(str, e2e & rest))
    assert e2e | rest == everything, sorted(map(str, everything - (e2e | rest)))
    assert (ROOT / "tests/e2e/test_resume.py").resolve() in rest  # the heaviest e2e file balances the shards
