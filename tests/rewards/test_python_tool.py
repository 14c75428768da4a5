"""The ``python`` tool (``megarl.rewards.python_tool``) with real subprocesses and namespaces:
output comes back; the wall-time, CPU, memory, output and file limits end a call with an error
naming them; no network (a server the test runs is reachable outside, not inside); no inherited
environment; a read-only file system but for a private /tmp that dies with the call; nothing
the code starts outlives it; no namespaces → the code is not run. Then ``PythonEnv`` driven with
the text a model would write."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megarl.rewards.env import Step
from megarl.rewards.env_spec import import_env
from megarl.rewards.python_tool import PythonLimits, run_python
from megarl.rewards.tool_calls import HermesParser, ToolCall
from megarl.rewards.tool_env import PythonEnv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")


def test_prints_come_back_and_errors_say_what_failed() -> None:
    assert run_python("print(sum(range(10)))\nimport sys; print('to stderr', file=sys.stderr)") == "45\nto stderr\n"
    assert run_python("import fractions; print(fractions.Fraction(1, 3) + 1)") == "4/3\n"
    out = run_python("x = 1\nraise ValueError('boom')")
    assert out.startswith("error: exit code 1\nTraceback") and out.endswith("ValueError: boom\n")
    assert 'File "/tmp/main.py", line 2' in out  # (the same path every call: reproducible observations)
    assert run_python("import sys; print('bye'); sys.exit(3)") == "error: exit code 3\nbye\n"
    assert run_python("import numpy").endswith("ModuleNotFoundError: No module named 'numpy'\n")  # stdlib only
    out = run_python("print('\ud800')")  # (a lone surrogate, as a tool call's JSON may carry)
    assert out.startswith("error: exit code 1\nSyntaxError: Non-UTF-8 code starting with '\\xed' in file /tmp/main.py")


def test_a_sleeping_loop_is_killed_at_the_wall_limit_with_what_it_printed() -> None:
    t0 = time.monotonic()
    out = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", PythonLimits(timeout_s=1))
    took = time.monotonic() - t0
    assert out == "error: timed out after 1 s (the wall-time limit); the code was killed\nstarted\n"
    assert 1.0 <= took < 2.5, took


def test_a_busy_loop_is_killed_at_the_cpu_limit() -> None:
    t0 = time.monotonic()
    out = run_python("while True:\n    pass", PythonLimits(cpu_s=1, timeout_s=10))
    took = time.monotonic() - t0
    assert out == "error: used more than 1 s of CPU time (the CPU limit); the code was killed"
    assert 1.0 <= took < 8.0, took  # (before the 10 s wall limit, on a loaded machine too)


def test_a_memory_bomb_fails_with_a_memory_error() -> None:
    out = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))", PythonLimits(memory_mb=128))
    assert out.startswith("error: out of memory (the 128 MiB memory limit)\nTraceback") and out.endswith(
        "MemoryError\n"
    )
    assert run_python("x = bytearray(100 * 2**20); print(len(x))", PythonLimits(memory_mb=256)) == "104857600\n"


def test_an_output_flood_is_cut_at_the_byte_limit_and_killed() -> None:
    t0 = time.monotonic()
    out = run_python("while True:\n    print('x' * 999)", PythonLimits(output_bytes=5000, timeout_s=10))
    head = "error: output passed 5000 bytes (the output limit); the code was killed\n"
    assert out.startswith(head) and out[len(head) :] == ("x" * 999 + "\n") * 5 and time.monotonic() - t0 < 5.0
    assert run_python("print('é' * 3000)", PythonLimits(output_bytes=5001)).endswith(
        "é" * 2500 + "\ufffd"
    )  # (cut mid-char)


def test_no_network_inside_while_the_same_server_answers_outside() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # outside: it connects
        server.settimeout(2)
        server.accept()[0].close()
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2)\n"
            "        print(addr[0], 'connected')\n"
            "    except OSError as e:\n"
            "        print(addr[0], type(e).__name__, e.errno)\n"
            "print([name for _, name in socket.if_nameindex()])\n"
        )
        out = run_python(code)
        unreachable = 101  # ENETUNREACH: the namespace has only a loopback, and it is down
        assert out == (
            f"127.0.0.1 OSError {unreachable}\n1.1.1.1 OSError {unreachable}\n8.8.8.8 OSError {unreachable}\n['lo']\n"
        )
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the server from inside
    finally:
        server.close()


def test_no_unix_socket_by_path_while_a_server_answers_outside() -> None:
    # a pathname socket is no network: the namespace does not cover it (docker.sock, /dev/log)
    path = f"/dev/shm/megarl-test-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    try:
        with socket.socket(socket.AF_UNIX) as c:  # outside: it connects
            c.connect(path)
            server.accept()[0].close()
        code = (
            "import asyncio, socket\n"
            "for make in (lambda: socket.socket(socket.AF_UNIX),\n"
            "             lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)):\n"
            "    try:\n"
            "        make()\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__, e.errno)\n"
            "a, b = socket.socketpair()\n"  # (a connected stream pair reaches no path: asyncio's own)
            "a.sendall(b'pair')\n"
            "print(b.recv(4), asyncio.run(asyncio.sleep(0, 'asyncio')))\n"
            f"socket.socket(socket.AF_UNIX).connect({path!r})\n"
        )
        out = run_python(code)
        assert out.startswith("error: exit code 1\nPermissionError 13\nPermissionError 13\nb'pair' asyncio\n")
        assert out.endswith("PermissionError: [Errno 13] Permission denied\n")
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
        os.unlink(path)


def test_the_code_sees_no_environment_of_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGARL_TEST_SECRET", "hunter2-token")
    code = (
        "import os\nprint(sorted(os.environ))\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        f"print(os.path.exists('/proc/{os.getpid()}/environ'))\n"
        "print(sorted(os.listdir('/proc/self/fd')))\n"
    )
    # only the variable Python's own UTF-8 locale coercion sets; its processes: init (1) and itself;
    # its files: /dev/null, the pipe twice, and the listing's own descriptor
    assert run_python(code) == "['LC_CTYPE']\n['1', '2']\nFalse\n['0', '1', '2', '3']\n"


def test_files_are_read_only_but_a_private_tmp_that_dies_with_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the call stages its code
    outside = Path(__file__).with_name("_written_by_the_python_tool")
    code = (
        "import os\nopen('note.txt', 'w').write('kept?')\nprint(os.getcwd(), sorted(os.listdir('.')))\n"
        f"open({str(outside)!r}, 'w')\n"
    )
    out = run_python(code)
    assert out.startswith("error: exit code 1\n/tmp ['main.py', 'note.txt']\nTraceback")
    assert out.endswith(f"OSError: [Errno 30] Read-only file system: {str(outside)!r}\n")
    assert not outside.exists() and list(tmp_path.iterdir()) == []  # the staging directory is gone
    assert run_python("import os; print(sorted(os.listdir('/tmp')))") == "['main.py']\n"
    # no device files either: a read-only mount alone would let a block device be written
    assert run_python("open('/dev/null', 'w')").endswith("PermissionError: [Errno 13] Permission denied: '/dev/null'\n")
    out = run_python("open('big', 'wb').write(b'x' * 3 * 2**20)", PythonLimits(disk_mb=2))
    assert out.endswith("OSError: [Errno 28] No space left on device\n")


def test_the_code_cannot_undo_the_sandbox() -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(None, b'/', None, 32 | 4096, None), ctypes.get_errno())\n"  # remount / rw
        "print(libc.umount2(b'/tmp', 2), ctypes.get_errno())\n"
        "print(libc.unshare(0x40000000), ctypes.get_errno())\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0], os.getuid())\n"
        "try:\n"  # a system-wide setting: the trainer's user (root) could write it, were /proc writable
        "    open('/proc/sys/vm/overcommit_memory', 'r+')\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    # EPERM; no capabilities; EROFS
    assert run_python(code) == "-1 1\n-1 1\n-1 1\n0000000000000000 1000\n30\n"


def test_the_code_makes_threads_but_no_processes_and_nothing_outlives_the_call() -> None:
    code = (
        "import os, subprocess, threading\n"
        "for start in (os.fork, lambda: subprocess.run(['true'])):\n"
        "    try:\n"
        "        start()\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, e.errno)\n"
        "squares = []\n"
        "threads = [threading.Thread(target=lambda i=i: squares.append(i * i)) for i in range(4)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(sorted(squares))\n"
    )
    # EAGAIN, as at a process limit (for root too: the kernel exempts it from RLIMIT_NPROC)
    assert run_python(code) == "BlockingIOError 11\nBlockingIOError 11\n[0, 1, 4, 9]\n"
    sleeper = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)"
    assert run_python(sleeper, PythonLimits(timeout_s=1)).startswith("error: timed out after 1 s")
    time.sleep(0.2)
    assert _sandboxed_processes() == []


def _sandboxed_processes() -> list[int]:
    """Host pids of processes running a sandboxed main.py (its command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"-u\0main.py\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_no_namespaces_means_the_code_is_not_run() -> None:
    # a user namespace allowed no nested user namespaces: the launcher's unshare fails (ENOSPC)
    script = (
        "open('/proc/sys/user/max_user_namespaces', 'w').write('0')\n"
        "import json; from megarl.rewards.python_tool import run_python\n"
        "print(json.dumps(run_python('print(\"RAN\")')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == (
        "error: the python tool could not isolate the code (cannot make the namespaces: [Errno 28] "
        "unshare(user, network, pid, mount namespaces): No space left on device); it was not run"
    )


def test_python_env_runs_a_tool_call_turn_by_turn() -> None:
    env, p = import_env("python")(), HermesParser()
    assert isinstance(env, PythonEnv) and env.tools[0]["function"]["name"] == "python"
    assert env.tools[0]["function"]["parameters"]["required"] == ["code"]
    assert env.reset({"prompt": "What is 2**100 mod 97?"}) is None
    s = env.step("Let me compute." + p.render(ToolCall("python", {"code": "print(pow(2, 100, 97))"})))
    assert s == Step(
        [{"role": "tool", "name": "python", "content": "16\n"}], 0.0, False, {"tool_calls": 1, "tool_errors": 0}
    )
    s = env.step(p.render(ToolCall("python", {"code": "1/0"})) + p.render(ToolCall("python", {"src": "1"})))
    assert [m["content"].splitlines()[-1] for m in s.observation] == [
        "ZeroDivisionError: division by zero",
        'error: python takes one argument, "code" (a string)',
    ]
    assert s.info == {"tool_calls": 2, "tool_errors": 2}
    assert env.step("The answer is 16.") == Step("", 0.0, True, {"tool_calls": 0, "tool_errors": 0})


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"PythonLimits.memory_mb=0: must be a positive number"):
        PythonLimits(memory_mb=0)
    with pytest.raises(ValueError, match=r"PythonLimits.timeout_s=True"):
        PythonLimits(timeout_s=True)
