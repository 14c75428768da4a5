"""The ``/generate`` reply as one binary frame (``megarl.engine.wire``): every id, log-prob
(bit for bit) and finish reason survives the round trip, it is several times smaller and
faster than the JSON it replaced, and a damaged frame is refused by name, never misread."""

import json
import random
import struct
import time

import pytest

from megarl.engine.wire import GENERATION_MAGIC, decode_generation, encode_generation


def _outputs(seed: int, prompts: int = 32, n: int = 16, max_len: int = 6) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        group = []
        for _ in range(n):
            k = rng.randrange(0, max_len + 1)  # empty responses happen (EOS first)
            group.append({
                "token_ids": [rng.randrange(0, 152_000) for _ in range(k)],
                "logprobs": [-rng.expovariate(0.5) for _ in range(k)],  # arbitrary doubles
                "finish_reason": rng.choice([None, "stop", "length", "abort"]),
            })  # fmt: skip
        out.append(group)
    return out


def test_round_trip_is_exact() -> None:
    for seed in range(5):
        outputs = _outputs(seed)
        version, back, timings = decode_generation(encode_generation(7 + seed, outputs, {"engine_s": 0.25}))
        assert version == 7 + seed and timings == {"engine_s": 0.25}
        assert back == outputs  # lists of ints and floats compare exactly: float64 on the wire
    assert decode_generation(encode_generation(-1, [])) == (-1, [], {})
    assert decode_generation(encode_generation(2, [[]])) == (2, [[]], {})  # a prompt with no samples


def test_frame_is_smaller_and_faster_than_json() -> None:
    outputs = _outputs(0)  # the demo's 32 prompts × 16 samples × up to 6 tokens
    frame = encode_generation(3, outputs)
    text = json.dumps({"version": 3, "outputs": outputs}).encode()
    assert len(frame) * 2 < len(text), (len(frame), len(text))

    def best(fn) -> float:
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    t_frame = best(lambda: decode_generation(encode_generation(3, outputs)))
    t_json = best(lambda: json.loads(json.dumps({"version": 3, "outputs": outputs})))
    assert t_frame < t_json, (t_frame, t_json)


def test_routes_round_trip_exactly() -> None:
    """MoE routes (``algo.router_replay: rollout``): each sample's (rows, layers, top-k) experts,
    as vLLM's uint8/uint16 arrays come, arrive as int16 of the same values; none: no route
    arrays at all (the frame of a dense run is unchanged)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    outputs = _outputs(3, prompts=3, n=2)
    for group in outputs:
        for s in group:  # prompt of 4 tokens + response - 1 rows, 3 layers, top-2, 128 experts
            s["routes"] = rng.integers(0, 128, size=(4 + max(len(s["token_ids"]) - 1, 0), 3, 2)).astype(np.uint8)
    _, back, _ = decode_generation(encode_generation(5, outputs))
    for group, got in zip(outputs, back):
        for s, b in zip(group, got):
            assert b["routes"].dtype == torch.int16 and b["routes"].shape == s["routes"].shape
            assert torch.equal(b["routes"], torch.from_numpy(s["routes"].astype(np.int16)))
            assert b["token_ids"] == s["token_ids"]
    # below 256 experts one byte a route (+ 4 bytes of row count a sample, a few header fields)
    n_routes = sum(s["routes"].size for g in outputs for s in g)
    extra = len(encode_generation(5, outputs)) - len(encode_generation(5, _outputs(3, prompts=3, n=2)))
    assert n_routes + 4 * 6 < extra < n_routes + 4 * 6 + 100, (extra, n_routes)
    wide = [[{**outputs[0][0], "routes": np.full((2, 3, 2), 300, dtype=np.uint16)}]]  # two bytes a route
    assert int(decode_generation(encode_generation(1, wide))[1][0][0]["routes"].max()) == 300
    plain = _outputs(3, prompts=3, n=2)
    assert b"route_shape" not in encode_generation(5, plain)
    with pytest.raises(ValueError, match="routes in some samples"):
        encode_generation(5, [[outputs[0][0], plain[0][0]]])
    with pytest.raises(ValueError, match="alike in every sample"):
        encode_generation(5, [[outputs[0][0], {**outputs[0][1], "routes": np.zeros((2, 4, 2))}]])


def test_damaged_frames_are_refused() -> None:
    frame = encode_generation(3, _outputs(1, prompts=2, n=2))
    with pytest.raises(ValueError, match="not a generation frame"):
        decode_generation(b'{"version": 3, "outputs": []}')
    with pytest.raises(ValueError, match="runs past"):
        decode_generation(frame[:-3])
    with pytest.raises(ValueError, match="bytes after the last array"):
        decode_generation(frame + b"\0")
    # a header whose counts disagree with the arrays (two ids fewer than the lengths say)
    m = len(GENERATION_MAGIC)
    (hlen,) = struct.unpack_from("<I", frame, m)
    header = json.loads(frame[m + 4 : m + 4 + hlen])
    header["ids"] -= 2
    head = json.dumps(header).encode()
    bad = GENERATION_MAGIC + struct.pack("<I", len(head)) + head + frame[m + 4 + hlen : -8]
    with pytest.raises(ValueError, match="do not add up"):
        decode_generation(bad)


def test_unknown_finish_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="finish_reason 'eos' has no wire code"):
        encode_generation(1, [[{"token_ids": [1], "logprobs": [-0.5], "finish_reason": "eos"}]])


def test_recover_skips_health_of_an_engine_that_just_answered() -> None:
    """An engine whose last answer is fresh costs no request in ``Fleet.recover``; once that
    answer is older than ``fresh_s`` recover asks /health again (here nothing listens there,
    and a remote engine that does not answer cannot be restarted: the error names it)."""
    from megarl.errors import RolloutError
    from megarl.fleet.client import EngineClient, free_port
    from megarl.fleet.fleet import Fleet

    e = EngineClient("engine0", f"127.0.0.1:{free_port()}", token="t")  # nothing listens
    fleet = Fleet([e], request_timeout_s=5, start_timeout_s=5)
    e.answered_at, e.served_version = time.monotonic(), 4
    fleet.recover()  # no request made: it would have failed
    e.answered_at -= fleet.fresh_s + 1
    with pytest.raises(RolloutError, match=r"engine engine0 \(127\.0\.0\.1:\d+\) is down and remote"):
        fleet.recover()
