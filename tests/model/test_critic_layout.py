"""The PPO critic on its OWN TP/PP/DP layout, next to an actor on another one, in one world of
2 gloo ranks: values, one value-loss Adam step (loss, grad norm, updated weights) and the
values after it match a single-rank reference; a checkpoint saved on one critic layout loads
bit-exactly into another and the next step agrees; the layout's groups follow megatron's
rank order. Tolerances are test_parity.py's (values < 5e-6, weights after one step < 2e-6)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, tiny_hf_model, torchrun

WORKER = ROOT / "tests/model/worker_critic_layout.py"

RUNS = {  # name: (nproc, actor layout args, critic layouts, checkpoint src:dst pairs)
    "ref": (1, [], "t1p1", ""),
    "actor_tp2": (2, ["--tp", "2"], "t2p1,t1p1,t1p2,t1p1d", "t1p1:t1p2,t1p2:t2p1,t1p1d:t2p1d"),
    "actor_pp2": (2, ["--pp", "2"], "t2p1,t1p1", "t2p1:t1p1"),
    "actor_dp2": (2, [], "t2p1,t1p2", "t2p1:t1p2"),
}
ACTOR = {"actor_tp2": (2, 1), "actor_pp2": (1, 2), "actor_dp2": (1, 1)}
CRITICS = [(run, c) for run, (_, _, critics, _) in RUNS.items() if run != "ref" for c in critics.split(",")]
PAIRS = [(run, p) for run, (_, _, _, pairs) in RUNS.items() for p in pairs.split(",") if p]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("critic_layout")
    hf = tiny_hf_model(base / "hf")
    out: dict = {}
    for name, (nproc, actor, critics, pairs) in RUNS.items():
        d = base / name
        d.mkdir()
        torchrun(WORKER, nproc, ["--hf", str(hf), "--out", str(d), *actor, "--critics", critics, "--ckpt", pairs])
        out[name] = load_file(str(d / "result.safetensors"))
        out[name + "/info"] = json.loads((d / "info.json").read_text())
    out["hf_dir"] = hf
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize(("run", "critic"), CRITICS, ids=[f"{r}-{c}" for r, c in CRITICS])
def test_critic_layout_matches_reference(results: dict, run: str, critic: str) -> None:
    ref, got = results["ref"], results[run]
    for k in ("values0", "values1"):
        assert _maxdiff(ref[f"t1p1/{k}"], got[f"{critic}/{k}"]) < 5e-6, k
    assert abs(ref["t1p1/loss"].item() - got[f"{critic}/loss"].item()) < 1e-6
    g = ref["t1p1/grad_norm"].item()
    assert g > 0 and abs(g - got[f"{critic}/grad_norm"].item()) < 1e-5 * max(1.0, g)
    ref_w = {k.split("/", 2)[2]: v for k, v in ref.items() if k.startswith("t1p1/w1/")}
    got_w = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{critic}/w1/")}
    assert ref_w.keys() == got_w.keys() and "value_head" in ref_w and "model.embed_tokens.weight" in ref_w
    for k in ref_w:
        assert _maxdiff(ref_w[k], got_w[k]) < 2e-6, k


def test_reference_step_is_a_real_update(results: dict) -> None:
    """The compared step moves values and the trunk's weights (the test can fail)."""
    ref = results["ref"]
    assert _maxdiff(ref["t1p1/values0"], ref["t1p1/values1"]) > 1e-4
    init = load_file(str(results["hf_dir"] / "model.safetensors"))
    moved = max(_maxdiff(ref[f"t1p1/w1/{k}"], v) for k, v in init.items() if f"t1p1/w1/{k}" in ref)
    assert moved > 1e-4


@pytest.mark.parametrize("run", ["actor_tp2", "actor_pp2", "actor_dp2"])
def test_critic_groups_follow_megatron_rank_order(results: dict, run: str) -> None:
    from megarl.distributed import layout_ranks

    tp, pp = ACTOR[run]
    for spec, info in results[run + "/info"]["critics"].items():
        ctp, cpp = int(spec[1 : spec.index("p")]), int(spec[spec.index("p") + 1 :].rstrip("d"))
        assert info["global"] == ((ctp, cpp) == (tp, pp)), spec
        assert (info["tp"], info["pp"], info["dp"]) == (ctp, cpp, 2 // (ctp * cpp)), spec
        # rank 0's groups in a world of 2, written out by hand: TP2 pairs ranks 0-1 for TP,
        # PP2 pairs them for PP, otherwise the two ranks are data-parallel replicas
        assert info["tp_ranks"] == ([0, 1] if ctp == 2 else [0]), spec
        assert info["pp_ranks"] == ([0, 1] if cpp == 2 else [0]), spec
        assert info["dp_ranks"] == ([0, 1] if ctp * cpp == 1 else [0]), spec
        assert info["rng_inside_ok"] and info["rng_restored"], spec
    # megatron's order (tp-cp-ep-dp-pp: TP fastest, then DP, then PP) on bigger worlds, against
    # megatron's own rank generator (the independent oracle)
    from megatron.core.parallel_state import RankGenerator

    for world, ltp, lpp in [(8, 2, 2), (8, 4, 1), (8, 1, 4), (8, 1, 1), (12, 2, 3), (16, 4, 2)]:
        gen = RankGenerator(tp=ltp, ep=1, dp=world // (ltp * lpp), pp=lpp, cp=1, order="tp-cp-ep-dp-pp")
        r = layout_ranks(world, ltp, lpp)
        for kind, token in (("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("mp", "tp-pp")):
            assert r[kind] == gen.get_ranks(token), (world, ltp, lpp, kind)
    r = layout_ranks(8, 2, 2)
    assert r["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert r["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert r["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert r["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize(("run", "pair"), PAIRS, ids=[f"{r}-{p}" for r, p in PAIRS])
def test_checkpoint_reshards_between_critic_layouts(results: dict, run: str, pair: str) -> None:
    """Saved on critic layout A (after one step), loaded into layout B: identical weights,
    same values, and the next step (Adam moments + step count resharded) agrees."""
    got = results[run]
    src, _ = pair.split(":")
    w1 = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{src}/w1/")}
    loaded = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{pair}/at_load/")}
    assert w1.keys() == loaded.keys() and "value_head" in w1
    for k in w1:
        assert torch.equal(w1[k], loaded[k]), k
    assert _maxdiff(got[f"{src}/values1"], got[f"{pair}/loaded_values"]) < 5e-6
    assert abs(got[f"{pair}/orig/loss2"].item() - got[f"{pair}/loaded/loss2"].item()) < 1e-6
    w2o = {k.split("/", 3)[3]: v for k, v in got.items() if k.startswith(f"{pair}/orig/w2/")}
    w2l = {k.split("/", 3)[3]: v for k, v in got.items() if k.startswith(f"{pair}/loaded/w2/")}
    assert w2o.keys() == w2l.keys() == w1.keys()
    assert max(_maxdiff(w2o[k], w1[k]) for k in w1) > 1e-4  # the second step moved the weights
    for k in w2o:
        assert _maxdiff(w2o[k], w2l[k]) < 2e-6, k
    tp, pp = int(src[1 : src.index("p")]), int(src[src.index("p") + 1 :].rstrip("d"))
    layout = results[run + "/info"]["ckpt_layouts"][pair]
    assert (layout["tp"], layout["pp"], layout["world_size"]) == (tp, pp, 2)
