"""A Qwen3-MoE model (4 experts, top-2) at expert parallelism 2 against EP=1 and against
transformers (the independent oracle), all from one two-rank run of ``worker_moe.py``, with a
Mixtral model of the same size forward-only in the same run (its logits and read-back weights):

* logits at EP=1, EP=2 and TP=2 (sequence parallel) equal transformers' within 1e-4 (and each
  other exactly: the same tokens meet the same experts, wherever they live), with renormalised
  top-k weights (``norm_topk_prob``, as Qwen3-30B-A3B) and without; the weights read back out of
  either layout are the HF tensors, bitwise; and at TP 2 × EP 2 (four ranks);
* one optimizer step at TP=2 with sequence parallelism (megatron trains MoE under TP only with
  it), and at TP 2 × EP 2, equals EP=1 within 1e-6: log-probs (also of rows SP pads), loss,
  grad norm, every full gradient, the weights after the step, the tokens each expert received;
* one optimizer step at EP=2 equals EP=1 within 1e-6 — log-probs, loss, grad norm, every
  gradient (experts keyed by their global index on both ranks) and the weights after the step
  — with the plain and the distributed optimizer, and with the router losses on;
* the router losses' gradient equals a direct implementation of their formulas (Switch
  Transformer's load balancing, ST-MoE's z-loss) taken over the update's micro-batches;
* the coordinator's noise probe at EP=2 counts every expert once: its dense parts, its expert
  parts (unions over the EP group) and both classes' global |G|² equal brute-force EP=1 values
  of the same batch, and the noise estimate equals the EP=1 one with the same parts.
* routing replay (``algo.router_replay: trainer``) at EP 1 and EP 2: after the routers are
  perturbed the replayed experts are the recorded ones, the log-prob drift falls well below live
  routing's, the routers still get gradients, the routes survive micro-batching, token budgets
  and packing, and the mismatch metric counts what it says; at PP 2 each stage replays its own
  layers' routes, with the same result;
* the engines' routes (``algo.router_replay: rollout``; recorded routes standing in for vLLM's)
  replayed in phase 2's old forward at EP 1, EP 2 and PP 2.
"""

import logging
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
    # 4 KV heads (no GQA): TP 4 splits them (the 4-rank run's tp4etp2)
    hf = tiny_hf_model(base / "hf", arch="qwen3_moe", qk_gain=4.0, extra={"num_key_value_heads": 4})
    # HF's other routing: softmax over all experts, top-k, no renormalisation
    hf_all = tiny_hf_model(base / "hf_all", arch="qwen3_moe", seed=1, extra={"norm_topk_prob": False})
    out = base / "out"
    out.mkdir()
    mixtral = tiny_hf_model(base / "hf_mixtral", arch="mixtral", seed=2, qk_gain=4.0)
    argv = ["--hf", str(hf), "--out", str(out), "--hf-softmax-all", str(hf_all), "--hf-mixtral", str(mixtral)]
    torchrun(WORKER, 2, argv)
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in (0, 1)]
    return {"hf": hf, "hf_all": hf_all, "mixtral": mixtral, "ranks": ranks}


FAMILIES = {"qwen3_moe": ("hf", ""), "mixtral": ("mixtral", "mixtral/")}
"""family -> (its HF folder in ``run``, its keys' prefix in the ranks' results)"""


