"""A CPU engine's seeded sampler (``rollout.cpu_sampler``): ``batched`` hashes (request seed,
draw index) for all rows at once instead of one generator call per row. It must still sample
the softmax distribution, give a request the same tokens whatever batch it shares, give every
step its own noise, and reach the worker processes of a TP > 1 engine."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.checkpoint.hf_adapter import LlamaQwen2Adapter, model_config_from_hf
from megarl.config import ModelConfig
from megarl.engine import cpu_sampler
from megarl.engine.cpu_sampler import draw_seeds, use_cpu_sampler
from megarl.engine.staging import MANIFEST
from megarl.fleet.fleet import Fleet
from tests.helpers import tiny_hf_model

MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:  # the reference: Vigna's splitmix64.c, one output for state x
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_draw_seeds_match_splitmix64_in_python_ints() -> None:
    seeds = [0, 1, 2, 12345, 2**31 - 1, 2**63 + 7, MASK]  # Generator.initial_seed() is a uint64
    draws = [0, 1, 5, 0, 999, 3, 2**20]
    got = draw_seeds(seeds, draws).tolist()
    assert got == [_splitmix64(_splitmix64(s) ^ d) >> 33 for s, d in zip(seeds, draws)]
    assert all(0 <= g < 2**31 for g in got)
    grid = draw_seeds([s for s in range(64) for _ in range(64)], [d for _ in range(64) for d in range(64)])
    assert len(set(grid.tolist())) == 64 * 64  # no two (seed, draw) pairs share a stream here


def _sampler(mode: str) -> torch.nn.Module:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    use_cpu_sampler(mode)  # before the sampler is built: it binds its method then
    return TopKTopPSampler(logprobs_mode="processed_logprobs")


@pytest.fixture(autouse=True)
def _restore_mode():  # the switch is process-wide: leave it as the tests found it
    before = cpu_sampler._mode
    yield
    cpu_sampler._mode = before


def _gens(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _sample(sampler: torch.nn.Module, logits: torch.Tensor, gens: dict[int, torch.Generator]) -> list[int]:
    tokens, logprobs = sampler(logits.clone(), gens, None, None)
    assert logprobs is not None and torch.allclose(logprobs, logits.log_softmax(-1), atol=1e-6)
    return tokens.tolist()


def test_batched_sampler_draws_the_softmax_distribution() -> None:
    sampler = _sampler("batched")
    assert getattr(sampler.forward, "megarl_batched", False)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = 20000
    logits = probs.log().expand(rows, -1).contiguous()
    gens = dict(enumerate(_gens(list(range(rows)))))
    first, second = _sample(sampler, logits, gens), _sample(sampler, logits, gens)
    expected = probs.numpy() * rows
    for tokens in (first, second):  # the second step draws afresh from the same distribution
        counts = np.bincount(tokens, minlength=5)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        print(f"counts {counts.tolist()} expected {expected.round().tolist()} chi2 {chi2:.2f} (4 dof)")
        assert chi2 < 18.5, chi2  # p = 0.001 at 4 degrees of freedom
    same = float(np.mean(np.array(first) == np.array(second)))
    assert abs(same - float((probs**2).sum())) < 0.02, same  # independent draws agree with P = sum p^2
    assert _sample(sampler, logits, dict(enumerate(_gens(list(range(rows)))))) == first  # same seeds, same draws


def test_a_request_gets_the_same_tokens_whatever_shares_its_batch() -> None:
    sampler = _sampler("batched")
    torch.manual_seed(0)
    vocab = 1000
    steps = [torch.randn(8, vocab) for _ in range(6)]  # the logits each of 8 requests sees at 6 steps

    def run(order: list[int], extra_unseeded: int) -> dict[int, list[int]]:
        gens = _gens([100 + r for r in order])
        out: dict[int, list[int]] = {r: [] for r in order}
        for logits in steps:
            rows = torch.cat([logits[order], torch.randn(extra_unseeded, vocab)])  # unseeded rows last
            tokens = _sample(sampler, rows, dict(enumerate(gens)))
            for slot, r in enumerate(order):
                out[r].append(tokens[slot])
        return out

    alone = run(list(range(8)), 0)
    mixed = run([5, 2, 7, 0], 3)
    for r in (5, 2, 7, 0):
        assert mixed[r] == alone[r], r
    assert all(len(set(seq)) > 1 for seq in alone.values())  # each step has its own noise


def test_vllm_mode_is_vllms_own_per_row_draw() -> None:
    sampler = _sampler("vllm")
    logits = torch.randn(6, 50)
    got = _sample(sampler, logits, dict(enumerate(_gens([7, 8, 9, 10, 11, 12]))))
    seeds = torch.tensor(
        [torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long).item() for g in _gens([7, 8, 9, 10, 11, 12])]
    )
    assert got == torch.ops._C.fused_gumbel_argmax(logits, seeds).tolist()
    with pytest.raises(ValueError, match="cpu_sampler 'numpy' unknown"):
        use_cpu_sampler("numpy")


def _engine_dir(tmp_path: Path) -> Path:
    hf = tiny_hf_model(tmp_path / "hf", arch="qwen3", vocab=64, tie=True, seed=1, qk_gain=4.0)
    adapter = LlamaQwen2Adapter(model_config_from_hf(json.loads((hf / "config.json").read_text()), ModelConfig()))
    engine_dir = tmp_path / "hf_engine"
    adapter.hf_config(2, 1, 0).save_pretrained(str(engine_dir))
    (engine_dir / MANIFEST).write_text(json.dumps(adapter.hf_shapes()))
    shutil.copy(hf / "model.safetensors", engine_dir / "model.safetensors")
    return engine_dir


def test_engines_sample_with_the_mode_asked_for_tp_workers_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2: the two vLLM worker processes build their own sampler, so ``batched`` must reach
    them (``MEGARL_CPU_SAMPLER``): their tokens are then those of a TP 1 engine with the same mode."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    engine_dir = _engine_dir(tmp_path)
    prompts = [[1, 5 + i, 9, 13] for i in range(8)]
    seeds: list[int | None] = [1000 + i for i in range(8)]

    def tokens(mode: str, tp: int, calls: list[list[int]]) -> tuple[list[list[list[int]]], str]:
        """Each call's samples from one engine started for them (later calls on the same engine)."""
        logs = tmp_path / f"logs_{mode}_{tp}"
        fleet = Fleet.start_local(
            engine_dir, 1, tp, 0.25, logs, seed=0, request_timeout_s=120, start_timeout_s=300, cpu_sampler=mode
        )
        results = []
        try:
            for which in calls:
                out, _ = fleet.generate(
                    [prompts[i] for i in which],
                    n=4,
                    max_tokens=12,
                    temperature=1.0,
                    top_p=1.0,
                    stop_token_ids=[],
                    seeds=[seeds[i] for i in which],
                    ignore_eos=True,
                    logprobs=False,
                )
                results.append([list(s["token_ids"]) for group in out for s in group])
        finally:
            fleet.shutdown()
        return results, (logs / "engine0.log").read_text()

    # requests 6 and 1 alone, in another order, after the whole batch on the same engine
    (batched, part), log = tokens("batched", 1, [list(range(8)), [6, 1]])
    assert "CPU sampler batched" in log
    assert part == batched[6 * 4 : 7 * 4] + batched[1 * 4 : 2 * 4]
    (stock,), log = tokens("vllm", 1, [list(range(8))])
    assert "CPU sampler vllm" in log
    assert stock != batched  # another stream (so the TP 2 comparison below can tell them apart)
    (tp2,), log = tokens("batched", 2, [list(range(8))])
    assert tp2 == batched
