"""The ``megarl train`` launcher: runs torchrun as its child and answers for it until it exits.

Signals. A launcher that only called ``subprocess.call(torchrun ...)`` died at once on
SIGTERM (the default action) and on SIGINT (KeyboardInterrupt, then SIGKILL to torchrun),
leaving the ranks and the engine training on as orphans — and ``kill <pid>``, a process
manager or a container runtime signal exactly that one process. This one:

* installs its handlers for SIGTERM, SIGINT and SIGUSR1 *before* starting torchrun, so no
  signal finds it unprepared;
* starts torchrun in its own session: a terminal's Ctrl-C (SIGINT to the whole foreground
  process group) reaches only the launcher. Otherwise torchrun takes it as a death signal
  (forward, SIGKILL after its shutdown timeout, exit 1 with a traceback) and the ranks see
  a KeyboardInterrupt;
* forwards each signal to the workers (torchrun's children, the trainer ranks) as their
  stop signal: SIGTERM and SIGINT as SIGTERM, SIGUSR1 as SIGUSR1. A worker gets it only
  once it has a handler for it (``SigCgt`` in ``/proc/<pid>/status``): a signal during
  start-up is held back, never fatal. The ranks finish the step, checkpoint, stop their
  engines and exit; torchrun exits with their status and the launcher with torchrun's;
* escalates on SIGINT after a stop was requested (Ctrl-C twice): SIGKILL to torchrun and
  every descendant (ranks, engines), no checkpoint, exit 130;
* has the kernel send torchrun SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``,
  Linux): torchrun then forwards it to the ranks (its own graceful shutdown).

Errors. A rank that stops on a :class:`megarl.errors.MegarlError` writes its one-line message
into the folder named by ``MEGARL_ERROR_DIR`` (:func:`record_rank_error`) and exits with
code 2 without printing. ``python -m megarl.launcher ARGS`` is ``torchrun ARGS`` except that,
when such a message exists, torchrun's own failure output (the per-rank "failed (exitcode:
2)" lines and the ChildFailedError report) is dropped, so the launcher (:func:`launch`)
prints the first message alone. Failures without a message (a bug, a signal) keep
torchrun's full report. Started by hand (no ``MEGARL_ERROR_DIR``: the command to use instead
of ``torchrun`` for ``-m megarl.cli train``), it keeps the ranks' messages itself and prints the
first one alone, exit 2: torchrun turns any failed rank into a ChildFailedError traceback, so
only its parent can keep a megarl error to one line.

Torch-free, except ``main`` (the torchrun wrapper, run in the child).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import psutil

log = logging.getLogger("megarl")

FORWARD: dict[int, int] = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGTERM,
    signal.SIGUSR1: signal.SIGUSR1,
}
"""Signal received by the launcher → signal delivered to each worker."""
POLL_S = 0.1


def run_supervised(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` (torchrun) to the end, forwarding stop signals to its workers; returns its
    exit status (128 + N if it was killed by signal N)."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)  # acted on by the loop below, outside the handler

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARD}
    try:
        child = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with(os.getpid()))
        return _supervise(child, received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(child: subprocess.Popen[bytes], received: list[int]) -> int:
    wanted: set[int] = set()  # signals every worker must get
    delivered: set[tuple[int, int]] = set()  # (pid, signal) done
    while True:
        while received:
            sig = received.pop(0)
            if sig == signal.SIGINT and wanted:
                return _kill_tree(child)
            if FORWARD[sig] not in wanted:
                log.warning(
                    "launcher got %s: the trainer ranks finish the current step, checkpoint and exit "
                    "(Ctrl-C again stops at once, without a checkpoint)",
                    signal.Signals(sig).name,
                )
            wanted.add(FORWARD[sig])
        for worker in _workers(child.pid):
            for sig in wanted:
                if (worker.pid, sig) not in delivered and _catches(worker.pid, sig):
                    try:
                        os.kill(worker.pid, sig)
                    except ProcessLookupError:
                        pass  # exited meanwhile: nothing left to stop
                    delivered.add((worker.pid, sig))
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            continue
        return code if code >= 0 else 128 - code


def _workers(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler installed for ``sig`` (True where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        return not os.path.isdir("/proc")  # gone (False), or no procfs (assume it does)
    return True


def _kill_tree(child: subprocess.Popen[bytes]) -> int:
    try:
        tree = [psutil.Process(child.pid), *psutil.Process(child.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    log.warning("second Ctrl-C: killing torchrun and %d processes under it (no checkpoint)", len(tree) - 1)
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)
    child.wait()
    return 128 + signal.SIGINT


def _die_with(parent: int) -> Callable[[], None] | None:
    """``preexec_fn``: the child gets SIGTERM when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


# ---------------------------------------------------------------------- one-line errors

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
    """Run ``cmd`` (a ``python -m megarl.launcher ...`` command) supervised
    (:func:`run_supervised`) with a fresh error folder; print the first rank's one-line error
    and return 2, or return the command's exit code."""
    with tempfile.TemporaryDirectory(prefix="megarl-errors-") as errors:
        rc = run_supervised(cmd, {**env, ERROR_DIR_ENV: errors})
        line = first_rank_error(errors)
    if line:
        sys.stderr.write(line + "\n")
        return EXIT_USER_ERROR
    return rc


class _UnlessReported(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not peer_reported()


def main(argv: list[str]) -> int:
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
    if os.environ.get(ERROR_DIR_ENV):  # under launch(), which prints the first rank's line
        return _torchrun_quiet(torchrun, argv)
    with tempfile.TemporaryDirectory(prefix="megarl-errors-") as errors:  # by hand: print it here
        os.environ[ERROR_DIR_ENV] = errors  # the ranks inherit torchrun's environment
        try:
            code = _torchrun_quiet(torchrun, argv)
        finally:
            del os.environ[ERROR_DIR_ENV]
        line = first_rank_error(errors)
    if line:
        sys.stderr.write(line + "\n")
    return code


def _torchrun_quiet(torchrun: Callable[[list[str]], None], argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun(argv)
    except ChildFailedError:
        if peer_reported():
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
