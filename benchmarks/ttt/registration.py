"""The study's pre-registration (``benchmarks/ttt/registration.toml``): parsed, checked, and the
refusal to run judged seeds over a registration that is not committed.

A registration is only a pre-registration if what it says was fixed before the judged runs:
:func:`committed` asks git whether the file differs from HEAD (or is untracked), and the study
runs its judged seeds only when it does not. The clocks file's sha256 must be the one registered
(a changed cost model is a new study). Errors name the file and the field.
"""

from __future__ import annotations

import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.ttt.clocked import CPU, clocks_sha256

DEFAULT = Path(__file__).resolve().parent / "registration.toml"


class RegistrationError(ValueError):
    """A registration file that is malformed, or that may not be used for judged runs."""


@dataclass(frozen=True)
class Registration:
    path: Path
    clocks_file: Path
    clocks_sha256: str
    clocks: list[str]
    pilot: list[int]
    judged: list[int]
    gains: list[float]
    warm_start_steps: int
    base_sha256: str
    """Of the pinned base's hf_final files; '' until the pilot built it."""
    start_prompts: int
    line_prompts: list[int]
    lr_mults: list[float]
    lr_ref: float
    p_ref: int
    coord_range: tuple[int, int]
    coord_starts: list[int]
    max_samples: int
    eval_samples: int
    bars: dict[str, Any]
    common_sets: list[str] = field(default_factory=list)
    val_metric: str = "reward"
    """``train.val_metric`` of the base and every run (the targets are in its units)."""


def _get(doc: dict[str, Any], path: Path, dotted: str, kind: type | tuple[type, ...]) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise RegistrationError(f"{path}: missing {dotted}")
        cur = cur[part]
    if not isinstance(cur, kind) or isinstance(cur, bool):
        raise RegistrationError(f"{path}: {dotted} = {cur!r} is not {kind}")
    return cur


def _ints(doc: dict[str, Any], path: Path, dotted: str) -> list[int]:
    xs = _get(doc, path, dotted, list)
    if not xs or not all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        raise RegistrationError(f"{path}: {dotted} = {xs!r} must be a non-empty list of integers")
    return list(xs)


def load(path: Path = DEFAULT, root: Path | None = None) -> Registration:
    """Parse and check ``path``; the clocks file is resolved against ``root`` (default: this repository)."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RegistrationError(f"{path}: {e}") from e
    root = root or Path(__file__).resolve().parents[2]
    clocks_file = root / _get(doc, path, "clocks.file", str)
    sha = _get(doc, path, "clocks.sha256", str)
    if clocks_sha256(clocks_file) != sha:
        raise RegistrationError(
            f"{path}: clocks.sha256 = {sha[:12]}… but {clocks_file} has sha256 {clocks_sha256(clocks_file)[:12]}… "
            "(the cost model changed after registration: register a new study)"
        )
    pilot, judged = _ints(doc, path, "seeds.pilot"), _ints(doc, path, "seeds.judged")
    if set(pilot) & set(judged):
        raise RegistrationError(f"{path}: seeds.judged shares {sorted(set(pilot) & set(judged))} with seeds.pilot")
    d = "design."
    reg = Registration(
        path=path,
        clocks_file=clocks_file,
        clocks_sha256=sha,
        clocks=list(_get(doc, path, "clocks.names", list)),
        pilot=pilot,
        judged=judged,
        gains=[float(g) for g in _get(doc, path, "targets.gains", list)],
        warm_start_steps=_get(doc, path, "base.warm_start_steps", int),
        base_sha256=_get(doc, path, "base.sha256", str),
        start_prompts=_get(doc, path, d + "start_prompts", int),
        line_prompts=_ints(doc, path, d + "line_prompts"),
        lr_mults=[float(m) for m in _get(doc, path, d + "lr_mults", list)],
        lr_ref=float(_get(doc, path, d + "lr_ref", (int, float))),
        p_ref=_get(doc, path, d + "p_ref", int),
        coord_range=tuple(_ints(doc, path, d + "coord_range")),  # type: ignore[arg-type]
        coord_starts=_ints(doc, path, d + "coord_starts"),
        max_samples=_get(doc, path, d + "max_samples", int),
        eval_samples=_get(doc, path, d + "eval_samples", int),
        bars=_get(doc, path, "bars", dict),
        common_sets=[str(s) for s in _get(doc, path, "common_sets", list)],
        val_metric=str(doc.get("targets", {}).get("val_metric", "reward")),
    )
    _check(reg)
    return reg


def _check(reg: Registration) -> None:
    p = reg.path
    if reg.start_prompts not in reg.line_prompts:
        raise RegistrationError(f"{p}: design.start_prompts = {reg.start_prompts} is not on design.line_prompts")
    if len(reg.lr_mults) != 3 or 1.0 not in reg.lr_mults:
        raise RegistrationError(f"{p}: design.lr_mults = {reg.lr_mults} must be 3 multipliers including 1.0")
    if CPU not in reg.clocks:
        raise RegistrationError(f"{p}: clocks.names = {reg.clocks} must include 'cpu' (the control)")
    if len(reg.coord_range) != 2 or len(reg.coord_starts) != 2:
        raise RegistrationError(f"{p}: design.coord_range and design.coord_starts take two prompt counts each")
    for v in ("v1", "v2", "v3"):
        if v not in reg.bars:
            raise RegistrationError(f"{p}: missing bars.{v}")
    missing = [c for c in reg.clocks if c not in reg.bars["v1"]]
    if missing:
        raise RegistrationError(f"{p}: bars.v1 has no bar for clocks {missing}")
    if reg.val_metric not in ("reward", "answer_prob"):
        raise RegistrationError(f"{p}: targets.val_metric = {reg.val_metric!r} must be 'reward' or 'answer_prob'")
    bad = [s for s in reg.common_sets if "=" not in s]
    if bad:
        raise RegistrationError(f"{p}: common_sets entries {bad} are not KEY=VALUE")


def git_state(path: Path) -> tuple[bool, str]:
    """(committed, HEAD commit): committed = git knows the file and it has no changes against
    HEAD, staged or not. Not in a git work tree → (False, '')."""
    cwd = path.resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return False, ""
    status = git("status", "--porcelain", "--", path.name)
    return status.returncode == 0 and status.stdout.strip() == "", head.stdout.strip()


def require_committed(reg: Registration) -> str:
    """The commit the judged runs are registered at; raises when the file is not committed."""
    ok, head = git_state(reg.path)
    if not ok:
        raise RegistrationError(
            f"{reg.path} has uncommitted changes (or is not tracked by git): commit the registration "
            "before running the judged seeds — pre-registration means it is fixed first"
        )
    return head
