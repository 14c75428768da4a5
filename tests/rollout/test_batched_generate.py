"""``BatchedGenerate`` (the agents' requests gathered into joined fleet calls): each request
keeps its own seed, an episode's later calls ask for the engine that served its call before
(prefix cache), and a long call does not hold up the others (calls run concurrently, as the
engines' continuous batch serves them)."""

from __future__ import annotations

import threading
import time
from typing import Any

from megarl.rollout.agents import BatchedGenerate


class TwoEngines:
    """A stand-in fleet of two engines: a prompt goes to its preferred engine, else to the engine
    with fewer prompts in the call; the ids say which seed and engine made them."""

    def __init__(self) -> None:
        self.calls = 0
        self.served: list[tuple[int, int, str | None, str]] = []
        """(episode, call, engine asked for, engine that served) per prompt, in order."""
        self.ended: list[tuple[int, int]] = []
        """(episode, call) in the order they ended."""
        self.lock = threading.Lock()

    def generate(self, prompts: list[list[int]], **kw: Any) -> tuple[list[list[dict[str, Any]]], int]:
        assert kw["join"] is True
        time.sleep(0.05 * kw["max_tokens"] / 8)  # a call of 48 tokens takes 0.3 s, of 8 tokens 0.05 s
        load = {"e0": 0, "e1": 0}
        outs = []
        for prompt, seed, prefer in zip(prompts, kw["seeds"], kw["prefer"], strict=True):
            engine = prefer or min(load, key=load.__getitem__)
            load[engine] += 1
            with self.lock:
                self.served.append((prompt[1], prompt[2], prefer, engine))
                self.ended.append((prompt[1], prompt[2]))
            outs.append([{"token_ids": [seed % 50, 2], "logprobs": [-0.1, -0.2], "finish_reason": "stop",
                          "engine": engine}])  # fmt: skip
        with self.lock:
            self.calls += 1
        return outs, 3


def test_an_episodes_calls_follow_its_engine() -> None:
    fleet = TwoEngines()
    gen = BatchedGenerate(fleet, [2])  # type: ignore[arg-type]
    served: dict[int, list[list[int]]] = {}

    def agent(episode: int) -> None:
        for call in range(3):
            max_tokens = 48 if episode == 0 else 8  # episode 0's calls are slow
            ids, logprobs, finish = gen([1, episode, call], max_tokens, 1.0, 1.0, episode * 10 + call, episode)
            assert (logprobs, finish) == ([-0.1, -0.2], "stop")
            served.setdefault(episode, []).append(ids)

    try:
        threads = [threading.Thread(target=agent, args=(e,)) for e in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        gen.close()
    assert served == {e: [[e * 10 + c, 2] for c in range(3)] for e in range(4)}  # each its own seed
    assert gen.calls == fleet.calls <= 12 and len(fleet.served) == 12
    first_slow = fleet.ended.index((0, 0))
    assert {(e, c) for e in (1, 2, 3) for c in range(3)} <= set(fleet.ended[:first_slow])  # none waited for it
    engine_of = {ep: engine for ep, call, _, engine in fleet.served if call == 0}
    for ep, call, prefer, engine in fleet.served:
        assert prefer == (None if call == 0 else engine_of[ep]) and engine == engine_of[ep], fleet.served
