"""The engine control plane against a real vLLM engine server process (issue 14, D7 + B4).

* Every route of the route table answers 401 to a request from another process without
  the run's credential or with a wrong one, and serves it with the right one; ``/health``
  tells only liveness and version; ``/shutdown`` with a wrong credential leaves it running.
* ``/weights/load`` reads only inside the run's private staging folder (0700, random name):
  a path outside, a ``..`` escape and a symlink pointing out are refused.
* A body over the route's limit gets 413 after only its headers were sent (not read).
* B4: an engine exits when the process that started it is SIGKILLed (parent watch) and when
  that process stops sending heartbeats (lease); the staging folder the killed process left
  behind is removed at the next start, a live run's folder is not.
"""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megarl.engine import credentials
from megarl.engine.credentials import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    CredentialError,
    clean_stale_staging,
    make_staging_dir,
    read_token_file,
    run_token,
)
from megarl.engine.http import Limits
from megarl.engine.routes import ROUTES
from megarl.engine.staging import MANIFEST
from megarl.errors import RolloutError, WeightSyncError
from megarl.fleet.fleet import Fleet
from tests.helpers import ROOT, tiny_hf_model

# Runs in a separate process: a stranger on the node, knowing only the address (and maybe a token).
PROBE = r"""
import json, os, sys, urllib.error, urllib.request
from megarl.engine.routes import ROUTES
from megarl.errors import RolloutError
addr, skip = os.environ["ADDR"], set(sys.argv[1:])
codes = {}
for path, method in ROUTES.items():
    if path in skip:
        continue
    headers = {"Content-Type": "application/json"}
    if os.environ.get("PROBE_TOKEN"):
        headers["Authorization"] = "Bearer " + os.environ["PROBE_TOKEN"]
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(f"http://{addr}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            codes[path] = [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        codes[path] = [e.code, json.loads(e.read() or b"{}")]
print(json.dumps(codes))
"""


def _probe(address: str, token: str, skip: tuple[str, ...] = ()) -> dict[str, list]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env |= {"ADDR": address, "PROBE_TOKEN": token, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, *skip], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_hf_model(tmp_path_factory.mktemp("sec") / "hf", vocab=64)
    weights = load_file(str(hf / "model.safetensors"))
    (hf / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in weights.items()}))
    return hf


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory):
    f = Fleet.start_local(model, 1, 1, 0.25, tmp_path_factory.mktemp("logs"), seed=0, start_timeout_s=300, lease_s=0)
    yield f
    f.shutdown()


def test_every_route_needs_the_credential(fleet: Fleet) -> None:
    e = fleet.engines[0]
    assert len(ROUTES) == 17
    for token in ("", "0" * 64, e.token[:-1] + ("0" if e.token[-1] != "0" else "1")):
        codes = _probe(e.address, token)
        assert set(codes) == set(ROUTES)
        assert {p: c for p, (c, _) in codes.items() if c != 401} == {}, token
        assert all(body == {"error": "missing or wrong credential"} for _, body in codes.values())
    assert e.alive() and e.health() == {"ok": True, "version": -1}  # the refused /shutdown did nothing
    right = _probe(e.address, e.token, skip=("/shutdown",))
    assert set(right) == set(ROUTES) - {"/shutdown"}
    assert [p for p, (c, _) in right.items() if c == 401] == []
    # /health: liveness and weight version, nothing else; /info carries what the trainer needs
    assert right["/health"] == [200, {"ok": True, "version": -1}]
    assert right["/info"][0] == 200 and right["/info"][1]["tp"] == 1 and right["/info"][1]["pid"] == e.proc.pid
    assert right["/heartbeat"] == [200, {"ok": True}]
    assert right["/sleep"][0] == 409  # reached the engine (no sleep mode on CPU), not refused at the door
    assert fleet.engine_tps() == [1]


