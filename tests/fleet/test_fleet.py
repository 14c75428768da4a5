"""The fleet against real vLLM engine processes: two engines serve identical weights after a
sync, an engine killed mid-generation is restarted and its prompts re-issued (the step still
gets every sample), and a corrupted update is rejected by name while the old version keeps
serving — through files (shm) and through request bodies (http). A PP=2 Megatron trainer
pushing over http leaves the engines exactly where a shm push of the same weights does."""

import json
import shutil
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from megarl.engine.credentials import STAGING_ENV, TOKEN_ENV, auth_header
from megarl.engine.staging import MANIFEST
from megarl.errors import WeightSyncError
from megarl.fleet.fleet import Fleet
from tests.helpers import ROOT, one_rank_group, tiny_hf_model, torchrun


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("fleet")
    hf = tiny_hf_model(base / "hf", vocab=64)
    weights = load_file(str(hf / "model.safetensors"))
    (hf / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in weights.items()}))
    f = Fleet.start_local(hf, num_engines=2, engine_tp=1, kv_cache_gb=0.25, log_dir=base / "logs", seed=0,
                          request_timeout_s=120, start_timeout_s=300)
    f.update_weights(1, [_staged(f, hf / "model.safetensors")])
    yield f, hf, weights, f.staging_dir  # engines read weight files only from their staging folder
    f.shutdown()


def _staged(f: Fleet, path: Path) -> str:
    """A copy of ``path`` inside the fleet's private staging folder (where the shm transport writes)."""
    dst = f.staging_dir / "test" / f"{path.parent.name}_{path.name}"
    dst.parent.mkdir(exist_ok=True)
    shutil.copy(path, dst)
    return str(dst)


PROMPTS = [[1, 5 + i, 7, 9 + (i % 5)] for i in range(12)]
SEQ = [1, 5, 9, 13, 17, 21, 25]


def _max_diff(a: list, b: list) -> float:
    """Max |a - b| over engines × sequences × positions (same layout required)."""
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


def _generation(f: Fleet, seeded: bool = True) -> tuple[list, int]:
    """Three samples of every prompt in PROMPTS, prompt i seeded with i (or the engines' RNG)."""
    return f.generate(PROMPTS, n=3, max_tokens=5, temperature=1.0, top_p=1.0, stop_token_ids=[2],
                      seeds=list(range(len(PROMPTS))) if seeded else None)


def test_two_engines_serve_the_same_weights(fleet) -> None:
    f, _, _, _ = fleet
    assert f.versions() == [1, 1]
    seq = [1, 5, 9, 13, 17, 21, 25]
    per_engine = f.logprobs([seq], temperature=1.0)
    assert len(per_engine) == 2
    a, b = (torch.tensor(x[0]) for x in per_engine)
    assert a.shape == (6,) and torch.allclose(a, b, atol=1e-6)
    outs, version = _generation(f)
    assert version == 1 and len(outs) == len(PROMPTS) and all(len(g) == 3 for g in outs)
    # same seeds -> same samples, whichever engine served each prompt (load balancing is invisible)
    again, _ = _generation(f)
    assert [[s["token_ids"] for s in g] for g in outs] == [[s["token_ids"] for s in g] for g in again]
    # unseeded (rollout.seeded=false): the engines' RNG, so two calls differ
    u1, _ = _generation(f, seeded=False)
    u2, _ = _generation(f, seeded=False)
    assert [[s["token_ids"] for s in g] for g in u1] != [[s["token_ids"] for s in g] for g in u2]
    # min_tokens: EOS (id 2, stop token here) is suppressed until 5 tokens, so every response has 5
    eos_stop, _ = f.generate(PROMPTS, n=3, max_tokens=5, temperature=1.0, top_p=1.0, stop_token_ids=[2, 7],
                             seeds=list(range(len(PROMPTS))), min_tokens=5)
    assert all(len(s["token_ids"]) == 5 for g in eos_stop for s in g)


class _IdsTok:
    """Row ``rows:i`` is the prompt [1, 5 + i % 40, 7]; a response "decodes" to its ids (so a
    batch's texts are its token ids)."""

    pad_id, eos_ids = 0, [2]

    def encode_prompt(self, rec) -> list[int]:
        return [1, 5 + int(rec.where.split(":")[1]) % 40, 7]

    def decode_many(self, batch: list[list[int]]) -> list[str]:
        return [str(ids) for ids in batch]


