"""Exact resume and resharding of megarl checkpoints (megarl.checkpoint.dist_ckpt).

Reference: k=3 steps, save, 3 more steps in the same process. Resume: a fresh process loads
the checkpoint and runs the last 3 steps: losses and weights must match (they match
bitwise). Without the distributed optimizer at TP=2; with it at TP=2 × DP=2 so its state is
really sharded. Resharding: the TP=2 checkpoint loads at TP=1 × PP=2 with the same weights,
and one more step (optimizer state included) equals the TP=2 continuation.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/checkpoint/worker_resume.py"
K = 3

RUNS = {  # name: (nproc, layout args, reshard layout args)
    "tp2": (2, ["--tp", "2"], ["--reshard-tp", "1", "--reshard-pp", "2"]),
    "tp2_dp2_distopt": (4, ["--tp", "2", "--dist-opt"], ["--reshard-tp", "1", "--reshard-pp", "2"]),
}


def _load(d: Path, tag: str) -> dict:
    return {"info": json.loads((d / f"{tag}.json").read_text()), "w": load_file(str(d / f"{tag}.safetensors"))}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("resume")
    # vocab 100: padded to 112 rows at TP=2 but 104 at TP=1, so resharding changes the padding
    hf = tiny_hf_model(base / "hf", vocab=100)
    out: dict[str, dict] = {}
    for name, (nproc, layout, reshard) in RUNS.items():
        d = base / name
        d.mkdir()
        common = ["--hf", str(hf), "--root", str(d / "ckpt"), "--out", str(d), "--k", str(K), *layout]
        torchrun(WORKER, nproc, [*common, "--phase", "train"])
        torchrun(WORKER, nproc, [*common, "--phase", "resume", *reshard])
        out[name] = {tag: _load(d, tag) for tag in ("train", "resume", "reshard")}
        out[name]["ckpt"] = d / "ckpt"
    return out


def _maxdiff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix_a: str = "", prefix_b: str = "") -> float:
    names = [k for k in a if not any(k.startswith(p) for p in ("ckpt:", "first:", "loaded:"))]
    assert names
    return max((a[prefix_a + n] - b[prefix_b + n]).abs().max().item() for n in names)


@pytest.mark.parametrize("run", RUNS)
def test_resume_is_exact(results: dict, run: str) -> None:
    ref, res = results[run]["train"], results[run]["resume"]
    assert len(res["info"]["losses"]) == K
    for a, b in zip(ref["info"]["losses"], res["info"]["losses"]):
        assert abs(a - b) <= 1e-6, (ref["info"]["losses"], res["info"]["losses"])
    for a, b in zip(ref["info"]["grad_norms"], res["info"]["grad_norms"]):
        assert abs(a - b) <= 1e-6 * max(1.0, a)
    assert _maxdiff(ref["w"], res["w"], "first:", "first:") <= 1e-6  # after the first resumed step
    assert _maxdiff(ref["w"], res["w"]) <= 1e-6  # after the last


@pytest.mark.parametrize("run", RUNS)
def test_resume_restores_optimizer_and_loop_state(results: dict, run: str) -> None:
    ref, res = results[run]["train"]["info"], results[run]["resume"]["info"]
    assert res["extra"] == {"step": K, "note": "resume-test"}
    assert res["lr_after_load"] == pytest.approx(2e-3)  # set before saving; the config says 1e-3
    # One Adam step count per parameter: K+1 after the first resumed step, for every parameter
    # (a step tensor shared by all parameters would read K + n_params here).
    assert res["adam_steps_after_first"] == [K + 1]
    assert ref["adam_steps_after_first"] == [K + 1]
    assert res["rng_after_load"] == ref["rng_after_save"]  # same layout: RNG streams continue
    assert ref["children_after_save"] == 0  # saving starts no Manager / writer processes


def test_distributed_optimizer_really_shards(results: dict) -> None:
    n = results["tp2_dp2_distopt"]["train"]["info"]["numel_rank0"]
    assert n["optimizer"] < 0.6 * n["model"], n  # DP=2: about half the main params per rank
    n = results["tp2"]["train"]["info"]["numel_rank0"]
    assert n["optimizer"] == n["model"], n


@pytest.mark.parametrize("run", RUNS)
def test_reshard_to_tp1_pp2(results: dict, run: str) -> None:
    ref, rs = results[run]["train"], results[run]["reshard"]
    assert rs["info"]["extra"]["step"] == K
    assert _maxdiff(ref["w"], rs["w"], "ckpt:", "loaded:") == 0.0  # weights as saved
    # Optimizer state continues: one more step equals the TP=2 continuation.
    assert abs(ref["info"]["losses"][0] - rs["info"]["losses"][0]) <= 1e-6
    assert rs["info"]["adam_steps_after_first"] == [K + 1]
    assert _maxdiff(ref["w"], rs["w"], "first:", "") <= 1e-5


@pytest.mark.parametrize("run", RUNS)
def test_checkpoint_layout_on_disk(results: dict, run: str) -> None:
    root = results[run]["ckpt"]
    name = f"step_{K:08d}"
    assert (root / "latest").read_text() == name
    ckpt = root / name
    for f in ("COMPLETE", "meta.json", "state.json", "actor/metadata.json", "rng/rank0.pt"):
        assert (ckpt / f).exists(), f
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["models"]["actor"]["has_optimizer"] is True
    assert meta["models"]["actor"]["distributed_optimizer"] is run.endswith("distopt")
    assert meta["models"]["actor"]["model_config"]["vocab_size"] == 100
    assert not list(root.glob("*.tmp"))
