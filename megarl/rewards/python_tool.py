"""The ``python`` tool: run a model's Python code in a sandboxed subprocess (Linux only).

:func:`run_python` stages the code as ``main.py`` in a fresh temporary directory and runs this
very file as a launcher (``python -I -S python_tool.py``: standard library only, so it starts
from any checkout) with an empty environment, stdin closed, stdout and stderr merged into one
pipe, in a new session (its own process group). The launcher, then the processes under it:

1. **launcher** (host namespaces): ``unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID |
   CLONE_NEWNS)`` and maps the caller's user and group to id ``NS_ID`` (1000) inside;
2. **init** (pid 1 of the new pid namespace; runs no user code): dies with the launcher
   (``PR_SET_PDEATHSIG``); remounts every mount read-only and nodev; mounts a private tmpfs of
   ``disk_mb`` on ``/tmp`` (the code's working directory, ``/tmp/main.py``: the same paths every
   call, so observations reproduce) and a fresh read-only ``/proc`` (best effort: the code then
   sees only its own processes); prints a per-call nonce, the proof that all of this is in
   place; forks the code's process and waits for it. When init exits, the kernel kills every
   process left in the namespace, so nothing the code started outlives the call, and the tmpfs
   goes with it;
3. **the code**: rlimits (CPU seconds, address space, file size), a seccomp filter refusing new
   processes (threads work) and Unix sockets by path (:func:`_seccomp_filter`), then ``exec`` of
   a fresh ``python -I -S -u main.py`` as id 1000 in the namespace, which drops the namespace's
   capabilities: it cannot remount, unmount or make namespaces.

Fail closed: when a step of 1-2 fails, the code is not run and the result says why (no nonce
came back). The caller reads the pipe incrementally, keeping at most ``output_bytes`` (a flood
cannot fill its memory), and kills the launcher's process group at the wall-time limit or when
the output passes its limit; init follows the launcher (its death signal), the rest follow init.

Invariants: the result is a text, never an exception: the output, or ``error: ...`` naming the
limit hit or the exit status, then the output so far; the staging directory is removed.

Not isolated (docs/agents.md, "The python tool"): the code runs as the trainer's user (outside
the namespace), so it can read whatever files that user can; the kernel's other system calls
are open to it (the seccomp filter covers processes and Unix sockets only), no cgroup, no
container. (Processes are refused with seccomp, not counted with ``RLIMIT_NPROC``: the kernel
exempts root from that limit, even inside a user namespace.)
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 0x4000, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
NS_ID = 1000
"""The code's user and group id inside its user namespace (the caller's outside)."""
NO_SANDBOX = 97
"""The launcher's exit code when it could not make the namespaces (the code did not run)."""
CODE_FILE = "main.py"


@dataclass(frozen=True)
class PythonLimits:
    """What one call may use. A limit hit ends the call with ``error: ...`` naming it."""

    timeout_s: float = 5.0
    """Wall-clock seconds per call; then every process of the call is killed."""
    cpu_s: int = 2
    """CPU seconds of the code's process (RLIMIT_CPU; SIGKILL one second later)."""
    memory_mb: int = 256
    """Address space of the code's process, MiB, its threads together (RLIMIT_AS)."""
    output_bytes: int = 65536
    """stdout and stderr together, bytes; the code is killed when it writes more."""
    disk_mb: int = 16
    """The code's files, MiB: the size of its private /tmp (and RLIMIT_FSIZE, the largest file)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"PythonLimits.{f.name}={value!r}: must be a positive number")


def _tell_parent(message: str) -> None:
    """In the sandbox's own processes (launcher, init): a line on stderr, which the trainer reads
    back as the tool's result (these processes have no logger: they run with ``-I -S``)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def run_python(code: str, limits: PythonLimits | None = None) -> str:
    """Run ``code`` in the sandbox; its output, or ``error: ...`` (see the module docstring)."""
    limits = limits or PythonLimits()
    if not sys.platform.startswith("linux"):
        return "error: the python tool runs code only on Linux (it needs network namespaces); not run"
    nonce = secrets.token_hex(8)
    workdir = tempfile.mkdtemp(prefix="megarl-python-")
    try:
        with open(os.path.join(workdir, CODE_FILE), "wb") as f:
            f.write(code.encode("utf-8", errors="surrogatepass"))  # (JSON may carry lone surrogates)
        argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), nonce]
        argv += [str(limits.timeout_s), str(limits.cpu_s), str(limits.memory_mb), str(limits.disk_mb)]
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        try:
            output, why = _read(proc, limits)
        finally:
            _kill(proc)
        return _result(output, proc.returncode, why, nonce, limits)
    finally:
        shutil.rmtree(workdir)  # (only main.py: the code writes to its own tmpfs)


