"""A real two-node SLURM cluster on this one machine, for testing the sbatch scripts.

``LocalSlurm`` installs Debian's ``slurmctld slurmd slurm-client munge`` (once, with apt),
writes a private ``slurm.conf`` under a scratch folder (client commands find it through
``SLURM_CONF``; ``/etc/slurm`` is never touched), and runs ``munged``, ``slurmctld`` and one
``slurmd -N nodeK`` per emulated node, all on 127.0.0.1 with free ports picked at start.
See /work/shared/FACTS.md "Real SLURM on one machine" for why each setting is there.

Invariants: every daemon this module starts is its own child (started in the foreground
with ``-D``/``-F``) and is stopped by pid in :meth:`LocalSlurm.stop`; munged listens on a
private socket (``AuthInfo=socket=``), so a system munged or a concurrent test session is
never touched; every wait is bounded. The only machine-wide
edits are the Debian packages and one ``127.0.0.1 node1 node2`` line in /etc/hosts (node
names must resolve or torch rendezvous on ``MASTER_ADDR=node1`` hangs).

Run by hand (``python -m tests.slurm.local_cluster DIR``) to get a cluster to poke at;
Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
"""Emulated CPUs per node; ``SlurmdParameters=config_overrides`` makes slurmd trust this."""
HOSTS_LINE = "127.0.0.1 " + " ".join(NODES)


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the local cluster (not root, no apt, install failed, ...)."""


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise ClusterUnavailable(f"`{' '.join(cmd)}` did not finish in {timeout:.0f}s") from e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def check_host() -> None:
    """Raise ClusterUnavailable unless this machine can install and run the daemons."""
    if sys.platform != "linux":
        raise ClusterUnavailable(f"needs Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"needs root to install packages and run slurmd (euid={os.geteuid()})")
    if shutil.which("dpkg-query") is None or shutil.which("apt-get") is None:
        raise ClusterUnavailable("needs a Debian/Ubuntu host with apt-get and dpkg-query")


def missing_packages() -> list[str]:
    out = []
    for pkg in PACKAGES:
        q = _run(["dpkg-query", "-W", "-f=${Status}", pkg], timeout=30)
        if q.returncode != 0 or "install ok installed" not in q.stdout:
            out.append(pkg)
    return out


def install_packages() -> None:
    """apt-get update + install --no-install-recommends; a no-op when all are installed."""
    need = missing_packages()
    if not need:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    upd = _run(["apt-get", "update", "-q"], timeout=300, env=env)
    if upd.returncode != 0:
        raise ClusterUnavailable(f"apt-get update failed ({upd.returncode}):\n{upd.stderr[-2000:]}")
    cmd = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=120", "--no-install-recommends", *need]
    inst = _run(cmd, timeout=900, env=env)
    if inst.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(cmd)}` failed ({inst.returncode}):\n{inst.stderr[-2000:]}")
    still = missing_packages()
    if still:
        raise ClusterUnavailable(f"apt-get reported success but {still} are not installed")


def ensure_hosts_entry(hosts: Path = Path("/etc/hosts")) -> None:
    """Make node1/node2 resolve to 127.0.0.1 (appends one line, only if a name is missing)."""
    missing = []
    for name in NODES:
        try:
            if socket.gethostbyname(name) != "127.0.0.1":
                missing.append(name)
        except OSError:
            missing.append(name)
    if missing:
        with hosts.open("a") as fh:
            fh.write(f"\n{HOSTS_LINE}  # megarl tests/slurm\n")
        for name in NODES:
            if socket.gethostbyname(name) != "127.0.0.1":
                raise ClusterUnavailable(f"{name} still does not resolve to 127.0.0.1 after editing {hosts}")


def _node_memory_mb() -> int:
    """RealMemory per emulated node: a share of this machine, so slurmd never reports less."""
    kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            kb = int(line.split()[1])
    return max(256, kb // 1024 // (len(NODES) + 1))


class LocalSlurm:
    """munged + slurmctld + one slurmd per node; ``env`` points client commands at it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "etc" / "slurm.conf"
        self.log_dir = base / "log"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # A surrounding allocation, torchrun or megarl launch settings must not leak into our jobs.
        leaky = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "MEGARL_", "TORCHELASTIC_")
        torch_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
        for k in [k for k in self.env if (k.startswith(leaky) or k in torch_vars) and k != "SLURM_CONF"]:
            del self.env[k]
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        # Short, root-free path for munged's socket (unix socket paths are limited to 108 bytes).
        self.munge_dir = Path(tempfile.gettempdir()) / f"megarl-munge-{os.getpid()}-{_free_port()}"
        self.munge_socket = self.munge_dir / "munge.socket"

    # ------------------------------------------------------------------ configuration

    def write_conf(self) -> None:
        for sub in ("etc", "log", "state", "spool", "run"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for name in NODES:
            (self.base / "spool" / name).mkdir(exist_ok=True)
        ctld_port = _free_port()
        mem = _node_memory_mb()
        host = socket.gethostname().split(".")[0]
        b = self.base
        lines = [
            "ClusterName=megarl-ci",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire=5: a requeued job restarts after ~7 s instead of ~130 s
            f"AuthInfo=cred_expire=5,socket={self.munge_socket}",
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/run/slurmctld.pid",
            f"SlurmdPidFile={b}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",  # no cgroups / systemd needed
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",  # memory is not a consumable: --mem=0 jobs still pack
            "SlurmdParameters=config_overrides",  # trust CPUs/RealMemory below, not the hardware
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=2,sched_interval=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={b}/log/jobcomp.txt",
            "JobRequeue=1",
            "ReturnToService=2",
            "MinJobAge=600",  # keep finished jobs visible to `scontrol show job` for the asserts
            "KillWait=10",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
        ]
        for name in NODES:
            lines.append(
                f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={_free_port()} "
                f"CPUs={CPUS_PER_NODE} RealMemory={mem} State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, cmd: list[str], user: str | None = None) -> None:
        out = (self.log_dir / f"{name}.stdout").open("ab")
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, user=user, start_new_session=True
        )
        out.close()
        self._procs[name] = proc

    def _munge_works(self) -> bool:
        sock = f"--socket={self.munge_socket}"
        try:
            cred = subprocess.run(["munge", sock, "-n"], capture_output=True, timeout=10)
            if cred.returncode != 0:
                return False
            dec = subprocess.run(["unmunge", sock], input=cred.stdout, capture_output=True, timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            return False
        return dec.returncode == 0

    def start_munge(self) -> None:
        """Our own munged on a private socket: a system or other session's munged stays untouched."""
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            r = _run(["mungekey", "--create"], timeout=30)
            if r.returncode != 0 or not key.exists():
                raise ClusterUnavailable(f"no {key} and `mungekey --create` failed: {r.stderr}")
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        # munged runs as user munge, which cannot enter pytest's 0700 temp dirs: own folder.
        self.munge_dir.mkdir(mode=0o755)
        shutil.chown(self.munge_dir, "munge", "munge")
        d = self.munge_dir
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--seed-file={d}/munged.seed",
                f"--log-file={d}/munged.log",
            ],
            user="munge",
        )
        self._wait(self._munge_works, 20, f"munged to answer on {self.munge_socket}")

    def start(self) -> None:
        """Write the config, start every daemon, return once all nodes are idle."""
        self.write_conf()
        self.start_munge()
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.cmd(["scontrol", "ping"], 10).returncode == 0, 30, "slurmctld to answer ping")
        for name in NODES:
            self._spawn(f"slurmd.{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait(self.all_idle, 60, f"nodes {NODES} to be idle in sinfo")

    def node_states(self) -> dict[str, str]:
        r = self.cmd(["sinfo", "-h", "-N", "-o", "%N %t"], 10)
        states = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def all_idle(self) -> bool:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise ClusterUnavailable(f"{name} exited with code {proc.returncode}\n{self.diagnostics()}")
        states = self.node_states()
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ok, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")

    def stop(self) -> None:
        """Cancel every job, wait for them to leave, then stop our daemons (TERM, then KILL)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            jobs = self.cmd(["squeue", "-h", "-o", "%i"], 10).stdout.split()
            if jobs:
                self.cmd(["scancel", *jobs], 10)
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline and self.cmd(["squeue", "-h", "-o", "%i"], 10).stdout.strip():
                    time.sleep(1)
        for name in [n for n in self._procs if n.startswith("slurmd.")] + ["slurmctld", "munged"]:
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    # ------------------------------------------------------------------ clients

    def cmd(
        self, args: list[str], timeout: float = 30, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster (never raises on exit code)."""
        full_env = dict(self.env, **(env or {}))
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return subprocess.CompletedProcess(args, 124, out, f"timed out after {timeout:.0f}s")

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (empty when the job is unknown)."""
        r = self.cmd(["scontrol", "show", "job", "-o", job_id], 10)
        info = {}
        for tok in r.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def diagnostics(self, job_output: Path | None = None) -> str:
        """Daemon log tails, node states, the queue and (optionally) a job's output file."""
        parts = [f"== slurm.conf ({self.conf})\n{_tail(self.conf, 3000)}"]
        for p in [*sorted(self.log_dir.glob("*")), self.munge_dir / "munged.log"]:
            parts.append(f"== {p.name}\n{_tail(p, 3000)}")
        parts.append("== sinfo\n" + self.cmd(["sinfo", "-N", "-l"], 10).stdout)
        parts.append("== squeue\n" + self.cmd(["squeue", "-l"], 10).stdout)
        if job_output is not None:
            parts.append(f"== job output {job_output}\n{_tail(job_output, 8000)}")
        return "\n".join(parts)


def main() -> int:
    base = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/megarl-slurm").resolve()
    check_host()
    install_packages()
    ensure_hosts_entry()
    cluster = LocalSlurm(base)

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops it cleanly too
    try:
        cluster.start()
        print(f"cluster up: export SLURM_CONF={cluster.conf}   (Ctrl-C or kill stops it)", flush=True)  # noqa: T201
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
