"""torchrun for ``megarl train``, with one line on the terminal when a rank fails for a reason
the user can fix.

A rank that stops on a :class:`megarl.errors.MegarlError` writes its one-line message into
the folder named by ``MEGARL_ERROR_DIR`` (:func:`record_rank_error`) and exits with code 2
without printing. ``python -m megarl.launcher ARGS`` is ``torchrun ARGS`` except that, when
such a message exists, torchrun's own failure output (the per-rank "failed (exitcode: 2)"
lines and the ChildFailedError report) is dropped, so the launcher (``megarl train``) prints
the first message alone (:func:`first_rank_error`). Failures without a message (a bug, a
signal) keep torchrun's full report.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ERROR_DIR_ENV = "MEGARL_ERROR_DIR"
EXIT_USER_ERROR = 2


def record_rank_error(line: str) -> bool:
    """Under the megarl launcher: write this rank's one-line error for it; False otherwise."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    rank = os.environ.get("RANK", "0")
    tmp = Path(folder) / f".rank{rank}.tmp"
    tmp.write_text(line)
    tmp.replace(Path(folder) / f"rank{rank}")  # whole or absent: the launcher never reads half
    return True


def peer_reported(folder: str | None = None) -> bool:
    """True if some rank already wrote its error (a later failure here is its consequence)."""
    folder = folder or os.environ.get(ERROR_DIR_ENV)
    return bool(folder) and Path(folder).is_dir() and any(Path(folder).glob("rank*"))  # type: ignore[arg-type]


def first_rank_error(folder: str | Path) -> str | None:
    """The first error any rank wrote (earliest, then lowest rank): the root cause."""
    files = sorted(Path(folder).glob("rank*"), key=lambda p: (p.stat().st_mtime_ns, int(p.name[4:])))
    return files[0].read_text().strip() if files else None


def launch(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` (a ``python -m megarl.launcher ...`` command) with a fresh error folder;
    print the first rank's one-line error and return 2, or return the command's exit code."""
    with tempfile.TemporaryDirectory(prefix="megarl-errors-") as errors:
        rc = subprocess.call(cmd, env={**env, ERROR_DIR_ENV: errors})
        line = first_rank_error(errors)
    if line:
        sys.stderr.write(line + "\n")
        return EXIT_USER_ERROR
    return rc


class _UnlessReported(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not peer_reported()


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    quiet = _UnlessReported()
    handler = logging.StreamHandler(sys.stderr)  # what logging's last resort would print
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    # torch gives its "torch" logger a handler of its own (glog-style lines): filter every one
    loggers = [
        logging.getLogger(),
        *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for h in {h for lg in loggers for h in lg.handlers}:
        h.addFilter(quiet)
    try:
        torchrun(argv)
    except ChildFailedError:
        if peer_reported():
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
