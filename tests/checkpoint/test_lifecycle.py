"""Checkpoint life cycle: a crash mid-save leaves the previous checkpoint current and
loadable; keep-last-K; specific errors (CheckpointError) for bad loads; the manifest of
every commit, and resume skipping a checkpoint whose files were damaged afterwards."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.checkpoint.integrity import MANIFEST, CheckpointError, choose_resume, problem
from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/checkpoint/worker_lifecycle.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("lifecycle")
    hf = tiny_hf_model(base / "hf")
    root = base / "ckpt"
    args = ["--hf", str(hf), "--root", str(root), "--out", str(base)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    crash = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(WORKER),
            *args,
            "--phase",
            "crash",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    after_crash = {
        "rc": crash.returncode,
        "listing": sorted(p.name for p in root.iterdir()),
        "latest": (root / "latest").read_text(),
        "log": crash.stdout[-3000:] + crash.stderr[-3000:],
    }
    torchrun(WORKER, 1, [*args, "--phase", "verify"])
    return {"crash": after_crash, "info": json.loads((base / "verify.json").read_text()), "base": base}


def test_crash_mid_save_keeps_previous_checkpoint(run: dict) -> None:
    crash = run["crash"]
    assert crash["rc"] != 0, crash["log"]
    assert "AssertionError" not in crash["log"]  # it died in the save, not after it
    # every file of step 2 was written, but it never became a checkpoint
    assert crash["listing"] == ["latest", "step_00000001", "step_00000002.tmp"], crash["listing"]
    assert crash["latest"] == "step_00000001"
    info = run["info"]
    assert info["latest_before"].endswith("step_00000001")
    assert info["extra"] == {"step": 1}
    saved = load_file(str(run["base"] / "step1.safetensors"))
    loaded = load_file(str(run["base"] / "loaded.safetensors"))
    assert set(saved) == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert "incomplete" in info["partial_error"] or "no complete checkpoint" in info["partial_error"]


def test_keep_last_k(run: dict) -> None:
    listings = run["info"]["listings"]
    assert listings[0] == ["latest", "step_00000001", "step_00000002"]  # the crashed .tmp is gone
    assert listings[1] == ["latest", "step_00000002", "step_00000003"]
    assert listings[-1] == ["latest", "step_00000004", "step_00000005"]
    assert run["info"]["latest_after"] == "step_00000005"
    assert run["info"]["extra_latest"] == {"step": 5}
    assert run["info"]["extra_by_dir"] == {"step": 4}


@pytest.mark.parametrize(
    "key, needles",
    [
        ("shape_error", ["hidden_size=128", "hidden_size=64"]),
        ("name_error", ["no model 'critic'", "actor"]),
        ("missing_error", ["does not exist"]),
        ("marker_error", ["incomplete", "COMPLETE"]),
        ("empty_root_error", ["no complete checkpoint"]),
        ("no_optimizer_error", ["without optimizer state", "load_optimizer=False"]),
    ],
)
def test_errors_are_specific(run: dict, key: str, needles: list[str]) -> None:
    msg = run["info"][key]
    for n in needles:
        assert n in msg, msg


def test_weights_only_checkpoint_loads_without_optimizer(run: dict) -> None:
    assert run["info"]["weights_only_extra"] == {"step": 0}


@pytest.mark.parametrize("dist_opt", [False, True])
def test_checkpoint_before_first_step_resumes(run: dict, dist_opt: bool) -> None:
    fresh = run["info"][f"fresh_{dist_opt}"]
    assert fresh["losses"][0] == fresh["losses"][1]
    assert fresh["maxdiff"] == 0.0


# ---------------------------------------------------------------- integrity (files of the real saves above)


def test_manifest_records_every_file_of_a_real_checkpoint(run: dict) -> None:
    ckpt = run["base"] / "ckpt" / "step_00000005"
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST, "COMPLETE"}
    assert set(files) == on_disk and {"actor/.metadata", "actor/__0_0.distcp", "state.json", "rng/rank0.pt"} <= on_disk
    for rel, recorded in files.items():
        data = (ckpt / rel).read_bytes()
        assert recorded == {"size": len(data), "crc32": zlib.crc32(data)}, rel
    assert problem(ckpt) is None


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


DAMAGE = {
    "truncated_tensor": (lambda c: _truncate(c / "actor/__0_0.distcp"), r"actor/__0_0\.distcp has \d+ bytes, \d+ were"),
    "emptied_state": (lambda c: (c / "state.json").write_text(""), r"state\.json has 0 bytes, \d+ were written"),
    "flipped_bit": (lambda c: _flip(c / "actor/__0_0.distcp"), r"actor/__0_0\.distcp has CRC-32 0x[0-9a-f]{8}, 0x"),
    "deleted_rng": (lambda c: (c / "rng/rank0.pt").unlink(), r"rng/rank0\.pt is missing"),
    "bad_manifest": (lambda c: (c / MANIFEST).write_text("{"), r"MANIFEST\.json is unreadable \(JSONDecodeError"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_skips_a_damaged_checkpoint(run: dict, tmp_path: Path, damage: str, caplog) -> None:
    shutil.copytree(run["base"] / "ckpt", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "step_00000005"
    hurt, pattern = DAMAGE[damage]
    hurt(newest)
    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert choose_resume(tmp_path, "auto") == tmp_path / "checkpoints" / "step_00000004"
    assert re.search(rf"checkpoint {re.escape(str(newest))} is corrupt \({pattern}.*falling back", caplog.text)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {re.escape(str(newest))} is corrupt: {pattern}"):
        choose_resume(tmp_path, str(newest))
    hurt(tmp_path / "checkpoints" / "step_00000004")  # none left: an error, not a fresh start
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*step_00000005: .*step_00000004: "):
        choose_resume(tmp_path, "auto")


def test_checkpoint_without_manifest_is_accepted_with_a_warning(run: dict, tmp_path: Path, caplog) -> None:
    old = tmp_path / "checkpoints" / "step_00000005"
    shutil.copytree(run["base"] / "ckpt" / "step_00000005", old)
    (old / MANIFEST).unlink()  # as saved before manifests existed
    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert choose_resume(tmp_path, "auto") == old
    assert f"checkpoint {old} has no {MANIFEST}" in caplog.text
    (old / "state.json").write_text("")  # its JSON files are still checked
    with pytest.raises(CheckpointError, match=r"state\.json is unreadable \(JSONDecodeError"):
        choose_resume(tmp_path, str(old))