def test_requests_with_bad_token_ids_are_refused_and_the_engine_keeps_serving(fleet: Fleet) -> None:
    """An id outside the vocabulary (64), negative, or not an int used to fail inside vLLM's step
    loop and leave its request scheduled: every later generation hung while /health said ok.
    Now each is refused (409) naming the prompt and the id, and the engine still serves."""
    e = fleet.engines[0]
    good = {"prompts": [[1, 5, 7]], "n": 2, "max_tokens": 3, "seeds": [1]}
    version, before, _ = e.generate(good, 60)
    cases = [
        ({"prompts": [[1, 2, 64]], "max_tokens": 4}, "prompts[0] holds 64, not a token id in [0, 64)"),
        ({"prompts": [[3], [1, -2]], "max_tokens": 4}, "prompts[1] holds -2, not a token id in [0, 64)"),
        ({"prompts": [[1, 2, "x"]], "max_tokens": 4}, "prompts[0] holds 'x', not a token id"),
        ({"prompts": "abc", "max_tokens": 4}, "prompts must be a non-empty list of token-id lists, got str"),
        ({"prompts": [[]], "max_tokens": 4}, "prompts[0] must be a non-empty list of token ids"),
    ]
    for body, message in cases:
        with pytest.raises(RolloutError, match=re.escape(message)):
            e.generate(body, 60)
    with pytest.raises(RolloutError, match=re.escape("sequences[0] holds 99, not a token id in [0, 64)")):
        e.post("/logprobs", {"sequences": [[1, 99]]}, 60)
    assert e.health() == {"ok": True, "version": version}
    again = e.generate(good, 60)  # seeded: the very same samples, at once
    assert again[1] == before


def test_load_reads_only_the_staging_folder(fleet: Fleet, model: Path, tmp_path: Path) -> None:
    staging = fleet.staging_dir
    assert staging is not None and staging.name.startswith("megarl-") and len(staging.name) >= 12
    assert stat.S_IMODE(staging.stat().st_mode) == 0o700
    outside = tmp_path / "model.safetensors"
    save_file(load_file(str(model / "model.safetensors")), str(outside))
    link = staging / "escape.safetensors"
    link.symlink_to(outside)
    for path, why in [
        (outside, "outside the staging folder"),
        (staging / ".." / tmp_path.name / outside.name, "outside the staging folder"),
        (link, "outside the staging folder"),
        (staging / "missing.safetensors", "not a regular file"),
    ]:
        fleet.begin_update(5)
        with pytest.raises(WeightSyncError, match=f"/weights/load refused: .*{why}"):
            fleet.load_files(5, [str(path)])
        fleet.abort_update()
    assert fleet.versions() == [-1]
    inside = staging / "v5" / "bucket0.safetensors"
    inside.parent.mkdir()
    inside.write_bytes(outside.read_bytes())
    fleet.update_weights(5, [str(inside)])
    assert fleet.versions() == [5]


def _raw_post(address: str, path: str, token: str, length: int, send: bytes) -> tuple[str, float]:
    """Send headers declaring ``length`` bytes but only ``send``; the status line and the time
    the answer took."""
    host, port = address.rsplit(":", 1)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(head + send)
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        return reply.split(b"\r\n", 1)[0].decode(), time.monotonic() - t0


def test_oversized_bodies_get_413_unread(fleet: Fleet, model: Path) -> None:
    e = fleet.engines[0]
    manifest = json.loads((model / MANIFEST).read_text())
    limit = Limits.for_manifest(manifest, 64 << 20).max_weights_bytes
    assert limit == 4 * sum(load_file(str(model / "model.safetensors"))[k].numel() for k in manifest) + (
        1 << 20
    ) + 512 * len(manifest)
    status, took = _raw_post(e.address, "/weights/load_bytes?version=9", e.token, limit + 1, b"x" * 1024)
    assert status.split()[1] == "413" and took < 10, (status, took)
    status, took = _raw_post(e.address, "/generate", e.token, (64 << 20) + 1, b"{" * 1024)
    assert status.split()[1] == "413" and took < 10, (status, took)
    status, _ = _raw_post(e.address, "/weights/load_bytes?version=9", "wrong", 10 << 30, b"x" * 1024)
    assert status.split()[1] == "401"
    # exactly at the limit the body is read and judged on its content
    status, _ = _raw_post(e.address, "/weights/load_bytes?version=9", e.token, limit, b"\0" * limit)
    assert status.split()[1] == "409"
    assert e.health() is not None


def test_credential_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    token = run_token(tmp_path)
    f = tmp_path / "engine_token"
    assert len(token) == 64 and f.read_text().strip() == token and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert run_token(tmp_path) != token  # a fresh one per run start
    f.chmod(0o640)
    with pytest.raises(CredentialError, match=r"engine_token has mode 640; it must be readable by its owner only"):
        read_token_file(f)
    f.chmod(0o600)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(f))
    assert run_token(tmp_path / "other") == f.read_text().strip()  # SLURM: the batch script's file wins


