"""The launcher's signal handling with real processes standing in for torchrun and its ranks
(cheap: no torch). The real run is tests/e2e/test_stop_and_recover.py.

The stand-in "torchrun" starts two workers and exits with the highest of their codes. A
worker announces itself, sleeps (start-up: no handler yet), installs SIGTERM/SIGUSR1
handlers, and on a signal records it and exits 7 (or, with ``stubborn``, keeps running).
Worker 0 also starts an "engine" in its own session, as rank 0 does.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT
from tests.helpers import alive_processes as _alive

TORCHRUN = """
import subprocess, sys
workers = [subprocess.Popen([sys.executable, sys.argv[1], str(i), *sys.argv[2:]]) for i in range(2)]
sys.exit(max(w.wait() for w in workers))
"""
WORKER = """
import os, signal, subprocess, sys, time
rank, out, stubborn = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if rank == 0:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(f"{out}/started{rank}", "w").close()
time.sleep(1.5)  # start-up: a SIGTERM now would kill this process
def on(sig, frame):
    open(f"{out}/got{rank}", "a").write(signal.Signals(sig).name + "\\n")
    if not stubborn:
        sys.exit(7)
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGUSR1, on)
time.sleep(120)
"""
LAUNCHER = "import sys; from megarl.launcher import run_supervised; sys.exit(run_supervised(sys.argv[1:], dict(__import__('os').environ)))"


def _start(tmp_path: Path, stubborn: bool) -> subprocess.Popen:
    (tmp_path / "torchrun.py").write_text(TORCHRUN)
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [
        sys.executable,
        "-c",
        LAUNCHER,
        sys.executable,
        str(tmp_path / "torchrun.py"),
        str(tmp_path / "worker.py"),
        str(tmp_path),
        "1" if stubborn else "0",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: (tmp_path / "started0").exists() and (tmp_path / "started1").exists(), 30)
    _wait_for(lambda: len(_tree(proc.pid)) == 4, 10)  # torchrun, 2 workers, engine
    return proc


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_for(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _reap(procs: list[psutil.Process]) -> None:
    for p in _alive(procs):
        p.kill()


@pytest.mark.parametrize(
    "sig, forwarded", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGTERM"), (signal.SIGUSR1, "SIGUSR1")]
)
def test_signal_to_launcher_reaches_workers_once_they_handle_it(tmp_path: Path, sig, forwarded: str) -> None:
    proc = _start(tmp_path, stubborn=False)
    tree = _tree(proc.pid)
    try:
        proc.send_signal(sig)  # the launcher alone, while the workers have no handler yet
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 7, out  # the workers' status
        for rank in range(2):
            assert (tmp_path / f"got{rank}").read_text() == forwarded + "\n"  # once, not fatal
        assert "the trainer ranks finish the current step" in out
        # the engine belongs to rank 0 (which shuts it down in megarl); here only it is left
        assert [p.cmdline()[-1] for p in _alive(tree)] == ["import time; time.sleep(120)"]
    finally:
        _reap(tree)


def test_second_sigint_kills_the_whole_tree(tmp_path: Path) -> None:
    proc = _start(tmp_path, stubborn=True)
    tree = _tree(proc.pid)
    try:
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: (tmp_path / "got0").exists() and (tmp_path / "got1").exists(), 30)
        assert proc.poll() is None  # the workers ignore the stop: the launcher keeps waiting
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, out
        assert "second Ctrl-C: killing torchrun and 3 processes" in out
        assert _alive(tree) == []
    finally:
        _reap(tree)


def test_torchrun_gets_sigterm_when_the_launcher_dies(tmp_path: Path) -> None:
    proc = _start(tmp_path, stubborn=False)
    tree = _tree(proc.pid)
    try:
        (torchrun,) = psutil.Process(proc.pid).children()
        assert torchrun.ppid() == proc.pid
        proc.kill()  # SIGKILL: no handler can run in the launcher
        proc.wait()
        # the stand-in torchrun has no handler: PR_SET_PDEATHSIG's SIGTERM ends it
        _wait_for(lambda: not _alive([torchrun]), 10)
    finally:
        _reap(tree)
