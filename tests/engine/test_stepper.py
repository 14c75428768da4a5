"""Continuous batching (``megarl.engine.stepper``, ``/generate`` with ``join``): on a real engine
server, a short call sent while a long one runs returns first with the tokens it gets alone; a
weight update is not starved by calls that keep coming, and each call runs under one version. With a stand-in for vLLM's engine (it isolates the admission rules): requests are
admitted only while every running request's worst case fits the KV cache and a step's budget,
and a failing step fails its calls, not those that come after."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megarl.engine.staging import MANIFEST
from megarl.engine.stepper import Call, EngineLock, Stepper
from megarl.fleet.fleet import Fleet

VOCAB = 64


def _model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    (folder / MANIFEST).write_text(json.dumps({k: list(v.shape) for k, v in model.state_dict().items()}))
    return folder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("stepper")
    model = _model(base / "model")
    fleet = Fleet.start_local(model, 1, 1, 0.25, base / "logs", seed=0, request_timeout_s=120, start_timeout_s=300)
    fleet.staged_model = fleet.staging_dir / "test" / "model.safetensors"  # type: ignore[attr-defined]
    fleet.staged_model.parent.mkdir(exist_ok=True)  # type: ignore[attr-defined]
    shutil.copy(model / "model.safetensors", fleet.staged_model)  # type: ignore[attr-defined]
    fleet.update_weights(1, [str(fleet.staged_model)])  # type: ignore[attr-defined]
    yield fleet
    fleet.shutdown()


def _gen(fleet: Fleet, prompts: list[list[int]], max_tokens: int, seeds: list[int], join: bool) -> tuple[Any, int]:
    return fleet.generate(prompts, n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=[],
                          seeds=list(seeds), ignore_eos=True, join=join)  # fmt: skip


def test_a_short_call_joins_a_long_one_and_returns_first(fleet: Fleet) -> None:
    long_prompt, short = [[5, 6, 7, 8]], [[[9, 10 + i, 11]] for i in range(3)]
    alone_long, _ = _gen(fleet, long_prompt, 400, [1], join=False)
    alone_short = [_gen(fleet, p, 4, [10 + i], join=False)[0] for i, p in enumerate(short)]
    ended: dict[str, float] = {}
    got: dict[str, Any] = {}

    def long_call() -> None:
        got["long"], got["long_v"] = _gen(fleet, long_prompt, 400, [1], join=True)
        ended["long"] = time.perf_counter()

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(0.15)  # the long call is running
    for i, p in enumerate(short):
        got[f"s{i}"], _ = _gen(fleet, p, 4, [10 + i], join=True)
        ended[f"s{i}"] = time.perf_counter()
    thread.join(timeout=120)
    assert max(ended[f"s{i}"] for i in range(3)) < ended["long"], ended  # none waited for the long call
    ids = lambda out: [list(s["token_ids"]) for g in out for s in g]  # noqa: E731
    assert ids(got["long"]) == ids(alone_long) and len(ids(alone_long)[0]) == 400
    assert [ids(got[f"s{i}"]) for i in range(3)] == [ids(o) for o in alone_short]  # its seed, whatever it shares
    assert got["long_v"] == fleet.version


def test_an_update_is_not_starved_by_calls_that_keep_coming(fleet: Fleet) -> None:
    """Three threads keep joined calls running back to back; the update still goes through
    (no new call is admitted while it waits, so the batch drains), and every call reports the
    version it ran under: the old one if it ended before the update began, the new one if it
    began after the update ended."""
    before = fleet.version
    calls: list[tuple[float, float, int]] = []  # (start, end, version)
    stop = threading.Event()

    def stream(k: int) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            _, v = _gen(fleet, [[5, 6, 7 + k]], 40, [100 * k + i], join=True)
            calls.append((t0, time.perf_counter(), v))
            i += 1

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    fleet.update_weights(before + 1, [str(fleet.staged_model)])  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert t1 - t0 < 10.0  # (a starved update would wait for the streams to stop)
    old = [v for start, end, v in calls if end < t0]
    new = [v for start, end, v in calls if start > t1]
    assert old and new and set(old) == {before} and set(new) == {before + 1}, (t0, t1, calls)


class FakeEngine:
    """vLLM's ``llm_engine`` as the stepper drives it: a request of ``max_tokens`` ids ends after
    that many steps (prefill included); ``fail_at`` makes a step raise. It checks the admission
    rule itself: the running requests' worst case never passes the KV cache."""

    def __init__(self, kv_tokens: int, block: int, fail_at: int = -1) -> None:
        self.kv, self.block, self.fail_at = kv_tokens, block, fail_at
        self.running: dict[str, list[Any]] = {}  # id -> [steps left, worst-case KV tokens]
        self.steps, self.most_reserved, self.aborted = 0, 0, []
        self.step_s = 0.0

    def add_request(self, rid: str, prompt: Any, params: Any) -> None:
        need = params.n * -(-(len(prompt["prompt_token_ids"]) + params.max_tokens) // self.block) * self.block
        self.running[rid] = [params.max_tokens, need]
        self.most_reserved = max(self.most_reserved, sum(r[1] for r in self.running.values()))
        assert self.most_reserved <= self.kv, "admitted past the KV cache (vLLM would preempt)"

    def step(self) -> list[Any]:
        time.sleep(self.step_s)
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("step failed")
        out = []
        for rid, r in list(self.running.items()):
            r[0] -= 1
            if r[0] == 0:
                del self.running[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True, outputs=[rid]))
        return out

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids
        for rid in ids:
            self.running.pop(rid, None)


