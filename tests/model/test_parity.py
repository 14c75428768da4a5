"""TP / PP / DP layouts match the TP=1 run: log-probs, loss, grad norm and one optimizer
step, all within fp32 tolerance; and TP=1 matches transformers (the independent oracle).
Token-budget micro-batches (``*_budget``: unequal micro-batches cut to their longest row, DP
rows balanced by tokens) match the fixed-row TP=1 run in every layout too, and so do they
packed padding-free (``*_packed``), down to each gradient element."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/model/worker_parity.py"

LAYOUTS = {  # name: (nproc, extra args)
    "tp1": (1, []),
    "tp2": (2, ["--tp", "2", "--critic-steps", "25"]),
    "pp2": (2, ["--pp", "2"]),
    "dp2": (2, ["--mbs", "2"]),
    "dp2_distopt": (2, ["--dist-opt"]),
    "tp1_mbs16": (1, ["--mbs", "16"]),
    "tp2_unfused": (2, ["--tp", "2", "--attention", "unfused"]),  # megatron's attention vs the SDPA default
    # token budget (rows 10-18 tokens long of S=20): 2-4 rows per micro-batch, each its own width
    "tp1_budget": (1, ["--max-tokens", "40"]),
    "dp2_budget": (2, ["--max-tokens", "40"]),
    "tp2_budget": (2, ["--tp", "2", "--max-tokens", "64"]),
    "pp2_budget": (2, ["--pp", "2", "--max-tokens", "40"]),  # varying p2p shapes between stages
    # the same budgets, each micro-batch packed into one row (thd, per-sequence attention)
    "tp1_packed": (1, ["--max-tokens", "40", "--pack"]),
    "dp2_packed": (2, ["--max-tokens", "40", "--pack"]),
    "tp2_packed": (2, ["--tp", "2", "--max-tokens", "64", "--pack"]),
    "pp2_packed": (2, ["--pp", "2", "--max-tokens", "40", "--pack"]),
    # sequence parallelism, packed: packed rows of odd length run padded by one token
    "tp2_sp_packed": (2, ["--tp", "2", "--max-tokens", "64", "--pack", "--sp"]),
}
PACKED = {"tp1_packed": "tp1", "dp2_packed": "dp2", "tp2_packed": "tp2", "pp2_packed": "pp2"}  # its padded twin
BUDGET = ["tp1_budget", "dp2_budget", "tp2_budget", "pp2_budget", *PACKED, "tp2_sp_packed"]
SEQUENCE_PARALLEL = {"tp2_sp_packed": "tp2_packed"}  # its twin without sequence parallelism
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class _Runs(dict):
    """Each layout's results, run on first use (a test selection runs only the layouts it reads)."""

    def __init__(self, base: Path) -> None:
        super().__init__(hf={"dir": tiny_hf_model(base / "hf")})
        self.base = base

    def __missing__(self, name: str) -> dict[str, torch.Tensor]:
        nproc, extra = LAYOUTS[name]
        d = self.base / name
        d.mkdir()
        torchrun(WORKER, nproc, ["--hf", str(self["hf"]["dir"]), "--out", str(d), *extra])
        self[name] = {
            **load_file(str(d / "result.safetensors")),
            **{f"w:{k}": v for k, v in load_file(str(d / "updated.safetensors")).items()},
        }
        return self[name]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return _Runs(tmp_path_factory.mktemp("parity"))


def test_tp1_logprobs_match_transformers(results: dict) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(results["hf"]["dir"]), dtype=torch.float32)
    tokens = results["tp1"]["tokens"]
    with torch.no_grad():
        ref = model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    diff = (results["tp1"]["logprobs"][:, :-1] - ref).abs().max().item()
    assert diff < 1e-4, diff


