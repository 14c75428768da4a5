"""pip's resolve of the ``gpu`` extra (``tests/test_packaging.py``), started in the background when
the test is collected (``tests/conftest.py``) and niced, so its ~70 s of CPU — most of it building
Transformer Engine's torch binding's metadata, whose build environment installs a CUDA torch —
runs on the core the single-process tests leave idle instead of in line with them."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

from tests.helpers import ROOT

_started: tuple[subprocess.Popen[bytes], Path] | None = None


def requirements() -> tuple[list[str], list[str]]:
    """(the project's runtime pins, the ``gpu`` extra) from pyproject.toml."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return meta["dependencies"], meta["optional-dependencies"]["gpu"]


def start() -> None:
    """Start the resolve (once): the project's runtime pins + the extra, as `pip install .[gpu]`
    would ask for them, for an empty venv."""
    global _started
    if _started is not None:
        return
    tmp = Path(tempfile.mkdtemp(prefix="megarl-gpu-resolve-"))
    env = tmp / "venv"
    venv.create(env, with_pip=False)  # empty: nothing installed counts as satisfied
    report = tmp / "report.json"
    # This venv's pip (the one `make venv` upgrades) resolves for the empty one (--python): Python
    # 3.11's bundled pip 23.2 took ~45 s longer for the same answer (docs/LOG.md, session 16)
    deps, gpu = requirements()
    cmd = ["nice", "-n", "19", sys.executable, "-m", "pip", "--python", str(env / "bin/python"), "install", "--dry-run", "--quiet",
           "--report", str(report), *deps, *gpu]  # fmt: skip
    with (tmp / "stderr.txt").open("w") as err:  # (a file, not a pipe: pip's warnings would fill one and stall it)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    atexit.register(shutil.rmtree, tmp, True)
    _started = (proc, report)


def result(timeout_s: float = 900) -> tuple[int, str, Path]:
    """(pip's exit code, its stderr, the report's path), waiting for the resolve to end."""
    start()
    assert _started is not None
    proc, report = _started
    proc.wait(timeout=timeout_s)
    return proc.returncode, (report.parent / "stderr.txt").read_text(errors="replace"), report
