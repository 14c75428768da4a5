"""``rollout.prefix_caching``: vLLM's prefix cache shares whole KV blocks of a prompt, so with
prompts no longer than one block it never hits and only costs. ``auto`` turns it off then;
the real engines must agree with the block size the rule assumes, and sample the same tokens
either way."""

from pathlib import Path

import pytest

from megarl.engine.vllm_engine import KV_BLOCK, prefix_caching_on
from megarl.errors import EngineError
from megarl.rollout.fleet import Fleet
from tests.engine.test_cpu_sampler import _engine_dir


def test_auto_is_off_only_when_no_prompt_can_outgrow_a_block() -> None:
    assert not prefix_caching_on("auto", 12, 128)
    assert not prefix_caching_on("auto", 128, 128)  # a hit leaves one prompt token to compute
    assert prefix_caching_on("auto", 129, 128)
    assert prefix_caching_on("auto", 0, 128)  # not known: vLLM's default
    assert prefix_caching_on("auto", 17, KV_BLOCK["cuda"])
    assert prefix_caching_on("on", 4, 128) and not prefix_caching_on("off", 4096, 16)
    with pytest.raises(EngineError, match="prefix_caching 'yes' unknown"):
        prefix_caching_on("yes", 12, 128)


def test_engines_apply_it_and_sample_the_same_tokens(tmp_path: Path) -> None:
    engine_dir = _engine_dir(tmp_path)
    prompts = [[1, 5 + i, 9, 13, 17 + i] for i in range(6)]

    def run(mode: str) -> tuple[list[list[int]], str]:
        logs = tmp_path / f"logs_{mode}"
        fleet = Fleet.start_local(
            engine_dir, 1, 1, 0.25, logs, seed=0, request_timeout_s=120, start_timeout_s=300,
            prefix_caching=mode, max_prompt_len=8,
        )  # fmt: skip
        try:
            out, _ = fleet.generate(
                prompts, n=4, max_tokens=10, temperature=1.0, top_p=1.0, stop_token_ids=[],
                seeds=[50 + i for i in range(len(prompts))], ignore_eos=True, logprobs=True,
            )  # fmt: skip
        finally:
            fleet.shutdown()
        log = (logs / "engine0.log").read_text()
        return [list(s["token_ids"]) for group in out for s in group], log

    auto, log = run("auto")
    assert f"(block size {KV_BLOCK['cpu']})" in log  # the size prefix_caching_on assumes on CPU
    assert "prefix caching off (prompts of at most 8 tokens)" in log
    on, log = run("on")
    assert "prefix caching on" in log
    assert on == auto
    assert len({tuple(t) for t in auto}) > len(prompts)  # the samples of one prompt differ