@pytest.fixture(scope="module")
def run_tp2ep2(run: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TP 2 × EP 2 on four ranks (DP 2, sequence parallel), experts split over TP and whole on each
    TP rank (expert TP 1: the EP group is then the TP group): forward and the plain step."""
    out = tmp_path_factory.mktemp("moe_tp2ep2")
    torchrun(WORKER, 4, ["--hf", str(run["hf"]), "--out", str(out), "--layouts", "tp2ep2,tp2ep2etp1,tp4etp2"])
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


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", ["ep1", "ep2", "tp2", "tp2etp1"])
def test_logits_match_transformers(run: dict, layout: str, family: str) -> None:
    folder, key = FAMILIES[family]
    logits, routers = _hf_forward(run[folder])
    for r, rank in enumerate(run["ranks"]):
        diff = _max_diff(rank[f"{key}{layout}/logits"], logits)
        print(f"{family} {layout} rank {r}: max |logit - transformers| = {diff:.3g}")
        assert diff < 1e-4, diff
    assert torch.equal(run["ranks"][0][f"{key}ep2/logits"], run["ranks"][0][f"{key}ep1/logits"])
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


def _step_diffs(got: dict, ref: dict, layout: str) -> dict[str, float]:
    """``layout``'s plain step (rank 0's results ``got``) against EP 1's (``ref``): the largest
    differences of each compared quantity."""
    a, b = "ep1/plain", f"{layout}/plain"
    grads = [k.removeprefix(f"{a}/hfgrad/") for k in ref if k.startswith(f"{a}/hfgrad/")]
    weights = [k.removeprefix(f"{a}/w/") for k in ref if k.startswith(f"{a}/w/")]
    assert len(grads) == len(weights) == 87 and {f"{b}/hfgrad/{k}" for k in grads} <= got.keys()
    assert max(ref[f"{a}/hfgrad/{k}"].abs().max().item() for k in grads if ".experts.3." in k) > 1e-3
    return {
        "log-probs": _max_diff(got[f"{b}/logprobs"], ref[f"{a}/logprobs"]),
        "loss": abs(got[f"{b}/loss"].item() - ref[f"{a}/loss"].item()),
        "grad norm": abs(got[f"{b}/grad_norm"].item() - ref[f"{a}/grad_norm"].item()),
        "gradients": max(_max_diff(got[f"{b}/hfgrad/{k}"], ref[f"{a}/hfgrad/{k}"]) for k in grads),
        "weights after the step": max(_max_diff(got[f"{b}/w/{k}"], ref[f"{a}/w/{k}"]) for k in weights),
    }


def _grad_norm_of_own_gradients(got: dict, ref: dict, layout: str) -> dict[str, float]:
    """For TP 4 × expert TP 2, whose grad norm (3.53) sums four TP ranks' and two expert-TP ranks'
    fp32 squares: the grad norm against the fp64 norm of the layout's own gathered gradients (a
    shard counted twice or not at all would show at once), and against EP 1's relative to its size
    (EP 1's own fp32 norm is 7.4e-7 off its gradients' fp64 norm, a few fp32 ulps at 3.5, so the
    absolute difference to it, 1.1e-6, measures EP 1's rounding; the gradients themselves are
    compared elementwise within 1e-6)."""
    b, gnorm = f"{layout}/plain", got[f"{layout}/plain/grad_norm"].item()
    own = sum(v.double().square().sum() for k, v in got.items() if k.startswith(f"{b}/hfgrad/")).sqrt().item()
    ref_norm = ref["ep1/plain/grad_norm"].item()
    return {"grad norm": abs(gnorm - own), "grad norm vs EP1, relative": abs(gnorm - ref_norm) / ref_norm}


def test_tp2_sequence_parallel_step_matches_ep1(run: dict) -> None:
    """Experts split over TP like a dense SwiGLU MLP ([gate; up] per shard), each TP rank routing
    its half of the sequence (sequence parallelism): one step equals EP 1's, and so do the
    log-probs of 15-column rows, which run padded to 16 (the pad cut off again)."""
    r0, r1 = run["ranks"]
    diffs = _step_diffs(r0, r0, "tp2")
    diffs["log-probs, 15 columns"] = _max_diff(r0["tp2/plain/logprobs_odd"], r0["ep1/plain/logprobs_odd"])
    print("TP2 (SP) - EP1 " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert max(diffs.values()) < 1e-6, diffs
    assert r0["tp2/plain/logprobs_odd"].shape == (B, 15)
    # both TP ranks count their own positions; summed over TP they are EP 1's counts
    for rank in (r0, r1):
        assert torch.equal(rank["tp2/plain/expert_counts"], r0["ep1/plain/expert_counts"])


def test_tp2_expert_tp1_step_matches_ep1(run: dict) -> None:
    """Expert TP 1 at TP 2 (SP): each TP rank runs its half of the sequence through whole experts,
    whose gradients megarl has summed over TP (megatron reduces them over DP only at EP 1): one
    step equals EP 1's, and both TP ranks' experts are still equal after it."""
    r0, r1 = run["ranks"]
    diffs = _step_diffs(r0, r0, "tp2etp1")
    diffs["log-probs, 15 columns"] = _max_diff(r0["tp2etp1/plain/logprobs_odd"], r0["ep1/plain/logprobs_odd"])
    print("TP2 ETP1 (SP) - EP1 " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert max(diffs.values()) < 1e-6, diffs
    for rank in (r0, r1):
        assert rank["tp2etp1/plain/expert_tp_spread"].item() == 0.0
        assert torch.equal(rank["tp2etp1/plain/expert_counts"], r0["ep1/plain/expert_counts"])


@pytest.mark.parametrize("layout", ["tp2ep2", "tp2ep2etp1", "tp4etp2"])
def test_tp2ep2_matches_transformers_and_reads_back_bitwise(run: dict, run_tp2ep2: dict, layout: str) -> None:
    """Each EP rank's experts, TP-split: gathered over TP within the EP rank, then over EP (expert
    TP 1: whole, gathered over the EP group, which spans the TP ranks); TP 4 with expert TP 2 (EP 1):
    each expert split over a pair of TP ranks, loaded as halves and gathered over the expert-TP
    group. One step with sequence parallelism equals EP 1's."""
    logits, _ = _hf_forward(run["hf"])
    diff = _max_diff(run_tp2ep2[f"{layout}/logits"], logits)
    print(f"{layout}: max |logit - transformers| = {diff:.3g}")
    assert diff < 1e-4
    diffs = _step_diffs(run_tp2ep2, run["ranks"][0], layout)  # trained with sequence parallelism
    if layout == "tp4etp2":
        diffs.update(_grad_norm_of_own_gradients(run_tp2ep2, run["ranks"][0], layout))
    print(f"{layout} (SP) - EP1 " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert max(diffs.values()) < 1e-6, diffs
    assert torch.equal(run_tp2ep2[f"{layout}/plain/expert_counts"], run["ranks"][0]["ep1/plain/expert_counts"])
    if layout == "tp4etp2":  # TP ranks 0 and 2 (1 and 3) hold the same expert halves: still equal
        assert run_tp2ep2[f"{layout}/plain/expert_tp_spread"].item() == 0.0
    init = load_file(str(run["hf"] / "model.safetensors"))
    loaded = {
        k.removeprefix(f"{layout}/loaded/"): v for k, v in run_tp2ep2.items() if k.startswith(f"{layout}/loaded/")
    }
    assert loaded.keys() == init.keys() and all(torch.equal(loaded[k], init[k]) for k in init)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_read_back_bitwise(run: dict, family: str) -> None:
    """Every HF tensor (Mixtral: ``block_sparse_moe.experts.{g}.w1/w3/w2``, as saved) out of each layout."""
    folder, key = FAMILIES[family]
    init = load_file(str(run[folder] / "model.safetensors"))
    assert any(".experts.3." in k for k in init)
    for layout in ("ep1", "ep2", "tp2", "tp2etp1"):
        p = f"{key}{layout}/loaded/"
        loaded = {k.removeprefix(p): v for k, v in run["ranks"][0].items() if k.startswith(p)}
        assert loaded.keys() == init.keys()
        assert all(torch.equal(loaded[k], init[k]) for k in init)


def test_the_step_moved_the_weights(run: dict) -> None:
    init = load_file(str(run["hf"] / "model.safetensors"))
    moved = max(_max_diff(run["ranks"][0][f"ep2/plain/w/{k}"], v) for k, v in init.items())
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


def _real_lengths() -> torch.Tensor:
    """The worker's rows' real lengths (``row_lengths`` of its mask: last response position + 2)."""
    return torch.tensor([8 + b % 8 for b in range(B)])


def test_expert_counts_equal_transformers_routing_at_ep1_and_ep2(run: dict) -> None:
    """The tokens each expert received in the update's forward, summed over micro-batches and DP
    ranks, equal a count of transformers' own top-2 choices on the same real tokens (padding
    beyond each row's length left out), at EP 1 and EP 2, on both ranks."""
    _, routers = _hf_forward(run["hf"])
    real = (torch.arange(S)[None, :] < _real_lengths()[:, None]).reshape(-1)  # HF's rows: (b, s) flattened
    ref = torch.stack([torch.bincount(r[real].topk(2, dim=-1).indices.reshape(-1), minlength=4) for r in routers])
    for rank in run["ranks"]:
        for ep in (1, 2):
            assert torch.equal(rank[f"ep{ep}/plain/expert_counts"], ref), (ep, rank[f"ep{ep}/plain/expert_counts"], ref)
    assert int(ref.sum()) == 4 * 2 * int(_real_lengths().sum())  # 4 layers, top-2, 92 real tokens
    print(f"expert counts per layer (EP 1 = EP 2 = transformers): {ref.tolist()}")


def test_forced_routing_counts_dead_experts_and_the_watch_warns_after_n_steps(run: dict) -> None:
    """Routing forced onto experts 1 and 3: each receives every real token, 0 and 2 none (dead), in
    every layer and step, at EP 1 and EP 2 alike; the watch (N = 3) warns at the third step,
    naming them, and stays quiet while nothing changes."""
    from megarl.model.expert_load import DeadExpertWatch, load_metrics

    tokens = int(_real_lengths().sum())
    expected = torch.tensor([[0, tokens, 0, tokens]] * 4)
    r0 = run["ranks"][0]
    steps = [r0[f"ep1/forced/counts{i}"] for i in range(3)]
    for rank in run["ranks"]:
        for i in range(3):
            assert torch.equal(rank[f"ep1/forced/counts{i}"], expected) and torch.equal(
                rank[f"ep2/forced/counts{i}"], expected
            )
    m = load_metrics(steps[0], topk=2)
    assert (m["moe/dead_experts"], m["moe/load_max_over_mean"], m["moe/tokens"]) == (8.0, 2.0, float(tokens))
    watch = DeadExpertWatch(3)
    said = [watch.observe(c) for c in steps + [steps[0]]]
    assert said[:2] == [None, None] and said[3] is None
    level, message = said[2]
    assert level == logging.WARNING
    assert message == (
        "MoE: 8 expert(s) received no tokens in each of the last 3 or more steps (model.moe_dead_expert_steps=3): "
        "layer 0: experts [0, 2]; layer 1: experts [0, 2]; layer 2: experts [0, 2]; layer 3: experts [0, 2]"
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("variant", ["plain", "distopt"])
def test_noise_probe_counts_each_expert_once_at_ep2(run: dict, variant: str) -> None:
    """#44 item 6. The EP=1 reference reads every parameter's gradient by name after each
    micro-batch (DP = 2, 2 micro-batches a rank): dense parts per rank and micro-batch, expert
    parts as the two ranks' micro-batch k gradients summed (the union EP=2 sends to the
    experts), both classes' global |G|². At EP=2 the probe reads its buffers: no expert is
    counted twice or lost (the classes' global |G|² add up to the optimizer's grad norm², which
    megatron sums over the EP group itself), and every part and the estimate equal EP=1's."""
    r0, r1 = run["ranks"]
    ref, got = "ep1/plain/probe", f"ep2/{variant}/probe"
    norm2 = r0[f"ep2/{variant}/grad_norm"].item() ** 2
    total = r0[f"{got}/global"].sum().item()
    print(
        f"{variant}: EP=2 probe |G_dense|² + |G_experts|² = {total:.9g}, optimizer grad norm² {norm2:.9g}; "
        f"experts' share {r0[f'{got}/global'][1].item() / total:.3f}"
    )
    assert abs(total - norm2) <= 1e-6 * norm2
    # the experts' share (0.7 % here) is thousands of times the tolerance: dropping them, or
    # counting them twice, would fail the line above
    assert r0[f"{got}/global"][1] > 1e-3 * total
    for rank in (r0, r1):  # every rank ends with the same reading
        for key in ("parts", "expert_parts", "global", "estimate"):
            assert torch.equal(rank[f"{got}/{key}"], r0[f"{got}/{key}"]), key
    diffs = {
        "dense parts": _rel(r0[f"{got}/parts"], r0[f"{ref}/ref_dense_parts"]),
        "expert parts (EP-group unions)": _rel(r0[f"{got}/expert_parts"], r0[f"{ref}/ref_expert_parts"]),
        "global |G|² per class": _rel(r0[f"{got}/global"], r0[f"{ref}/ref_global"]),
        "|G|² estimate": _rel(r0[f"{got}/estimate"][0], r0[f"{ref}/ref_estimate"][0]),
        "tr Σ estimate": _rel(r0[f"{got}/estimate"][1], r0[f"{ref}/ref_estimate"][1]),
    }
    print(f"{variant}: EP=2 vs EP=1, relative: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert max(diffs.values()) < 1e-6, diffs
    assert r0[f"{got}/expert_rows"].tolist() == [[0, 4], [2, 6]]  # micro-batch k of rank 0 with rank 1's
    g2, tr_sigma, dof = r0[f"{got}/estimate"].tolist()
    assert dof == 1.0 and tr_sigma > 0  # two expert parts: one degree of freedom
    print(f"{variant}: estimate |G|² {g2:.4g}, tr Σ {tr_sigma:.4g} (tokens)")
    # the unions are not the ranks' own parts: a rank's experts see both ranks' tokens
    own = r0[f"{ref}/ref_own_expert_parts"]
    assert _rel(own[:2] + own[2:], r0[f"{ref}/ref_expert_parts"]) > 1e-3


def test_noise_probe_at_ep1_reads_every_parameter_as_one_class(run: dict) -> None:
    """At EP=1 the probe keeps one class, as before: each part is the rank's dense and expert
    gradient of its own micro-batch together."""
    r0 = run["ranks"][0]
    ref = "ep1/plain/probe"
    want = r0[f"{ref}/ref_dense_parts"] + r0[f"{ref}/ref_own_expert_parts"]
    assert _rel(r0[f"{ref}/parts"], want) < 1e-6


# ------------------------------------------------- routing replay (R3): worker_moe_replay.py

LAYERS, EXPERTS = 4, 4
REPLAYS = ["replay_one", "replay_fixed", "replay_budget", "replay_packed"]
LENGTHS = _real_lengths()
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
    print(
        f"{layout}: mean |log π_update - log π_old| after the router perturbation: live {live:.3g}, replay {replay:.3g}"
    )
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
    """moe/route_mismatch/layer0 = the share of real tokens whose first-layer experts moved (the
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


# ------------------------------------ routing replay from the engines (algo.router_replay: rollout)


@pytest.mark.parametrize("layout", ["ep1", "ep2", "pp2"])
def test_engine_routes_replayed_in_the_old_forward(run: dict, layout: str) -> None:
    """Phase 2 with the engine's routes (every layer, in the batch): each stage replays its own
    layers' (PP 2: global layers 2s, 2s+1), in fixed micro-batches, token budgets and packed
    alike (EP 1), its log-probs are the update's replayed ones (the same weights and routes), and
    ``moe/engine_route_mismatch`` counts the live choices that differ from the engine's exactly
    as the update's ``moe/route_mismatch`` does."""
    for rank in (0, 1):
        r, one = _r3(run, layout, rank), _r3(run, "ep1", 0)
        assert torch.equal(r["engine_routes"], one["routes"].masked_fill(~REAL[:, :, None, None], -1))
        layers = slice(2 * rank, 2 * rank + 2) if layout == "pp2" else slice(None)
        assert torch.equal(r["engine_fixed/routes"], r["engine_routes"][:, :, layers])
        names = ["fixed", "budget", "packed"] if layout != "ep2" else ["fixed"]
        m = torch.zeros(B, S, dtype=torch.bool)
        m[:, :-1] = REAL[:, 1:]  # positions whose label is a real token
        for name in names[1:]:
            assert _max_diff(r[f"engine_{name}/old"][m], r["engine_fixed/old"][m]) < 1e-5, name
            assert torch.equal(r[f"engine_{name}/mismatch"], r["engine_fixed/mismatch"])
        if layout == "pp2":
            assert _max_diff(r["engine_fixed/old"], one["engine_fixed/old"]) < 1e-5
            continue
        replayed = r["engine_fixed/lp"].item()
        print(f"{layout} rank {rank}: Σ old log-probs replaying the engine's routes {replayed:.6f}, "
              f"the update's replay {r['replay_one/lp'].item():.6f}")  # fmt: skip
        assert abs(replayed - r["replay_one/lp"].item()) < 1e-6 * abs(replayed)  # (measured 1e-7; live routing: 1.3e-5)
        assert torch.equal(r["engine_fixed/mismatch"], r["replay_one/mismatch"])
        assert ((r["engine_fixed/mismatch"] > 0) & (r["engine_fixed/mismatch"] < 1)).all()