def _stepper(kv: int, budget: tuple[int, int] | None, fail_at: int = -1) -> tuple[Stepper, FakeEngine]:
    fake = FakeEngine(kv, 16, fail_at)
    engine = SimpleNamespace(llm=SimpleNamespace(llm_engine=fake), lock=EngineLock(), version=4, kv_tokens=kv,
                             cpu_prefill=budget, unhealthy=lambda: None)  # fmt: skip

    def abort_all(error: BaseException) -> None:
        fake.abort_request(list(fake.running))

    engine.abort_all = abort_all
    return Stepper(engine), fake


def _call(plens: list[int], max_tokens: int, n: int = 1) -> Call:
    params = [SimpleNamespace(n=n, max_tokens=max_tokens) for _ in plens]
    need = [n * -(-(p + max_tokens) // 16) * 16 for p in plens]
    return Call([{"prompt_token_ids": [1] * p} for p in plens], params, need, [n * p for p in plens], n)


def _concurrently(stepper: Stepper, calls: list[Call]) -> list[Any]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = stepper.run(calls[i])
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=30)
    return out


def test_requests_wait_for_room_in_the_kv_cache_and_the_step_budget() -> None:
    stepper, fake = _stepper(kv=256, budget=None)  # four requests of 64 worst-case tokens fit at once
    fake.step_s = 0.002  # a request runs 0.1 s: the calls (10 ms apart) overlap
    calls = [_call([8, 8, 8], 50) for _ in range(3)]  # nine requests: 576 tokens if all ran
    done = _concurrently(stepper, calls)
    assert all(isinstance(c, Call) and c.version == 4 and None not in c.outputs for c in done), done
    assert fake.most_reserved == 256 and stepper.most_running == 4
    stepper, fake = _stepper(kv=10_000, budget=(20, 3))  # a step prefills 20 prompt tokens, runs 3 sequences
    fake.step_s = 0.002
    done = _concurrently(stepper, [_call([8, 8], 5), _call([8], 5), _call([8, 8], 5)])
    assert all(isinstance(c, Call) for c in done) and stepper.most_running <= 3


def test_a_failing_step_fails_its_calls_only() -> None:
    stepper, fake = _stepper(kv=10_000, budget=None, fail_at=3)
    first = _concurrently(stepper, [_call([4, 4], 10)])[0]
    assert isinstance(first, RuntimeError) and sorted(fake.aborted) == ["j0", "j1"]
    later = _concurrently(stepper, [_call([4], 3)])[0]  # the engine recovered (nothing stuck): it serves
    assert isinstance(later, Call) and [o.outputs for o in later.outputs] == [["j2"]]


def test_nothing_is_admitted_past_a_waiting_update_but_a_started_call_finishes() -> None:
    stepper, fake = _stepper(kv=64, budget=None)  # one request at a time
    fake.step_s = 0.005  # call a: 2 × 20 steps, 0.2 s; the update comes at 0.05 s, call b at 0.1 s
    engine = stepper.engine
    a, b = _call([8, 8], 20), _call([8], 20)  # a's second request waits for its first's room
    seen: dict[str, object] = {}

    def update() -> None:
        time.sleep(0.05)
        with engine.lock:  # (what an update's commit does)
            seen.update(a_done=a.done.is_set(), b_admitted=b.admitted)
            engine.version = 5

    def call(c: Call, delay: float) -> None:
        time.sleep(delay)
        stepper.run(c)

    threads = [threading.Thread(target=call, args=(a, 0.0)), threading.Thread(target=update),
               threading.Thread(target=call, args=(b, 0.1))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"a_done": True, "b_admitted": 0}  # a (started) ran to its end; b waited for the update
    assert (a.version, b.version) == (4, 5) and None not in a.outputs + b.outputs