def test_answer_prob_matches_transformers_in_every_layout(results: dict) -> None:
    """``train.val_metric: answer_prob`` (the worker's 13 rows, answers of 1-3 ids after a
    6-token prompt): the mean of exp(Σ log p(answer | prompt)) equals transformers' teacher-forced
    one, in TP=1 and across TP / PP / DP and token-budget packed micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(results["hf"]["dir"]), dtype=torch.float64)
    tokens = results["tp1"]["tokens"][:13]
    with torch.no_grad():
        ref_lp = model(tokens).logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    answer = [ref_lp[b, 5 : 6 + b % 3].sum() for b in range(13)]  # the prompt is tokens[b, :6]
    ref = float(torch.stack(answer).exp().mean())
    assert 0.005 < ref < 0.05  # ~1/61 a one-id answer: a probability the tolerance can resolve
    for layout in ["tp1", "tp2", "pp2", "dp2", "dp2_packed"]:
        got = float(results[layout]["answer_prob"][0])
        assert abs(got - ref) < 1e-5 * ref + 1e-8, (layout, got, ref)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_distopt", "tp1_mbs16", "tp2_unfused"])
def test_layout_matches_tp1(results: dict, layout: str) -> None:
    a, b = results["tp1"], results[layout]
    assert (a["logprobs"] - b["logprobs"]).abs().max().item() < 5e-6
    assert (a["entropy"] - b["entropy"]).abs().max().item() < 5e-6


@pytest.mark.parametrize("layout", BUDGET)
def test_budget_forward_matches_fixed_rows(results: dict, layout: str) -> None:
    """Forward-only passes in token-budget micro-batches: log-probs, entropy and critic values
    equal the fixed-row pass at every position a row has (scattered back to row order), 0 beyond."""
    a, b = results["tp1"], results[layout]
    assert torch.equal(a["lengths"], b["lengths"]) and a["lengths"].min() < a["tokens"].shape[1]
    inside = torch.arange(a["tokens"].shape[1])[None] < a["lengths"][:, None]
    for k in ("logprobs", "entropy", "critic/values0", "critic/values1"):
        assert (a[k] - b[k])[inside].abs().max().item() < 5e-6, k
        assert b[k][~inside].abs().max().item() == 0.0, k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_distopt", "tp1_mbs16", "tp2_unfused", *BUDGET])
def test_step_invariant_to_layout_and_split(results: dict, layout: str, mode: str) -> None:
    """Same global batch, different TP/PP/DP/micro-batch split -> same loss, grad norm and
    updated weights, for every loss-aggregation mode (global denominators)."""
    a, b = results["tp1"], results[layout]
    assert abs(a[f"{mode}/loss"].item() - b[f"{mode}/loss"].item()) < 1e-6
    g = a[f"{mode}/grad_norm"].item()
    assert g > 0 and abs(g - b[f"{mode}/grad_norm"].item()) < 1e-5 * max(1.0, g)
    weights = [k for k in a if k.startswith(f"w:{mode}/")]
    assert weights and set(weights) == {k for k in b if k.startswith(f"w:{mode}/")}
    for k in weights:
        assert (a[k] - b[k]).abs().max().item() < 2e-6, k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(PACKED))
def test_packed_gradients_equal_padded(results: dict, layout: str, mode: str) -> None:
    """Packed micro-batches give every gradient element of the fixed-row run in the same
    layout (rank 0's shards after the DP reduction), for every aggregation mode."""
    a, b = results[PACKED[layout]], results[layout]
    keys = sorted(k for k in a if k.startswith(f"grad:{mode}/"))
    assert keys and keys == sorted(k for k in b if k.startswith(f"grad:{mode}/"))
    worst = max((a[k] - b[k]).abs().max().item() for k in keys)
    assert worst <= 1e-6, worst
    assert max(a[k].abs().max().item() for k in keys) > 1e-3  # real gradients, not zeros


@pytest.mark.parametrize("layout", list(SEQUENCE_PARALLEL))
def test_sequence_parallel_equals_without(results: dict, layout: str) -> None:
    """A dense model with sequence parallelism against the same layout without: log-probs,
    entropy, every loss, grad norm, gradient element and updated weight, and the critic's
    values and step, within 1e-6 — with packed rows of odd length (padded by SP)."""
    from megarl.model.microbatch import token_budget_split

    a, b = results[SEQUENCE_PARALLEL[layout]], results[layout]
    assert any(int(g.lengths.sum()) % 2 for g in token_budget_split(b["lengths"], 64, packed=True))
    # (the grad probe's per-rank reading is refused with SP: it precedes the TP sum SP needs)
    keys = [k for k in a if not k.startswith(("probe/", "adam/"))]
    assert set(keys) <= b.keys() and sum(k.startswith("grad:") for k in keys) > 20
    worst = {k: (a[k].double() - b[k].double()).abs().max().item() for k in keys}
    assert max(worst.values()) <= 1e-6, max(worst.items(), key=lambda kv: kv[1])


def test_modes_differ(results: dict) -> None:
    """The modes really are different objectives on this ragged batch (the test can fail)."""
    losses = {m: results["tp1"][f"{m}/loss"].item() for m in MODES}
    assert len({round(v, 6) for v in losses.values()}) == len(MODES), losses


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_distopt", "tp1_mbs16", *BUDGET])
def test_critic_value_head_matches_tp1(results: dict, layout: str) -> None:
    a, b = results["tp1"], results[layout]
    if layout not in BUDGET:  # (budget passes: test_budget_forward_matches_fixed_rows)
        for k in ("critic/values0", "critic/values1"):
            assert (a[k] - b[k]).abs().max().item() < 5e-6, k
    assert abs(a["critic/loss"].item() - b["critic/loss"].item()) < 1e-6
    assert abs(a["critic/grad_norm"].item() - b["critic/grad_norm"].item()) < 1e-5
    assert (a["critic/values1"] - a["critic/values0"]).abs().max().item() > 1e-4  # the step moved values


def test_step_changed_the_weights(results: dict) -> None:
    """The compared step is a real update: weights moved away from the initial HF tensors."""
    init = load_file(str(Path(results["hf"]["dir"]) / "model.safetensors"))
    moved = max((results["tp1"][f"w:token-mean/{k}"] - v).abs().max().item() for k, v in init.items())
    assert moved > 1e-4


def test_critic_value_loss_falls_on_fixed_batch(results: dict) -> None:
    losses = results["tp2"]["critic/fixed_batch_losses"]
    assert len(losses) == 25
    assert losses[-1].item() < 0.5 * losses[0].item(), losses


def test_grad_probe_matches_brute_force(results: dict) -> None:
    """The coordinator's inputs: a DP rank's local mean-gradient |ḡ_r|² (probe, before the
    all-reduce, TP/PP-summed) equals the gradient of that rank's rows alone; micro-batch
    norms (every micro-batch of every DP rank, gathered) equal each micro-batch alone; |G|²
    is the full-batch norm."""
    tp1, dp2 = results["tp1"], results["dp2"]
    halves, parts = tp1["probe/brute_half_sq"], tp1["probe/brute_part_sq"]
    assert torch.allclose(dp2["probe/rank_sq"], halves, rtol=1e-5), (dp2["probe/rank_sq"], halves)
    assert torch.allclose(tp1["probe/mb_sq"], parts, rtol=1e-5), (tp1["probe/mb_sq"], parts)
    for layout in ("tp2", "pp2", "dp2", "dp2_distopt", "tp1_mbs16", *BUDGET):
        assert abs(results[layout]["probe/global_sq"].item() / tp1["probe/global_sq"].item() - 1) < 1e-5, layout
    assert torch.allclose(results["dp2_distopt"]["probe/rank_sq"], halves, rtol=1e-5)
    # a measured update keeps contiguous DP rows; its micro-batches may follow the budget
    assert torch.allclose(results["dp2_budget"]["probe/rank_sq"], halves, rtol=1e-5)
    # every micro-batch (4 rows) of both DP ranks, gathered rank-major: the same parts as
    # one rank's micro-batches of the whole batch (dp2 itself runs micro-batches of 2)
    gathered = results["dp2_distopt"]["probe/mb_sq"]
    assert torch.allclose(gathered, parts, rtol=1e-5), (gathered, parts)
    assert len(dp2["probe/mb_sq"]) == 8
    if "probe/mb_sq" in results["tp2"]:  # TP-sharded params summed over the TP group
        assert torch.allclose(results["tp2"]["probe/mb_sq"], parts, rtol=1e-5)
    assert halves.min() > tp1["probe/global_sq"].item()  # small batches are noisier


def test_adam_preconditioned_probe_matches_brute_force(results: dict) -> None:
    """coordinator.noise_kind adam: after one Adam step, every part's |P·g|² (P = 1/(√v̂+ε)
    read from the optimizer, laid out over megatron's grad buffers) equals the gradient of
    that part alone weighted element-wise by P, and |P·G|² (read after the DP reduction) the
    whole batch's — in every layout that keeps whole second moments (not the distributed
    optimizer, which the config refuses)."""
    tp1 = results["tp1"]
    parts, halves, whole = (tp1[f"adam/brute_{k}_sq"] for k in ("part", "half", "all"))
    assert torch.allclose(tp1["adam/mb_sq"], parts, rtol=1e-5), (tp1["adam/mb_sq"], parts)
    assert torch.allclose(tp1["adam/global_sq"], whole, rtol=1e-5), (tp1["adam/global_sq"], whole)
    assert torch.allclose(results["dp2"]["adam/rank_sq"], halves, rtol=1e-4), (results["dp2"]["adam/rank_sq"], halves)
    for layout in ("tp2", "pp2", "dp2"):
        got = results[layout]["adam/global_sq"].item() / whole.item()
        assert abs(got - 1) < 1e-4, (layout, got)
    if "adam/mb_sq" in results["tp2"]:  # TP shards of P·g summed over the TP group
        assert torch.allclose(results["tp2"]["adam/mb_sq"], parts, rtol=1e-4)
    # P is not a constant factor (else a P laid out on the wrong elements would pass): the
    # parts' |P·g|²/|g|² differ (1.28× apart on this model after one step)
    per_part = parts / tp1["adam/brute_plain_part_sq"]
    assert per_part.max() / per_part.min() > 1.1, per_part
