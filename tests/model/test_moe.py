"""A Qwen3-MoE model (4 experts, top-2) at expert parallelism 2 against EP=1 and against
transformers (the independent oracle), all from one two-rank run of ``worker_moe.py``:

* logits at EP=1, EP=2 and TP=2 equal transformers' within 1e-4 (and each other exactly: the same
  tokens meet the same experts, wherever they live), with renormalised top-k weights
  (``norm_topk_prob``, as Qwen3-30B-A3B) and without; the weights read back out of either
  layout are the HF tensors, bitwise; and at TP 2 × EP 2 (four ranks);
* one optimizer step at EP=2 equals EP=1 within 1e-6 — log-probs, loss, grad norm, every
  gradient (experts keyed by their global index on both ranks) and the weights after the step
  — with the plain and the distributed optimizer, and with the router losses on;
* the router losses' gradient equals a direct implementation of their formulas (Switch
  Transformer's load balancing, ST-MoE's z-loss) taken over the update's micro-batches;
* routing replay (``algo.router_replay: trainer``) at EP 1 and EP 2: after the routers are
  perturbed the replayed experts are the recorded ones, the log-prob drift falls well below live
  routing's, the routers still get gradients, the routes survive micro-batching, token budgets
  and packing, and the mismatch metric counts what it says; at PP 2 each stage replays its own
  layers' routes, with the same result.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/model/worker_moe.py"
VARIANTS = ["plain", "distopt", "aux", "aux_only"]
B, S = 8, 16


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("moe")
    hf = tiny_hf_model(base / "hf", arch="qwen3_moe", qk_gain=4.0)
    # HF's other routing: softmax over all experts, top-k, no renormalisation
    hf_all = tiny_hf_model(base / "hf_all", arch="qwen3_moe", seed=1, extra={"norm_topk_prob": False})
    out = base / "out"
    out.mkdir()
    torchrun(WORKER, 2, ["--hf", str(hf), "--out", str(out), "--hf-softmax-all", str(hf_all)])
    return {"hf": hf, "hf_all": hf_all, "ranks": [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]}


@pytest.fixture(scope="module")
def run_tp2ep2(run: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TP 2 × EP 2 on four ranks (forward only: see test_tp2_logprobs_match_ep1)."""
    out = tmp_path_factory.mktemp("moe_tp2ep2")
    torchrun(WORKER, 4, ["--hf", str(run["hf"]), "--out", str(out), "--layouts", "tp2ep2"])
    return load_file(str(out / "rank0.safetensors"))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _hf_forward(hf_dir: Path, **config: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, **config)
    tokens = torch.randint(3, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    return out.logits, list(out.router_logits)


@pytest.mark.parametrize("layout", ["ep1", "ep2", "tp2"])
def test_logits_match_transformers(run: dict, layout: str) -> None:
    logits, routers = _hf_forward(run["hf"])
    for r, rank in enumerate(run["ranks"]):
        diff = _max_diff(rank[f"{layout}/logits"], logits)
        print(f"{layout} rank {r}: max |logit - transformers| = {diff:.3g}")
        assert diff < 1e-4, diff
    assert torch.equal(run["ranks"][0]["ep2/logits"], run["ranks"][0]["ep1/logits"])
    # the check means something: every layer sends tokens to every expert (both EP ranks work)
    for layer in routers:
        chosen = layer.topk(2, dim=-1).indices.flatten()
        assert set(chosen.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("ep", [1, 2])
def test_unnormalised_top_k_matches_transformers(run: dict, ep: int) -> None:
    """norm_topk_prob=false (megatron moe_router_pre_softmax): the k weights keep their share of
    the softmax over all experts; renormalising them would change these logits."""
    logits, _ = _hf_forward(run["hf_all"])
    diff = _max_diff(run["ranks"][1][f"ep{ep}/softmax_all_logits"], logits)
    print(f"EP={ep} norm_topk_prob=false: max |logit - transformers| = {diff:.3g}")
    assert diff < 1e-4, diff
    renormalised, _ = _hf_forward(run["hf_all"], norm_topk_prob=True)
    assert _max_diff(renormalised, logits) > 1e-3  # (7.7e-3 here: 77× the tolerance above)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ep2_step_matches_ep1(run: dict, variant: str) -> None:
    r0, r1 = run["ranks"]
    a, b = f"ep1/{variant}", f"ep2/{variant}"
    diffs = {
        "log-probs": _max_diff(r0[f"{b}/logprobs"], r0[f"{a}/logprobs"]),
        "loss": abs(r0[f"{b}/loss"].item() - r0[f"{a}/loss"].item()),
        "grad norm": abs(r0[f"{b}/grad_norm"].item() - r0[f"{a}/grad_norm"].item()),
    }
    if variant != "distopt":
        diffs["gradients"] = 0.0  # (the distributed optimizer keeps only a shard of each gradient)
        for rank in (r0, r1):  # EP=2 rank r holds experts 2r, 2r+1; EP=1 rank 0 holds them all
            names = [k.removeprefix(f"{b}/grad/") for k in rank if k.startswith(f"{b}/grad/")]
            assert len(names) == 47  # 3 globals + 4 layers × (6 + router + 2 experts × 2)
            for n in names:
                diffs["gradients"] = max(diffs["gradients"], _max_diff(rank[f"{b}/grad/{n}"], r0[f"{a}/grad/{n}"]))
        experts = [k for k in r1 if k.startswith(f"{b}/grad/") and "local_experts.3." in k]
        assert experts and max(r1[k].abs().max().item() for k in experts) > 1e-3  # real gradients
    weights = [k.removeprefix(f"{a}/w/") for k in r0 if k.startswith(f"{a}/w/")]
    assert len(weights) == 87
    diffs["weights after the step"] = max(_max_diff(r0[f"{b}/w/{n}"], r0[f"{a}/w/{n}"]) for n in weights)
    g = r0[f"{a}/grad_norm"].item()
    print(f"{variant}: EP2 - EP1 " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()) + f" (grad norm {g:.4g})")
    assert g > 0 and diffs["grad norm"] < 1e-6 * max(1.0, g)
    assert max(v for k, v in diffs.items() if k != "grad norm") < 1e-6, diffs


def test_tp2_logprobs_match_ep1(run: dict) -> None:
    """Experts split over TP like a dense SwiGLU MLP ([gate; up] per shard), the router whole on
    each TP rank (forward only: megatron trains MoE under TP only with sequence parallelism)."""
    diff = _max_diff(run["ranks"][0]["tp2/plain/logprobs"], run["ranks"][0]["ep1/plain/logprobs"])
    print(f"TP2 - EP1 log-probs {diff:.3g}")
    assert diff < 1e-6


def test_tp2ep2_matches_transformers_and_reads_back_bitwise(run: dict, run_tp2ep2: dict) -> None:
    """Each EP rank's experts, TP-split: gathered over TP within the EP rank, then over EP."""
    logits, _ = _hf_forward(run["hf"])
    diff = _max_diff(run_tp2ep2["tp2ep2/logits"], logits)
    print(f"TP2×EP2: max |logit - transformers| = {diff:.3g}")
    assert diff < 1e-4
    assert _max_diff(run_tp2ep2["tp2ep2/plain/logprobs"], run["ranks"][0]["ep1/plain/logprobs"]) < 1e-6
    init = load_file(str(run["hf"] / "model.safetensors"))
    loaded = {k.removeprefix("tp2ep2/loaded/"): v for k, v in run_tp2ep2.items() if k.startswith("tp2ep2/loaded/")}
    assert loaded.keys() == init.keys() and all(torch.equal(loaded[k], init[k]) for k in init)


def test_weights_read_back_bitwise_and_the_step_moved_them(run: dict) -> None:
    init = load_file(str(run["hf"] / "model.safetensors"))
    r0 = run["ranks"][0]
    for layout in ("ep1", "ep2", "tp2"):
        loaded = {k.removeprefix(f"{layout}/loaded/"): v for k, v in r0.items() if k.startswith(f"{layout}/loaded/")}
        assert loaded.keys() == init.keys()
        assert all(torch.equal(loaded[k], init[k]) for k in init)
    moved = max(_max_diff(r0[f"ep2/plain/w/{k}"], v) for k, v in init.items())
    assert moved > 1e-4


def test_router_losses_match_their_formulas(run: dict) -> None:
    r0 = run["ranks"][0]
    for ep in (1, 2):
        got, ref = r0[f"ep{ep}/aux_only/router_grad"], r0[f"ep{ep}/aux_only/router_grad_ref"]
        print(f"EP={ep}: router-loss gradient vs formulas {_max_diff(got, ref):.3g} (of {ref.abs().max().item():.3g})")
        assert ref.abs().max() > 1e-3
        assert _max_diff(got, ref) <= 1e-6 * ref.abs().max().item()
    # and they change the update (the aux variant's router gradients differ from plain's)
    router = "decoder.layers.3.mlp.router.weight"
    assert _max_diff(r0[f"ep1/aux/grad/{router}"], r0[f"ep1/plain/grad/{router}"]) > 1e-3


# ------------------------------------------------- routing replay (R3): worker_moe_replay.py

LAYERS, EXPERTS = 4, 4
REPLAYS = ["replay_one", "replay_fixed", "replay_budget", "replay_packed"]
LENGTHS = torch.tensor([8 + b % 8 for b in range(B)])  # row_lengths of the worker's mask
REAL = torch.arange(S)[None, :] < LENGTHS[:, None]  # (B, S) tokens a row needs: the routes kept


def _r3(run: dict, layout: str, rank: int) -> dict[str, torch.Tensor]:
    prefix = f"{layout}/r3/"
    return {k.removeprefix(prefix): v for k, v in run["ranks"][rank].items() if k.startswith(prefix)}


def _as_map(routes: torch.Tensor) -> torch.Tensor:  # (.., k) expert indices -> (.., E) bool
    return torch.zeros(*routes.shape[:-1], EXPERTS, dtype=torch.bool).scatter(-1, routes.long(), True)


@pytest.mark.parametrize("layout", ["ep1", "ep2"])
def test_replay_sends_tokens_to_the_recorded_experts(run: dict, layout: str) -> None:
    """Router perturbed after recording: the live choices moved, the replayed ones are the recorded ones."""
    routes = _r3(run, layout, 0)["routes"]
    assert routes.shape == (B, S, LAYERS, 2) and routes.dtype == torch.int16
    assert torch.equal(_r3(run, layout, 1)["routes"], routes)  # all-gathered over DP: every rank holds the batch
    moved = (_as_map(_r3(run, layout, 0)["routes_live_after"]) != _as_map(routes)).any(-1)[REAL]  # (tokens, L)
    print(f"{layout}: tokens whose live experts moved after the perturbation, per layer: {moved.float().mean(0)}")
    assert moved.float().mean(0).min() > 0.05
    for rank in (0, 1):
        rows = slice(rank * B // 2, (rank + 1) * B // 2)
        replayed = _r3(run, layout, rank)["replayed_map"]  # (rows, S, L, E), the routers' own routing maps
        assert torch.equal(replayed[REAL[rows]], _as_map(routes[rows])[REAL[rows]])


@pytest.mark.parametrize("layout", ["ep1", "ep2"])
def test_replay_drift_falls_well_below_live_routing_and_routers_still_learn(run: dict, layout: str) -> None:
    r = _r3(run, layout, 0)
    live, replay = r["live/drift"].item(), r["replay_one/drift"].item()
    print(f"{layout}: mean |log π_update - log π_old| after the router perturbation: live {live:.3g}, replay {replay:.3g}")
    assert live > 1e-3 and replay < 0.2 * live
    grads = r["replay_one/router_grad"].flatten(1).norm(dim=1)  # per layer, after the DP reduction
    assert grads.min() > 0.1 * r["live/router_grad"].flatten(1).norm(dim=1).max(), grads


def test_routes_follow_their_tokens_through_micro_batches_budgets_and_packing(run: dict) -> None:
    """Recorded in token-budget micro-batches (padded, packed) = recorded in fixed ones; replayed in
    fixed, budget and packed micro-batches = replayed in one micro-batch per rank (EP 1: megarl
    refuses token budgets with EP > 1)."""
    layout = "ep1"
    for rank in (0, 1):
        r = _r3(run, layout, rank)
        for name in ("budget", "packed"):
            got = r[f"routes_{name}"]
            assert torch.equal(got[REAL], r["routes"][REAL])
            if name == "packed":  # never computed: marked
                assert (got[~REAL] == -1).all()
        one = r["replay_one/router_grad"]
        for name in REPLAYS[1:]:
            total = r["replay_one/lp"].item()  # Σ log-probs over the rank's response tokens (fp32 sums)
            diffs = {
                "log-prob sum, relative": abs(r[f"{name}/lp"].item() - total) / abs(total),
                "drift": abs(r[f"{name}/drift"].item() - r["replay_one/drift"].item()),
                "router grads": _max_diff(r[f"{name}/router_grad"], one),
            }
            print(f"{layout} rank {rank} {name} - one micro-batch: {diffs}")
            assert max(diffs.values()) < 1e-5 and diffs["router grads"] < 1e-6 * max(1.0, one.abs().max().item())
            assert torch.equal(r[f"{name}/mismatch"][0], r["replay_one/mismatch"][0])


@pytest.mark.parametrize("layout", ["ep1", "ep2"])
def test_route_mismatch_metric_counts_the_live_choices_that_differ(run: dict, layout: str) -> None:
    """moe/route_mismatch_l0 = the share of real tokens whose first-layer experts moved (the
    first layer's input does not depend on any routing, so a live forward gives its choices);
    no replay, no count."""
    r = _r3(run, layout, 0)
    moved = (_as_map(r["routes_live_after"][:, :, 0]) != _as_map(r["routes"][:, :, 0])).any(-1)[REAL]
    metric = r["replay_one/mismatch"]
    print(f"{layout}: moe/route_mismatch per layer {metric.tolist()}, first layer directly {moved.float().mean():.4f}")
    assert abs(metric[0].item() - moved.float().mean().item()) < 1e-6
    assert ((metric > 0) & (metric < 1)).all()
    assert (r["live/mismatch"] == -1).all()  # (absent)


def test_replay_at_ep2_matches_ep1(run: dict) -> None:
    for rank in (0, 1):
        a, b = _r3(run, "ep1", rank), _r3(run, "ep2", rank)
        assert torch.equal(a["routes"], b["routes"])
        for name in ["live", "replay_one", "replay_fixed"]:
            diffs = [abs(a[f"{name}/lp"].item() - b[f"{name}/lp"].item()) / abs(a[f"{name}/lp"].item()),
                     _max_diff(a[f"{name}/router_grad"], b[f"{name}/router_grad"])]  # fmt: skip
            assert max(diffs) < 1e-5, (name, diffs)
            assert torch.equal(a[f"{name}/mismatch"], b[f"{name}/mismatch"])


def test_replay_at_pp2_matches_one_stage(run: dict) -> None:
    """PP 2 (DP 1): each stage records and replays its own two layers' routes; the log-probs, the
    routers' gradients and the per-layer mismatch (gathered over the stages) are EP 1's."""
    one = _r3(run, "ep1", 0)
    for stage in (0, 1):
        r, layers = _r3(run, "pp2", stage), slice(2 * stage, 2 * stage + 2)
        assert torch.equal(r["routes"], one["routes"][:, :, layers])
        assert torch.equal(r["routes_packed"], one["routes_packed"][:, :, layers])
        for name in ["live", *REPLAYS]:
            lp = abs(r[f"{name}/lp"].item() - one[f"{name}/lp"].item()) / abs(one[f"{name}/lp"].item())
            grads = _max_diff(r[f"{name}/router_grad"], one[f"{name}/router_grad"][layers])
            assert lp < 1e-6 and grads < 1e-6, (stage, name, lp, grads)
            assert torch.equal(r[f"{name}/mismatch"], one[f"{name}/mismatch"])
