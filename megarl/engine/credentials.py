"""The run's engine credential and its private weight-staging folder.

Engines accept control requests (generate, weight updates, shutdown) only with the run's
credential: a random token made once per run (``secrets.token_hex``), sent as
``Authorization: Bearer <token>`` and compared in constant time (``hmac.compare_digest``).
It reaches engines through the environment (``MEGARL_ENGINE_TOKEN``, for engines megarl
spawns) or a file only the run's user can read (``MEGARL_ENGINE_TOKEN_FILE``, for engines
started by SLURM or by hand); never on a command line, which every user sees in ``ps``.

The shm transport writes weight buckets into one staging folder per run: made by
``tempfile.mkdtemp`` (mode 0700, unpredictable name) under /dev/shm, marked with its
owner's pid and process start time. Engines read ``/weights/load`` files only from inside it.
A run killed with SIGKILL cannot remove its folder; the next run removes every folder
whose owner is gone (:func:`clean_stale_staging`), and leaves live runs' folders alone.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from megarl.errors import CredentialError

log = logging.getLogger("megarl.credentials")

TOKEN_ENV = "MEGARL_ENGINE_TOKEN"
"""The credential itself (set by megarl for the engines it spawns)."""
TOKEN_FILE_ENV = "MEGARL_ENGINE_TOKEN_FILE"
"""Path of a file holding the credential (mode 0600; SLURM batch scripts, manual engines)."""
STAGING_ENV = "MEGARL_STAGING_DIR"
"""Staging folder shared by attached engines and the trainer (optional; else http)."""
TOKEN_FILE = "engine_token"
"""The credential's file inside the run directory."""
STAGING_PREFIX = "megarl-"
OWNER_FILE = "owner.json"
UNMARKED_GRACE_S = 600.0
"""A folder without an owner marker (a run from before markers, or one being made this
very moment) is removed only once it is this old, seconds."""


def new_token() -> str:
    return secrets.token_hex(32)


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` readable by this user only (created 0600, never widened)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")


def read_token_file(path: Path) -> str:
    """The token in ``path``; refuses a file that other users could read or that is empty."""
    try:
        st = os.stat(path)
        text = path.read_text().strip()
    except OSError as e:
        raise CredentialError(f"cannot read the engine credential file {path}: {e}") from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialError(
            f"engine credential file {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be readable by its"
            " owner only (chmod 600)"
        )
    if st.st_uid != os.getuid():
        raise CredentialError(f"engine credential file {path} belongs to uid {st.st_uid}, not to this user")
    if len(text) < 32:
        raise CredentialError(f"engine credential file {path} holds {len(text)} characters; expected >= 32")
    return text


def env_token() -> str:
    """The credential given through the environment (token, else token file), or ''."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(Path(os.environ[TOKEN_FILE_ENV]))
    return ""


def run_token(run_dir: Path) -> str:
    """This run's credential: the one given through the environment (engines started by
    SLURM share it), else a fresh one saved to ``run_dir/engine_token`` (0600)."""
    token = env_token()
    if not token:
        token = new_token()
        write_token_file(run_dir / TOKEN_FILE, token)
    return token


def auth_header(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def engine_proof(token: str, nonce: str, port: int) -> str:
    """What an engine answers on ``/hello``: HMAC-SHA256 of the client's nonce and the port the
    engine listens on, keyed by the run's token. A process that took an engine's port before
    the engine bound it (any local user can: the port is on the engine's command line) cannot
    compute it, so the client never sends it the credential; the port in the proof stops a
    relay to another engine of the same run."""
    return hmac.new(token.encode(), f"megarl-engine:{port}:{nonce}".encode(), "sha256").hexdigest()


def token_matches(header: str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` header against the run's token."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())


# ---------------------------------------------------------------------- staging folder


def staging_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _start_time(pid: int) -> str:
    """Kernel start time of ``pid`` (field 22 of /proc/pid/stat), '' if it is gone: a pid
    reused by another process has another start time."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return raw.rsplit(")", 1)[1].split()[19]


def make_staging_dir(base: Path | None = None) -> Path:
    """A fresh private staging folder (0700, random name) owned by this process; stale
    folders of dead runs under the same base are removed first."""
    base = base or staging_base()
    clean_stale_staging(base)
    path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=base))
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname()}
    (path / OWNER_FILE).write_text(json.dumps(owner))
    return path


def owner_alive(path: Path) -> bool | None:
    """Whether the process that made staging folder ``path`` still runs (None: no marker)."""
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, start, host = int(owner["pid"]), str(owner["start"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return True  # another host's process (shared /tmp): not ours to judge
    return _start_time(pid) == start


def clean_stale_staging(base: Path | None = None) -> list[Path]:
    """Remove this user's staging folders whose owner process is gone. Returns them."""
    base = base or staging_base()
    removed = []
    for path in sorted(base.glob(STAGING_PREFIX + "*")):
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue  # a symlink, a file, or another user's folder
        alive = owner_alive(path)
        if alive or (alive is None and time.time() - st.st_mtime < UNMARKED_GRACE_S):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed stale staging folder %s (%s)", path, "owner gone" if alive is False else "no owner marker")
        removed.append(path)
    return removed


def private_dir_problem(path: Path) -> str:
    """Why ``path`` is not a safe staging folder (not a real folder, another owner, open to
    others), or ''."""
    try:
        st = path.lstat()
    except OSError as e:
        return f"staging folder {path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"staging folder {path} is not a directory (a symlink or a file)"
    if st.st_uid != os.getuid():
        return f"staging folder {path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o077:
        return f"staging folder {path} has mode {stat.S_IMODE(st.st_mode):o}; it must be 700"
    return ""


def inside(path: str, root: Path) -> Path:
    """``path`` resolved (symlinks followed); ValueError unless it is a regular file
    inside ``root``."""
    real = Path(os.path.realpath(path))
    top = Path(os.path.realpath(root))
    if os.path.commonpath([real, top]) != str(top):
        raise ValueError(f"{path} is outside the staging folder {top}")
    if not real.is_file():
        raise ValueError(f"{path} is not a regular file in the staging folder {top}")
    return real