def test_engine_refuses_to_start_without_credential_or_with_an_open_staging_folder(model: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)} | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megarl.engine.server", "--model", str(model), "--port", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no credential: set MEGARL_ENGINE_TOKEN_FILE" in out.stderr
    loose = tmp_path / "token"
    loose.write_text("a" * 64)
    loose.chmod(0o644)
    out = subprocess.run(cmd, env=env | {TOKEN_FILE_ENV: str(loose)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "has mode 644; it must be readable by its owner only" in out.stderr
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    out = subprocess.run(
        [*cmd, "--staging-dir", str(shared)],
        env=env | {TOKEN_ENV: "a" * 64},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and f"staging folder {shared} has mode 755; it must be 700" in out.stderr


def _gone(pid: int) -> bool:
    """Exited (a zombie whose new parent has not reaped it yet counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _start_parent(model: Path, tmp_path: Path, lease_s: float, heartbeat_s: float = 5.0) -> tuple[subprocess.Popen, dict]:
    out = tmp_path / "parent.json"
    env = dict(os.environ) | {"PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests/engine/fleet_parent.py"),
            "--model",
            str(model),
            "--lease-s",
            str(lease_s),
            "--heartbeat-s",
            str(heartbeat_s),
            "--out",
            str(out),
        ],
        env=env,
    )
    deadline = time.monotonic() + 300
    while not out.exists():
        assert parent.poll() is None and time.monotonic() < deadline, "the parent did not start its fleet"
        time.sleep(0.5)
    return parent, json.loads(out.read_text())


def _wait_gone(pid: int, within_s: float) -> float:
    t0 = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - t0 < within_s, f"engine {pid} still running {within_s}s after losing its trainer"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_sigkilled_parent_takes_its_engine_and_next_start_cleans_its_folder(
    fleet: Fleet, model: Path, tmp_path: Path
) -> None:
    parent, info = _start_parent(model, tmp_path, lease_s=600)  # the lease is not what ends it here
    staging = Path(info["staging"])
    assert not _gone(info["engine_pid"]) and staging.is_dir()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    took = _wait_gone(info["engine_pid"], within_s=45)
    print(f"engine exited {took:.1f}s after its parent was SIGKILLed")
    assert staging.is_dir()  # SIGKILL: nobody cleaned up ...
    live = fleet.staging_dir
    nxt = make_staging_dir()  # ... until the next start
    try:
        assert not staging.exists()
        assert live is not None and live.is_dir()  # a live run's folder stays
    finally:
        shutil.rmtree(nxt)


def test_lease_ends_an_engine_whose_trainer_stopped_talking(model: Path, tmp_path: Path) -> None:
    # the trainer's defaults are a 120 s lease and a heartbeat every 5 s; the same 3+ heartbeats
    # per lease here, on a 6 s lease, so the test waits seconds instead of minutes
    lease_s, heartbeat_s = 6, 1.5
    parent, info = _start_parent(model, tmp_path, lease_s=lease_s, heartbeat_s=heartbeat_s)
    try:
        time.sleep(2 * lease_s)  # heartbeats keep it alive past its lease
        assert not _gone(info["engine_pid"])
        os.kill(parent.pid, signal.SIGSTOP)  # alive (same parent pid) but silent, like a hung remote trainer
        took = _wait_gone(info["engine_pid"], within_s=lease_s + 45)
        print(f"engine exited {took:.1f}s after its trainer went silent (lease {lease_s} s)")
        assert took >= lease_s - heartbeat_s - 0.5  # the lease runs from the last heartbeat, not from the start
        log = (tmp_path / "logs" / "engine0.log").read_text()
        assert f"exiting: no authenticated request for {lease_s}s (lease)" in log
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    clean_stale_staging()
    assert not Path(info["staging"]).exists()


def test_stale_folder_markers(tmp_path: Path) -> None:
    """Folders of dead owners go, live and foreign-host ones stay, unmarked ones after a grace period."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = {}
    for name, owner in [
        ("dead", {"pid": dead.pid, "start": "1", "host": socket.gethostname()}),
        ("reused", {"pid": os.getpid(), "start": "1", "host": socket.gethostname()}),
        ("live", {"pid": os.getpid(), "start": credentials._start_time(os.getpid()), "host": socket.gethostname()}),
        ("elsewhere", {"pid": 1, "start": "1", "host": "another-node"}),
    ]:
        d = tmp_path / f"megarl-{name}"
        d.mkdir()
        (d / credentials.OWNER_FILE).write_text(json.dumps(owner))
        folders[name] = d
    young, old = tmp_path / "megarl-young", tmp_path / "megarl-legacy"
    young.mkdir()
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "megarl-link").symlink_to(folders["live"])
    removed = clean_stale_staging(tmp_path)
    assert sorted(p.name for p in removed) == ["megarl-dead", "megarl-legacy", "megarl-reused"]
    assert folders["live"].is_dir() and folders["elsewhere"].is_dir() and young.is_dir()