class _NoRewards:
    def score(self, samples: list) -> tuple[list[float], object]:
        from megarl.rewards.runner import RewardReport

        return [0.0] * len(samples), RewardReport(samples=len(samples))


def _collected(f: Fleet, sampling_seed: str, per_step: int, steps: int, samples: int) -> list[list[str]]:
    """Per prompt taken (in stream order), its samples' token ids: ``steps`` steps of ``per_step`` prompts."""
    from megarl.config import load_config
    from megarl.data.prompts import PromptRecord
    from megarl.rollout.collector import RolloutCollector
    from megarl.rollout.sampling import CollectSettings

    sets = [f"rollout.sampling_seed={sampling_seed}", "rollout.max_response_len=6", "rollout.engine_logprobs_every=0"]
    cfg = load_config(None, sets)
    rows = [PromptRecord(f"q{i}", "a", f"rows:{i}") for i in range(100)]
    dims = type("Dims", (), {"is_rank0": True})()
    col = RolloutCollector(CollectSettings.of(cfg), dims, _IdsTok(), f, rows, rows[:1], _NoRewards())  # type: ignore[arg-type]
    groups = []
    for step in range(steps):
        batch, _ = col.collect(step, per_step, samples)
        groups += [batch.texts[i : i + samples] for i in range(0, len(batch.texts), samples)]
    return groups


_one_rank = pytest.fixture(scope="module")(one_rank_group)  # (collect broadcasts its batch)


def test_prompt_keyed_seeds_couple_runs_of_different_batch_sizes(fleet, _one_rank) -> None:
    """``rollout.sampling_seed: prompt``: with the same weights, a run of 4 prompts a step and one
    of 8 sample the same tokens for each (stream position, sample index) they share — also with
    fewer samples a prompt; ``round`` seeds by step and place in the round, so they differ."""
    f, _, _, _ = fleet
    small = _collected(f, "prompt", per_step=4, steps=2, samples=3)
    large = _collected(f, "prompt", per_step=8, steps=1, samples=3)
    assert len(small) == len(large) == 8
    assert small == large
    assert len({s for g in large for s in g}) > 12  # real draws: not one response repeated
    pairs = _collected(f, "prompt", per_step=8, steps=1, samples=2)
    assert pairs == [g[:2] for g in large]
    small_r = _collected(f, "round", per_step=4, steps=2, samples=3)
    large_r = _collected(f, "round", per_step=8, steps=1, samples=3)
    assert small_r[:4] == large_r[:4]  # step 0, the same places in the round
    assert all(a != b for a, b in zip(small_r[4:], large_r[4:]))  # step 1 of 4 vs places 4-7 of step 0


def test_balance_by_outstanding_tokens() -> None:
    from megarl.fleet.client import EngineClient as Engine

    engines = [Engine("e0", "a:1"), Engine("e1", "b:1")]
    prompts = [[0] * 100, [0] * 10, [0] * 10, [0] * 10, [0] * 10]
    shares = dict((e.name, idx) for e, idx in Fleet._balance(list(range(5)), prompts, 1, 10, engines, [None] * 5))
    assert shares["e0"] == [0] and shares["e1"] == [1, 2, 3, 4]  # not round-robin


def test_prompts_go_to_their_preferred_engine_and_the_rest_balance_around_them() -> None:
    """An episode's later turns go to the engine of its earlier ones (its prefix cache) while it
    serves; prompts without a preference, or preferring an engine not serving, fill the rest."""
    from megarl.fleet.client import EngineClient as Engine

    engines = [Engine("e0", "a:1"), Engine("e1", "b:1")]
    prompts = [[0] * 10] * 6
    prefer = ["e0", "e0", "e0", None, None, "e2"]  # e2: not among the engines serving (restarting)
    shares = dict((e.name, idx) for e, idx in Fleet._balance(list(range(6)), prompts, 1, 10, engines, prefer))
    assert shares["e0"] == [0, 1, 2] and shares["e1"] == [3, 4, 5]
    shares = dict((e.name, idx) for e, idx in Fleet._balance([1, 3], prompts, 1, 10, engines, prefer))
    assert shares["e0"] == [1] and shares["e1"] == [3]


