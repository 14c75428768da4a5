"""Wire formats of the GPU transports, checked on CPU: a bucket as one flat buffer + JSON
records round-trips bit for bit, and CUDA IPC rebuild arguments survive JSON (no pickle)
exactly, with the receiver's device index substituted. The CUDA calls themselves
(reduce_tensor / rebuild_cuda_tensor) run in tests/gpu/test_transports_gpu.py."""

import json

import pytest
import torch

from megarl.engine import wire


def test_flatten_roundtrip_is_exact_and_aligned() -> None:
    g = torch.Generator().manual_seed(0)
    named = [
        ("a.weight", torch.randn(3, 5, generator=g)),  # 60 bytes: the next tensor must start aligned
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(2, 3, 4, generator=g).to(torch.float16)),
        ("d.weight", torch.randn(4, 4, generator=g)[:, 1:]),  # non-contiguous input
    ]
    buf, records = wire.flatten(named)
    assert buf.dtype == torch.uint8
    assert [r["offset"] for r in records] == [0, 64, 80, 128]
    assert buf.numel() == 176
    assert json.loads(json.dumps(records)) == records  # records are plain JSON
    back = wire.unflatten(buf, records)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, t), (_, u) in zip(named, back):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    # views, not copies: the engine stages without an extra copy of the buffer
    back[0][1][0, 0] = 42.0
    assert float(wire.unflatten(buf, records[:1])[0][1][0, 0]) == 42.0


def test_unflatten_rejects_records_outside_the_buffer_or_non_float() -> None:
    buf, records = wire.flatten([("w", torch.ones(4))])
    with pytest.raises(ValueError, match=r"tensor 'w' \(32 bytes at 0\) lies outside the 16-byte buffer"):
        wire.unflatten(buf, [dict(records[0], shape=[8])])
    with pytest.raises(ValueError, match="tensor 'w' has dtype int64"):
        wire.unflatten(buf, [dict(records[0], dtype="int64")])
    with pytest.raises(ValueError, match="tensor 'i' has dtype torch.int64"):
        wire.flatten([("i", torch.arange(3))])


def _fake_cuda_args() -> tuple:
    """The 15 arguments reduce_tensor produces for a CUDA tensor (handles are opaque bytes)."""
    return (
        torch.nn.Parameter,
        torch.Size([4, 8]),
        (8, 1),
        16,
        torch.storage.TypedStorage,
        torch.bfloat16,
        3,
        bytes(range(64)),  # cudaIpcMemHandle
        4096,
        512,
        False,
        b"/torch_123_ref\x00\xff",
        7,
        bytes(range(255, 191, -1)),  # cudaIpcEventHandle
        True,
    )


def test_ipc_rebuild_args_roundtrip_through_json() -> None:
    args = _fake_cuda_args()
    encoded = wire.encode_rebuild_args(args)
    text = json.dumps(encoded)  # what travels in the /weights/ipc_load body
    decoded = wire.decode_rebuild_args(json.loads(text))
    assert decoded == args
    assert isinstance(decoded[1], torch.Size) and decoded[5] is torch.bfloat16
    assert encoded["storage_handle"] == "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw=="
    # the receiver numbers the same GPU its own way: only the device index changes
    moved = wire.decode_rebuild_args(json.loads(text), device=0)
    assert moved[6] == 0 and moved[:6] == args[:6] and moved[7:] == args[7:]
    # no event handle (event_sync_required False) stays None
    no_event = (*args[:13], None, False)
    assert wire.decode_rebuild_args(json.loads(json.dumps(wire.encode_rebuild_args(no_event)))) == no_event


def test_ipc_decode_refuses_unknown_classes_and_dtypes() -> None:
    encoded = wire.encode_rebuild_args(_fake_cuda_args())
    with pytest.raises(ValueError, match=r"unknown classes 'os.system'"):
        wire.decode_rebuild_args(dict(encoded, tensor_cls="os.system"))
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        wire.decode_rebuild_args(dict(encoded, dtype="Tensor"))
    with pytest.raises(ValueError, match=r"lacks \['event_handle'\]"):
        wire.decode_rebuild_args({k: v for k, v in encoded.items() if k != "event_handle"})
    with pytest.raises(ValueError, match="cannot encode tensor class"):
        wire.encode_rebuild_args((dict, *_fake_cuda_args()[1:]))
