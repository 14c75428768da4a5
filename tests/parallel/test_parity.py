"""TP / PP / DP layouts match the TP=1 run: log-probs, loss, grad norm and one optimizer
step, all within fp32 tolerance; and TP=1 matches transformers (the independent oracle)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/parallel/worker_parity.py"

LAYOUTS = {  # name: (nproc, extra args)
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "dp2": (2, ["--mbs", "2"]),
    "dp2_distopt": (2, ["--dist-opt"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    base = tmp_path_factory.mktemp("parity")
    hf = tiny_hf_model(base / "hf")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, (nproc, extra) in LAYOUTS.items():
        d = base / name
        d.mkdir()
        torchrun(WORKER, nproc, ["--hf", str(hf), "--out", str(d), *extra])
        out[name] = {**load_file(str(d / "result.safetensors")),
                     **{f"w:{k}": v for k, v in load_file(str(d / "updated.safetensors")).items()}}
    out["hf"] = {"dir": hf}  # type: ignore[dict-item]
    return out


def test_tp1_logprobs_match_transformers(results: dict) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(results["hf"]["dir"]), dtype=torch.float32)
    tokens = results["tp1"]["tokens"]
    with torch.no_grad():
        ref = model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    diff = (results["tp1"]["logprobs"][:, :-1] - ref).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_distopt"])
def test_layout_matches_tp1(results: dict, layout: str) -> None:
    a, b = results["tp1"], results[layout]
    assert (a["logprobs"] - b["logprobs"]).abs().max().item() < 5e-6
    assert (a["entropy"] - b["entropy"]).abs().max().item() < 5e-6
    assert abs(a["loss"].item() - b["loss"].item()) < 1e-6
    assert abs(a["grad_norm"].item() - b["grad_norm"].item()) < 1e-5 * max(1.0, a["grad_norm"].item())
    weights = [k for k in a if k.startswith("w:")]
    assert weights and set(weights) == {k for k in b if k.startswith("w:")}
    for k in weights:
        assert (a[k] - b[k]).abs().max().item() < 2e-6, k


def test_step_changed_the_weights(results: dict) -> None:
    """The compared step is a real update: weights moved away from the initial HF tensors."""
    init = load_file(str(Path(results["hf"]["dir"]) / "model.safetensors"))
    moved = max((results["tp1"][f"w:{k}"] - v).abs().max().item() for k, v in init.items())
    assert moved > 1e-4