def _read(proc: subprocess.Popen[bytes], limits: PythonLimits) -> tuple[bytes, str]:
    """The pipe's bytes (at most the limit, plus the nonce line) and why reading stopped early
    ('timeout', 'output') or '' at the end of the output."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    poller = select.poll()  # (select.select fails on descriptors past 1024; the trainer has many)
    poller.register(fd, select.POLLIN)
    cap = limits.output_bytes + 64  # (+ the nonce line)
    out = bytearray()
    deadline = time.monotonic() + limits.timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), "timeout"
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # every process of the call has closed the pipe
            break
        out += chunk
        if len(out) > cap:
            return bytes(out), "output"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(out), "timeout"
    return bytes(out), ""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher's process group (init dies with the launcher, the rest with init)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _result(raw: bytes, code: int | None, why: str, nonce: str, limits: PythonLimits) -> str:
    head = f"{nonce}\n".encode()
    if not raw.startswith(head):  # the launcher stopped before the namespaces existed
        reason = raw.decode("utf-8", errors="replace").strip() or f"launcher exit code {code}"
        return f"error: the python tool could not isolate the code ({reason[:500]}); it was not run"
    body = raw[len(head) :]
    cut = len(body) > limits.output_bytes
    text = body[: limits.output_bytes].decode("utf-8", errors="replace")
    if why == "timeout":
        return _error(f"timed out after {limits.timeout_s:g} s (the wall-time limit); the code was killed", text)
    if why == "output" or cut:
        return _error(f"output passed {limits.output_bytes} bytes (the output limit); the code was killed", text)
    if code == 0:
        return text
    lines = text.rstrip().splitlines()
    if lines and lines[-1].startswith("MemoryError"):
        return _error(f"out of memory (the {limits.memory_mb} MiB memory limit)", text)
    if code == 128 + signal.SIGXCPU:
        return _error(f"used more than {limits.cpu_s} s of CPU time (the CPU limit); the code was killed", text)
    if code is not None and code > 128:
        return _error(f"the code was killed by {_signal_name(code - 128)}", text)
    return _error(f"exit code {code}", text)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _error(what: str, output: str) -> str:
    return f"error: {what}" + (f"\n{output}" if output else "")


# ----- the launcher: runs as ``python -I -S python_tool.py NONCE TIMEOUT_S CPU_S MEMORY_MB DISK_MB``


def _launch(argv: list[str]) -> None:
    nonce, timeout_s, cpu_s, memory_mb, disk_mb = argv
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS
    uid, gid = os.geteuid(), os.getegid()
    try:
        if libc.unshare(flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(user, network, pid, mount namespaces): {os.strerror(err)}")
        # one id, the caller's, seen as NS_ID inside: not 0, so the code's exec drops the namespace's
        # capabilities (it cannot remount what init made read-only); files it makes are the caller's
        for name, text in (("setgroups", "deny"), ("uid_map", f"{NS_ID} {uid} 1"), ("gid_map", f"{NS_ID} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as e:
        _tell_parent(f"cannot make the namespaces: {e}")
        os._exit(NO_SANDBOX)
    init = os.fork()
    if init == 0:
        _init(libc, nonce, int(cpu_s), int(memory_mb), int(disk_mb))
    # a backstop if the caller dies: the caller's own deadline is the limit that counts
    signal.signal(signal.SIGALRM, lambda *_: os.kill(init, signal.SIGKILL))
    signal.alarm(int(float(timeout_s)) + 2)
    _, status = os.waitpid(init, 0)
    os._exit(_exit_code(status))


def _init(libc: ctypes.CDLL, nonce: str, cpu_s: int, memory_mb: int, disk_mb: int) -> None:
    """pid 1 of the new pid namespace: the file system made read-only but for a private /tmp,
    then the code's process run there and reaped; exits with its status."""
    try:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher's kill reaches us
        seccomp = _seccomp_filter()  # (before the nonce: an unknown machine fails closed)
        with open(CODE_FILE, "rb") as f:
            code = f.read()
        _mount(libc, b"none", b"/", None, MS_REC | MS_PRIVATE)  # (nothing we mount leaks out)
        for point in _mount_points():
            try:
                flags = os.statvfs(point).f_flag
            except (FileNotFoundError, PermissionError):  # hidden under another mount, or out of reach
                continue
            # read-only, and no device files: a read-only mount still lets /dev/sda be written
            if flags & (os.ST_RDONLY | os.ST_NODEV) != os.ST_RDONLY | os.ST_NODEV:
                keep = flags & (MS_NOSUID | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)  # (locked: a remount keeps them)
                keep |= MS_RELATIME if flags & os.ST_RELATIME else 0 if flags & os.ST_NOATIME else MS_STRICTATIME
                _mount(libc, None, point.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NODEV | keep)
        _mount(libc, b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=700".encode())
        # best effort: else the host's /proc stays, read-only (other users' files refused as ever)
        libc.mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        os.chdir("/tmp")
        with open(CODE_FILE, "wb") as f:
            f.write(code)
        sys.stdout.write(f"{nonce}\n")  # the sandbox is whole: the caller reads this before any output
        sys.stdout.flush()
        child = os.fork()
        if child == 0:
            _code(libc, seccomp, cpu_s, memory_mb, disk_mb)
        while True:  # (orphans of the code are reparented here: reap them too)
            pid, status = os.wait()
            if pid == child:
                os._exit(_exit_code(status))
    except BaseException as e:
        _tell_parent(f"sandbox setup failed: {type(e).__name__}: {e}")
    os._exit(NO_SANDBOX)


def _mount(
    libc: ctypes.CDLL, src: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None = None
) -> None:
    if libc.mount(src, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target.decode()} ({os.strerror(err)})")


def _mount_points() -> list[str]:
    """Every mount point this process sees (/proc/self/mountinfo's fifth field, unescaped)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def _code(libc: ctypes.CDLL, seccomp: bytes, cpu_s: int, memory_mb: int, disk_mb: int) -> None:
    try:
        for which, value in (
            (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),  # soft: SIGXCPU; hard: SIGKILL
            (resource.RLIMIT_AS, (memory_mb * 2**20,) * 2),
            (resource.RLIMIT_FSIZE, (disk_mb * 2**20,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(which, value)
        program = ctypes.create_string_buffer(seccomp, len(seccomp))
        fprog = _SockFprog(len(seccomp) // 8, ctypes.cast(program, ctypes.c_void_p))
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS / PR_SET_SECCOMP)")
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", CODE_FILE])
    except BaseException as e:
        _tell_parent(f"python tool sandbox could not start the code: {type(e).__name__}: {e}")
    os._exit(NO_SANDBOX)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]  # struct sock_fprog


_SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, (57, 58), 41, 53), "aarch64": (0xC00000B7, 220, (), 198, 199)}
"""Per machine: AUDIT_ARCH_*, the syscall numbers of clone, fork and vfork, socket, socketpair."""


def _seccomp_filter() -> bytes:
    """A seccomp program (classic BPF, ``struct sock_filter`` records) that refuses the code:

    * processes, threads allowed: clone without CLONE_THREAD, fork and vfork fail with EAGAIN (as
      at a process limit); clone3, whose flags a filter cannot read, fails with ENOSYS, so the C
      library falls back to clone;
    * Unix sockets by path, which the network namespace does not cover (``docker.sock``,
      ``/dev/log``): socket(AF_UNIX) and socketpair(AF_UNIX) other than SOCK_STREAM (a datagram
      one can send to a path) fail with EACCES; io_uring (it makes sockets past the filter)
      with ENOSYS;
    * any other ABI (i386, x32 on x86_64): ENOSYS for every call."""
    ld, alu_and, jeq, jge, jset, ret = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, ALU|AND|K, JMP|*|K, RET|K
    allow, eagain, eacces, enosys = 0x7FFF0000, 0x00050000 | 11, 0x00050000 | 13, 0x00050000 | 38
    machine = os.uname().machine
    if machine not in _SECCOMP_ARCH:
        raise OSError(f"no seccomp filter for this machine ({machine}): x86_64 and aarch64 only")
    arch, clone, forks, sock, sockpair = _SECCOMP_ARCH[machine]
    arg0, arg1, af_unix, sock_stream, clone_thread = 16, 24, 1, 1, 0x00010000  # (args' low words)
    p = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, enosys), (ld, 0, 0, 0)]  # seccomp_data.arch, .nr
    p += [(jge, 0, 1, 0x40000000), (ret, 0, 0, enosys)]  # (x32 numbers)
    p += [(jeq, 0, 1, 435), (ret, 0, 0, enosys), (jeq, 0, 1, 425), (ret, 0, 0, enosys)]  # clone3, io_uring_setup
    for nr in forks:
        p += [(jeq, 0, 1, nr), (ret, 0, 0, eagain)]
    # blocks that return on every path, skipped whole for another syscall number
    p += [(jeq, 0, 4, clone), (ld, 0, 0, arg0), (jset, 1, 0, clone_thread), (ret, 0, 0, eagain), (ret, 0, 0, allow)]
    p += [(jeq, 0, 4, sock), (ld, 0, 0, arg0), (jeq, 0, 1, af_unix), (ret, 0, 0, eacces), (ret, 0, 0, allow)]
    p += [(jeq, 0, 5, sockpair), (ld, 0, 0, arg1), (alu_and, 0, 0, 0xF), (jeq, 1, 0, sock_stream)]
    p += [(ret, 0, 0, eacces), (ret, 0, 0, allow), (ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in p)


def _exit_code(status: int) -> int:
    """A wait status as one exit code: the code's own, or 128 + the signal that killed it."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    _launch(sys.argv[1:])