def test_corrupted_update_is_rejected_and_old_version_serves(fleet) -> None:
    f, hf, weights, base = fleet
    seq = [1, 5, 9, 13, 17, 21, 25]
    before = f.logprobs([seq], temperature=1.0)
    bad = dict(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    bad[name] = bad[name][:, :-1].contiguous()  # wrong shape
    save_file(bad, str(base / "bad_shape.safetensors"))
    with pytest.raises(WeightSyncError, match=name.replace(".", r"\.") + ".*shape"):
        f.update_weights(2, [str(base / "bad_shape.safetensors")])
    nan = {k: v.clone() for k, v in weights.items()}
    nan["model.norm.weight"][3] = float("nan")
    save_file(nan, str(base / "nan.safetensors"))
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*NaN"):
        f.update_weights(2, [str(base / "nan.safetensors")])
    partial = {k: v for k, v in weights.items() if "layers.0." not in k}
    save_file(partial, str(base / "partial.safetensors"))
    with pytest.raises(WeightSyncError, match="incomplete"):
        f.update_weights(2, [str(base / "partial.safetensors")])
    assert f.versions() == [1, 1]
    assert f.logprobs([seq], temperature=1.0) == before


def test_engine_killed_mid_generation_is_restarted(fleet) -> None:
    f, _, _, _ = fleet
    victim = f.engines[0]
    assert victim.proc is not None
    pid = victim.proc.pid
    prompts = [[1, 5 + (i % 40), 7] for i in range(512)]
    result: dict = {}

    def run() -> None:
        result["out"] = f.generate(prompts, n=2, max_tokens=48, temperature=1.0, top_p=1.0, stop_token_ids=[],
                                   ignore_eos=True)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "generation finished before the kill; make the workload larger"
    victim.proc.kill()
    t.join(timeout=300)
    outs, version = result["out"]
    assert len(outs) == 512 and all(len(g) == 2 and all(len(s["token_ids"]) == 48 for s in g) for g in outs)
    assert f.restarts >= 1 and f.reissued_prompts > 0
    assert victim.proc.pid != pid and victim.proc.poll() is None
    assert f.versions() == [1, 1]  # the restarted engine got the current weights before serving
    assert version == 1


def test_waves_fit_the_cache_and_the_step_budget() -> None:
    from megarl.engine.vllm_engine import waves
    from megarl.errors import EngineError

    # 3 samples × ceil((4 + 20) / 16) blocks = 96 tokens per prompt; 256 tokens hold 2 prompts
    assert waves([4] * 5, 3, 20, 16, 256) == [(0, 2), (2, 4), (4, 5)]
    assert waves([4] * 5, 3, 20, 16, 10_000) == [(0, 5)]
    with pytest.raises(EngineError, match="prompt 1: 3 samples × 40 tokens need 144 KV tokens"):
        waves([4, 20], 3, 20, 16, 128)
    # seeded on CPU: 3 × 10 prompt tokens per prompt, 64 a step -> 2 prompts a wave;
    # at most 7 sequences a step -> 2 prompts (6 sequences) a wave
    assert waves([10] * 5, 3, 4, 16, 10_000, prefill=(64, 1000)) == [(0, 2), (2, 4), (4, 5)]
    assert waves([1] * 5, 3, 4, 16, 10_000, prefill=(64, 7)) == [(0, 2), (2, 4), (4, 5)]
    assert waves([10, 1, 1, 30], 2, 4, 16, 10_000, prefill=(64, 1000)) == [(0, 3), (3, 4)]
    with pytest.raises(EngineError, match=r"prompt 1: 3 seeded samples × 30 prompt tokens cannot be prefilled"
                       r" in one step of the CPU engine \(64 tokens, 1000 sequences\).*rollout\.seeded=false"):
        waves([10, 30], 3, 4, 16, 10_000, prefill=(64, 1000))


def test_seeded_requests_over_one_step_budget(fleet) -> None:
    """More seeded prefill than one scheduler step of vLLM's CPU default (4096 tokens) holds:
    vLLM would chunk a prefill and then rewind the CPU generator, which kills the engine ("CPU
    Generator does not use offset"). megarl raises the budget to 16384 and sizes waves under
    it. Same samples as the same prompts sent in small calls, and no engine restarted."""
    f, _, _, _ = fleet
    prompts = [[1] + [5 + (i + j) % 50 for j in range(44)] for i in range(104)]  # 4 × 52 × 45 = 9360 an engine
    kw = dict(n=4, max_tokens=3, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True)
    seeds, restarts = list(range(len(prompts))), f.restarts
    big, _ = f.generate(prompts, seeds=seeds, **kw)
    small = [g for i in range(0, len(prompts), 26)
             for g in f.generate(prompts[i : i + 26], seeds=seeds[i : i + 26], **kw)[0]]
    assert [[s["token_ids"] for s in g] for g in big] == [[s["token_ids"] for s in g] for g in small]
    assert f.restarts == restarts  # no engine died (the fleet would have restarted it)


def test_a_cpu_engine_runs_a_512_sequence_round_in_one_wave(fleet) -> None:
    """``CPU_MAX_SEQS``: 32 seeded prompts × 16 samples on one engine is one call of vLLM's
    (vLLM's CPU default of 256 sequences a step would make it two waves, logged)."""
    f, _, _, _ = fleet
    logs = [e.log_path for e in f.engines if e.log_path is not None]
    sizes = [log.stat().st_size for log in logs]
    prompts = [[1, 5 + i % 40, 9, 13] for i in range(64)]  # 32 an engine
    out, _ = f.generate(prompts, n=16, max_tokens=2, temperature=1.0, top_p=1.0, stop_token_ids=[],
                        seeds=list(range(64)), ignore_eos=True, logprobs=False)  # fmt: skip
    assert sum(len(g) for g in out) == 64 * 16
    assert len(logs) == 2
    for log, size in zip(logs, sizes):
        with log.open() as fh:
            fh.seek(size)
            assert "waves" not in fh.read(), log


def test_generation_without_logprobs_samples_the_same_tokens(fleet) -> None:
    """``logprobs=False`` (a step that does not read them, and validation): the same seeded
    samples, no log-probs; with them, one log-prob per sampled token, each that token's under the
    engine's own prompt log-probs of the whole sequence."""
    f, _, _, _ = fleet
    kw = dict(n=3, max_tokens=5, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True,
              seeds=list(range(len(PROMPTS))))
    with_lp, _ = f.generate(PROMPTS, **kw)
    without, _ = f.generate(PROMPTS, logprobs=False, **kw)
    assert [[s["token_ids"] for s in g] for g in without] == [[s["token_ids"] for s in g] for g in with_lp]
    assert all(s["logprobs"] == [] for g in without for s in g)
    assert all(len(s["logprobs"]) == len(s["token_ids"]) == 5 for g in with_lp for s in g)
    seq = PROMPTS[0] + with_lp[0][0]["token_ids"]
    scored = f.logprobs([seq], temperature=1.0)[0][0]  # engine 0: log p(seq[t+1] | seq[:t+1])
    assert _max_diff([scored[len(PROMPTS[0]) - 1 :]], [with_lp[0][0]["logprobs"]]) < 1e-4


def test_small_kv_cache_generates_in_waves_with_identical_samples(fleet, tmp_path) -> None:
    """Seeded requests that overflow the KV cache: waves instead of vLLM preemption (which
    crashes the CPU build on seeded requests), same samples as an engine with a big cache."""
    f, hf, _, _ = fleet
    small = Fleet.start_local(hf, num_engines=1, engine_tp=1, kv_cache_gb=0.002, log_dir=tmp_path, seed=0,
                              request_timeout_s=120, start_timeout_s=300)
    try:
        small.update_weights(1, [_staged(small, hf / "model.safetensors")])
        kw = dict(n=3, max_tokens=20, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True,
                  seeds=list(range(len(PROMPTS))))
        got, _ = small.generate(PROMPTS, **kw)
        want, _ = f.generate(PROMPTS, **kw)
        assert [[s["token_ids"] for s in g] for g in got] == [[s["token_ids"] for s in g] for g in want]
        assert "waves" in (tmp_path / "engine0.log").read_text()
    finally:
        small.shutdown()


def test_http_bytes_rejected_by_name_and_old_version_serves(fleet) -> None:
    f, hf, weights, _ = fleet
    before = f.logprobs([SEQ], temperature=1.0)
    name = "model.layers.2.self_attn.k_proj.weight"
    cases = [
        ({name: weights[name][:-1].contiguous()}, "'" + name.replace(".", r"\.") + r"' has shape \[63, 128\], engine expects \[64, 128\]"),
        ({"model.norm.weight": torch.full_like(weights["model.norm.weight"], float("inf"))}, r"model\.norm\.weight.*NaN/Inf"),
        ({"lm_head.bias": torch.zeros(64)}, r"'lm_head\.bias' in the request body is not a weight of this model"),
        ({"model.norm.weight": weights["model.norm.weight"].to(torch.int32)}, r"model\.norm\.weight.*dtype int32"),
    ]
    for bad, match in cases:
        good = save({k: v for k, v in weights.items() if k not in bad and k != name})
        f.begin_update(2)
        f.load_bytes(2, good)  # staged on both engines ...
        with pytest.raises(WeightSyncError, match=match):
            f.load_bytes(2, save(bad))  # ... then a bad bucket: the transport aborts the update
        f.abort_update()
    with pytest.raises(WeightSyncError, match=r"not a safetensors buffer"):
        f.begin_update(3)
        f.load_bytes(3, b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    f.abort_update()
    with pytest.raises(WeightSyncError, match=r"load for version 4 without begin \(staged: None\)"):
        f.load_bytes(4, save({"model.norm.weight": weights["model.norm.weight"]}))
    # the body must be declared binary: a JSON client cannot smuggle a pickle or a path here
    req = urllib.request.Request(f"http://{f.engines[0].address}/weights/load_bytes?version=5", data=b"{}",
                                 headers={"Content-Type": "application/json", **auth_header(f.engines[0].token)})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 409 and b"expects Content-Type application/octet-stream" in info.value.read()
    assert f.versions() == [1, 1]
    assert f.logprobs([SEQ], temperature=1.0) == before


def test_http_push_from_pp2_trainer_matches_shm(fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, hf, weights, base = fleet
    before = f.logprobs([SEQ], temperature=1.0)
    # new weights (an independent HF folder): what the trainer holds and pushes
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    folder = tmp_path / "hf_new"
    folder.mkdir()
    shutil.copy(hf / "config.json", folder / "config.json")
    save_file(new, str(folder / "model.safetensors"))
    out = tmp_path / "result.json"
    # the trainer attaches like one started by SLURM: credential and staging folder from its environment
    monkeypatch.setenv(TOKEN_ENV, f.engines[0].token)
    monkeypatch.setenv(STAGING_ENV, str(f.staging_dir))
    try:
        torchrun(ROOT / "tests/weight_sync/worker_http_sync.py", 2,
                 ["--hf", str(folder), "--addresses", ",".join(e.address for e in f.engines), "--version", "10",
                  "--out", str(out)], timeout=600)
        res = json.loads(out.read_text())
        http, shm, nan = res["http"], res["shm"], res["nan"]
        assert (http["transport"], shm["transport"]) == ("http", "shm")
        assert http["versions"] == [10, 10] and shm["versions"] == [11, 11]
        assert http["stats"]["bytes"] == 4 * sum(v.numel() for v in new.values())  # both stages, fp32
        assert _max_diff(http["logprobs"], before) > 0.05  # the update took effect ...
        assert _max_diff(http["logprobs"], shm["logprobs"]) <= 1e-6  # ... exactly as shm's did
        assert http["integrity"] <= 1e-3  # and the engines agree with the trainer's own forward
        # the same weights from the HF file directly (no Megatron, no http): the same engines
        f.update_weights(12, [_staged(f, folder / "model.safetensors")])
        assert _max_diff(f.logprobs([SEQ], temperature=1.0), http["logprobs"]) <= 1e-6
        # NaN on stage 1 over http: every rank raised the same error naming the tensor; version 11 serves
        assert nan["errors_per_rank"][0] == nan["errors_per_rank"][1] == nan["error"]
        assert "weight update to version 12 rejected" in nan["error"]
        assert "tensor 'model.norm.weight' contains NaN/Inf" in nan["error"]
        assert nan["versions"] == [11, 11] and nan["logprobs"] == shm["logprobs"]
    finally:
        f.update_weights(1, [_staged(f, hf / "model.safetensors")])  # later tests expect version 1
    assert f.logprobs([SEQ], temperature=1.0) == before


def test_engine_dead_between_commits_is_restarted_at_the_new_version(fleet, monkeypatch) -> None:
    """engine0 commits version 2, engine1 is SIGKILLed just before its commit (the fault
    hook): the update still succeeds, engine1 comes back at version 2 and agrees with engine0."""
    f, hf, weights, base = fleet
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(new, str(base / "v2.safetensors"))
    before = f.logprobs([SEQ], temperature=1.0)
    restarts, pid = f.restarts, f.engines[1].proc.pid
    monkeypatch.setenv("MEGARL_FAULT", "kill_engine_at=sync_commit:version=2:engine=1")
    try:
        f.update_weights(2, [str(base / "v2.safetensors")])
        assert f.restarts == restarts + 1 and f.engines[1].proc.pid != pid
        assert f.versions() == [2, 2]
        after = f.logprobs([SEQ], temperature=1.0)
        assert _max_diff(after, before) > 0.01  # the new weights serve ...
        assert _max_diff(after[:1], after[1:]) <= 1e-6  # ... on both engines, the restarted one too
    finally:
        f.update_weights(1, [_staged(f, hf / "model.safetensors")])  # later tests expect version 1
    assert f.versions() == [1, 1] and f.logprobs([SEQ], temperature=1.0) == before


def test_rejected_update_with_a_dead_engine_restarts_it_at_the_old_version(fleet, monkeypatch) -> None:
    """engine0 is SIGKILLed after begin of an update that engine1 then rejects (NaN): the
    rejection is still a WeightSyncError naming the tensor, and engine0 comes back at version 1."""
    f, _, weights, base = fleet
    before = f.logprobs([SEQ], temperature=1.0)
    nan = {k: v.clone() for k, v in weights.items()}
    nan["model.norm.weight"][0] = float("nan")
    save_file(nan, str(base / "nan_dead.safetensors"))
    restarts = f.restarts
    monkeypatch.setenv("MEGARL_FAULT", "kill_engine_at=sync_begin:version=7:engine=0")
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*NaN"):
        f.update_weights(7, [str(base / "nan_dead.safetensors")])
    assert f.restarts == restarts + 1
    assert f.versions() == [1, 1]
    assert f.logprobs([SEQ], temperature=1.0) == before


def test_dead_remote_engine_is_a_clear_error(tmp_path) -> None:
    """An engine megarl did not start (an address only) cannot be restarted: the error names it."""
    from megarl.errors import RolloutError
    from megarl.fleet.client import EngineClient as Engine
    from megarl.fleet.client import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there: a real refused connection
    f = Fleet([Engine("engine0", address)], request_timeout_s=5, start_timeout_s=5)
    with pytest.raises(RolloutError, match=f"engine engine0 \\({address}\\) is down and remote"):
        f.generate([[1, 2]], n=1, max_tokens=2, temperature=1.0, top_p=1.0, stop_token_ids=[])
    with pytest.raises(RolloutError, match="is down and remote"):
        f.update_weights(1, [str(tmp_path / "none.safetensors")])


def test_engine_spawned_before_its_folder_waits_for_it_and_exits_promptly(tmp_path: Path) -> None:
    """The trainer spawns its engines before it writes their model folder (they import vLLM
    meanwhile, ``--wait-for-model``): an engine waits for the manifest, then serves the synced
    weights; asked to shut down it exits with status 0 at once, not after vLLM's seconds of
    teardown. An engine whose folder never comes fails its start, naming the file."""
    from megarl.errors import RolloutError

    src = tiny_hf_model(tmp_path / "src", vocab=64)
    weights = load_file(str(src / "model.safetensors"))
    late = tmp_path / "late"  # does not exist yet
    f = Fleet.start_local(late, num_engines=1, engine_tp=1, kv_cache_gb=0.25, log_dir=tmp_path / "logs", seed=0,
                          request_timeout_s=120, start_timeout_s=300, wait=False, wait_for_model_s=120)
    try:
        time.sleep(1.0)
        assert f.engines[0].alive() and f.engines[0].health(timeout=1) is None  # waiting, not serving
        late.mkdir()
        shutil.copy(src / "config.json", late / "config.json")
        (late / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in weights.items()}))
        f.ready()
        f.update_weights(1, [_staged(f, src / "model.safetensors")])
        assert f.versions() == [1]
        (lp,) = f.logprobs([SEQ], temperature=1.0)
        assert len(lp[0]) == len(SEQ) - 1 and all(x <= 0 for x in lp[0])
        proc = f.engines[0].proc
        assert proc is not None
        t0 = time.perf_counter()
    finally:
        f.shutdown()
    took = time.perf_counter() - t0
    assert proc.returncode == 0
    assert took < 2.0, f"the engine took {took:.2f} s to exit after /shutdown"  # ~3.5 s before exit_now

    never = Fleet.start_local(tmp_path / "never", num_engines=1, engine_tp=1, kv_cache_gb=0.25,
                              log_dir=tmp_path / "logs2", seed=0, start_timeout_s=300, wait=False, wait_for_model_s=1)
    try:
        with pytest.raises(RolloutError, match=f"exited with code 2 during start.*no {tmp_path / 'never' / MANIFEST} after 1 s"):
            never.ready()
    finally:
        never.shutdown()


def test_one_engine_takes_an_update_in_one_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet of one engine updates from files with a single /weights/load that opens, stages
    and commits: new weights serve; a rejected file leaves the old ones serving and nothing
    staged; an engine killed just before that request comes back at the new version."""
    hf = tiny_hf_model(tmp_path / "hf", vocab=64)
    weights = load_file(str(hf / "model.safetensors"))
    (hf / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in weights.items()}))
    f = Fleet.start_local(hf, num_engines=1, engine_tp=1, kv_cache_gb=0.25, log_dir=tmp_path / "logs", seed=0,
                          request_timeout_s=120, start_timeout_s=300)  # fmt: skip
    try:
        original = _staged(f, hf / "model.safetensors")
        f.update_weights(1, [original])
        before = f.logprobs([SEQ], temperature=1.0)
        g = torch.Generator().manual_seed(3)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        save_file(new, str(f.staging_dir / "new.safetensors"))
        engine, paths = f.engines[0], []
        exchange = engine._exchange

        def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            paths.append(path)
            return exchange(path, *args, **kwargs)

        monkeypatch.setattr(engine, "_exchange", counted)
        f.update_weights(2, [str(f.staging_dir / "new.safetensors")])
        assert paths == ["/weights/load"]
        assert f.versions() == [2] and f.version == 2
        after = f.logprobs([SEQ], temperature=1.0)
        assert _max_diff(after, before) > 0.01

        nan = {k: v.clone() for k, v in new.items()}
        nan["model.layers.0.mlp.down_proj.weight"][1, 2] = float("inf")
        save_file(nan, str(f.staging_dir / "nan.safetensors"))
        with pytest.raises(WeightSyncError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*NaN/Inf"):
            f.update_weights(3, [str(f.staging_dir / "nan.safetensors")])
        assert f.versions() == [2] and f.logprobs([SEQ], temperature=1.0) == after
        with pytest.raises(WeightSyncError, match="commit for version 3, staged None"):
            f.commit_update(3)  # the rejected update was dropped, not left staged

        restarts, pid = f.restarts, engine.proc.pid
        monkeypatch.setenv("MEGARL_FAULT", "kill_engine_at=sync_commit:version=4:engine=0")
        f.update_weights(4, [original])
        assert f.restarts == restarts + 1 and f.engines[0].proc.pid != pid
        assert f.versions() == [4]
        assert f.logprobs([SEQ], temperature=1.0) == before  # the restarted engine replayed version 4
    finally:
        f.shutdown()


def _samples(outs: list) -> list:
    """What was sampled (ids, log-probs, why it stopped), not which engine sampled it."""
    return [[{k: v for k, v in x.items() if k != "engine"} for x in g] for g in outs]


def _wait_restarted(f: Fleet, timeout: float = 300.0) -> None:
    """Until the background restarts under way have finished (not yet collected by recover)."""
    for job in list(f.restarting.values()):
        assert job.done.wait(timeout), "background restart did not finish"


def test_survivor_serves_while_a_dead_engine_restarts_in_the_background(fleet) -> None:
    """#41 E: engine0 dies mid-generation; engine1 finishes the step alone with the same seeds
    (the same samples as an undisturbed step), without waiting for engine0, which restarts in
    its own thread, gets no prompts while it serves stale weights, and serves again from the
    next update on. Then the survivor dies too while engine0 waits to join: the fleet waits for
    nothing but gives engine0 the current weights at once (the replay)."""
    f, hf, _, _ = fleet
    prompts = [[1, 5 + (i % 40), 7] for i in range(256)]
    seeds = list(range(len(prompts)))
    kw = dict(n=2, max_tokens=32, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True, seeds=seeds)
    calm, _ = f.generate(prompts, **kw)
    f.restart_in_background = True
    try:
        victim, survivor = f.engines
        restarts, rejoins, pid = f.restarts, f.rejoins, victim.proc.pid
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(out=f.generate(prompts, **kw)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "generation finished before the kill; make the workload larger"
        victim.proc.kill()
        t.join(timeout=300)
        outs, version = result["out"]
        assert _samples(outs) == _samples(calm) and version == 1  # every sample as if nothing had happened
        assert {x["engine"] for g in outs for x in g} == {survivor.name}  # (the re-issued ones included)
        assert f.restarts == restarts + 1 and victim.proc.pid != pid
        assert victim.name in f.restarting and not f.restarting[victim.name].done.is_set()  # still starting
        assert f.serving() == [survivor]
        _wait_restarted(f)
        f.recover()  # collects it: healthy, stale weights -> joining, no prompts
        assert victim.name in f.joining and f.serving() == [survivor]
        f.pop_timings()
        again, _ = f.generate(prompts, **kw)
        assert _samples(again) == _samples(calm)
        assert set(k.split("/")[1] for k in f.timings if k.startswith("engine_s/")) == {survivor.name}
        f.update_weights(1, [_staged(f, hf / "model.safetensors")])  # the next update: it joins
        assert f.serving() == [victim, survivor] and not f.joining and f.rejoins == rejoins + 1
        assert f.versions() == [1, 1]
        per_engine = f.logprobs([SEQ], temperature=1.0)
        assert _max_diff(per_engine[:1], per_engine[1:]) <= 1e-6

        # no survivor: engine1 dies while engine0 is joining -> engine0 is replayed and serves now
        victim.proc.kill()
        f.generate(prompts[:8], **kw | {"seeds": seeds[:8]})  # finds engine0 dead, restarts it behind
        _wait_restarted(f)
        survivor.proc.kill()
        survivor.proc.wait()
        out, version = f.generate(prompts, **kw)
        assert _samples(out) == _samples(calm) and version == 1
        assert victim.name not in f.joining and victim in f.serving()
        f.recover()
        _wait_restarted(f)
        f.update_weights(1, [_staged(f, hf / "model.safetensors")])
        assert f.versions() == [1, 1] and not f.restarting and not f.joining
    finally:
        f.restart_in_background = False


def test_an_engine_killed_under_concurrent_joined_calls_is_restarted_once(fleet) -> None:
    """Joined calls (multi-turn episodes) come from many threads at once: when an engine dies
    under them, every call re-issues its prompts and gets the samples of an undisturbed run (the
    same ids; log-probs to rounding, as the batch they share changes), and the engine is
    restarted once, not once per call that saw it die."""
    f, _, _, _ = fleet
    calls = [[[1, 5 + (32 * c + i) % 40, 7] for i in range(32)] for c in range(8)]  # 512 sequences of 48 ids
    kw = dict(n=2, max_tokens=48, temperature=1.0, top_p=1.0, stop_token_ids=[], ignore_eos=True, join=True)
    calm = [f.generate(p, seeds=[100 * c + i for i in range(32)], **kw)[0] for c, p in enumerate(calls)]
    restarts, victim = f.restarts, f.engines[0]
    results: dict[int, tuple] = {}

    def run(c: int) -> None:
        results[c] = f.generate(calls[c], seeds=[100 * c + i for i in range(32)], **kw)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert any(t.is_alive() for t in threads), "the calls finished before the kill; make them longer"
    victim.proc.kill()
    for t in threads:
        t.join(timeout=300)
    got = [x for c in range(8) for g in results[c][0] for x in g]
    want = [x for o in calm for g in o for x in g]
    assert [x["token_ids"] for x in got] == [x["token_ids"] for x in want]
    assert _max_diff([x["logprobs"] for x in got], [x["logprobs"] for x in want]) < 1e-4
    assert f.restarts == restarts + 1 and f.versions() == [1, 1]


def test_an_engine_that_dies_again_while_restarting_is_quoted_from_its_own_log(tmp_path: Path) -> None:
    """All starts append to one log: the error quotes only what the last process wrote."""
    from megarl.errors import RolloutError
    from megarl.fleet.client import EngineClient as Engine

    log_path = tmp_path / "engine0.log"
    log_path.write_text("INFO an earlier process of this engine said this\n")
    silent = Engine("engine0", "127.0.0.1:9", launch=[sys.executable, "-c", "raise SystemExit(3)"],
                    log_path=log_path)
    f = Fleet([silent], request_timeout_s=5, start_timeout_s=30)
    with pytest.raises(RolloutError) as err:
        f.restart(silent, attempts=2)
    assert "earlier process" not in str(err.value) and "wrote nothing" in str(err.value)
    assert f.restarts == 2
    talker = Engine("engine0", "127.0.0.1:9", launch=[sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"],
                    log_path=log_path)
    f = Fleet([talker], request_timeout_s=5, start_timeout_s=30)
    with pytest.raises(RolloutError, match="cannot bind") as err:
        f.restart(talker, attempts=1)
    assert "earlier process" not in str(err.value)
