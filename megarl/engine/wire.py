"""Wire formats shared by the trainer and the engine workers (pure torch, no megatron, no vLLM).

* A bucket travels as ONE flat ``uint8`` buffer plus a JSON list of tensor records
  ``{"name", "shape", "dtype", "offset"}`` (byte offset into the buffer). NCCL broadcasts that
  buffer; CUDA IPC shares it. :func:`flatten` / :func:`unflatten` are exact inverses.
* CUDA IPC handles: ``torch.multiprocessing.reductions.reduce_tensor`` gives
  ``(rebuild_cuda_tensor, args)``. The args are encoded as JSON (classes and dtypes by name
  from an allow-list, bytes as base64) — never pickle, so an engine only ever rebuilds a
  plain tensor from a request body. The receiver substitutes its own device index for the
  sender's (the two processes may number the same GPU differently).
* Generations (the ``/generate`` reply) travel as one binary frame, not JSON lists of ids:
  a small JSON header (version, byte order, counts) then flat arrays — samples per prompt,
  response lengths, finish-reason codes, token ids (int32) and log-probs (float64, so
  every value arrives bit-identical). :func:`encode_generation` / :func:`decode_generation`
  are exact inverses; decoding checks every length against the frame before reading. With
  MoE routing replay from the engines (``algo.router_replay: rollout``) each sample also
  carries ``routes`` (rows, layers, top-k): the experts vLLM sent each token to (two more
  arrays after the others, one byte a route up to 256 experts, else two; the header's
  ``route_shape`` = [layers, top-k] and ``route_code`` say so); they arrive as int16.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from array import array
from typing import Any

import torch

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""dtypes a weight may travel in (engines reject anything else)."""

_ALIGN = 16  # byte alignment of every tensor inside a flat buffer (views of any float dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Pack tensors (one device) into one uint8 buffer on that device; returns (buffer, records)."""
    records: list[dict[str, Any]] = []
    offset = 0
    for name, t in named:
        if dtype_name(t.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"tensor '{name}' has dtype {t.dtype}; only {sorted(FLOAT_DTYPES)} travel")
        records.append({"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "offset": offset})
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    device = named[0][1].device if named else torch.device("cpu")
    buf = torch.zeros(offset, dtype=torch.uint8, device=device)
    for rec, (_, t) in zip(records, named):
        n = t.numel() * t.element_size()
        buf[rec["offset"] : rec["offset"] + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, records


def unflatten(buf: torch.Tensor, records: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buf`` (no copy), one per record; raises ValueError on a record outside it."""
    out = []
    for rec in records:
        dtype = FLOAT_DTYPES.get(rec["dtype"])
        if dtype is None:
            raise ValueError(f"tensor '{rec['name']}' has dtype {rec['dtype']}, expected one of {sorted(FLOAT_DTYPES)}")
        shape = [int(s) for s in rec["shape"]]
        n = torch.Size(shape).numel() * dtype.itemsize
        start = int(rec["offset"])
        if start < 0 or start + n > buf.numel():
            raise ValueError(
                f"tensor '{rec['name']}' ({n} bytes at {start}) lies outside the {buf.numel()}-byte buffer"
            )
        out.append((rec["name"], buf[start : start + n].view(dtype).view(shape)))
    return out


# ------------------------------------------------------------------ generations as one binary frame

GENERATION_MAGIC = b"MRLGEN1\n"
GENERATION_TYPE = "application/x-megarl-generation"
"""Content-Type of a ``/generate`` reply."""
FINISH_REASONS = (None, "stop", "length", "abort")
"""vLLM finish reasons by code (the index)."""
_ARRAYS = (
    ("samples", "I"),
    ("lengths", "I"),
    ("logprob_lengths", "I"),
    ("finish", "B"),
    ("ids", "i"),
    ("logprobs", "d"),
)
_ROUTE_CODES = {"B": torch.uint8, "h": torch.int16}
"""A frame's route array type (``route_code``): uint8 when every expert id < 256, else int16."""


def encode_generation(
    version: int, outputs: list[list[dict[str, Any]]], timings: dict[str, float] | None = None
) -> bytes:
    """Outputs per prompt (each sample ``{"token_ids", "logprobs", "finish_reason"}``, and
    ``"routes"`` — an int array (rows, layers, top-k) — in every sample or none) → one frame;
    ``timings``: the engine's own seconds (e.g. ``engine_s``), carried in the header."""
    cols: dict[str, array[Any]] = {name: array(code) for name, code in _ARRAYS}
    samples = [s for group in outputs for s in group]
    for group in outputs:
        cols["samples"].append(len(group))
        for s in group:
            reason = s["finish_reason"]
            if reason not in FINISH_REASONS:
                raise ValueError(f"finish_reason {reason!r} has no wire code (known: {FINISH_REASONS})")
            cols["lengths"].append(len(s["token_ids"]))
            cols["logprob_lengths"].append(len(s["logprobs"]))
            cols["finish"].append(FINISH_REASONS.index(reason))
            cols["ids"].extend(s["token_ids"])
            cols["logprobs"].extend(s["logprobs"])
    header: dict[str, Any] = {"version": int(version), "byteorder": sys.byteorder, "timings": timings or {}}
    routed = [s.get("routes") is not None for s in samples]
    if any(routed):
        if not all(routed):
            raise ValueError("routes in some samples of a generation but not in all")
        header["route_shape"] = list(_route_shape([s["routes"] for s in samples]))
        cols |= _route_columns([s["routes"] for s in samples])
        header["route_code"] = cols["routes"].typecode
    header |= {n: len(a) for n, a in cols.items()}
    head = json.dumps(header).encode()
    return b"".join([GENERATION_MAGIC, struct.pack("<I", len(head)), head, *(a.tobytes() for a in cols.values())])


def _route_shape(routes: list[Any]) -> tuple[int, int]:
    """The (layers, top-k) every sample's routes share; ValueError otherwise."""
    shapes = {tuple(int(x) for x in r.shape[1:]) for r in routes}
    if len(shapes) != 1 or any(len(r.shape) != 3 for r in routes):
        raise ValueError(f"routes must be (rows, layers, top-k) alike in every sample, got {sorted(shapes)}")
    (shape,) = shapes
    return shape[0], shape[1]


def _route_columns(routes: list[Any]) -> dict[str, array[Any]]:
    ts = [torch.as_tensor(r).to(torch.int32) for r in routes]
    lo, hi = (
        min((int(t.min()) for t in ts if t.numel()), default=0),
        max((int(t.max()) for t in ts if t.numel()), default=0),
    )
    if lo < 0 or hi >= 2**15:
        raise ValueError(f"expert ids must lie in [0, 2**15), got [{lo}, {hi}]")
    code = "B" if hi < 256 else "h"
    rows, flat = array("I", [int(t.shape[0]) for t in ts]), array(code)
    for t in ts:
        flat.frombytes(t.to(_ROUTE_CODES[code]).contiguous().numpy().tobytes())
    return {"route_rows": rows, "routes": flat}


def decode_generation(frame: bytes) -> tuple[int, list[list[dict[str, Any]]], dict[str, float]]:
    """Inverse of :func:`encode_generation`: (version, outputs per prompt, timings); ValueError
    naming what does not add up in a malformed frame."""
    m = len(GENERATION_MAGIC)
    if frame[:m] != GENERATION_MAGIC or len(frame) < m + 4:
        raise ValueError(f"not a generation frame: starts with {frame[:16]!r}")
    (hlen,) = struct.unpack_from("<I", frame, m)
    try:
        header = json.loads(frame[m + 4 : m + 4 + hlen])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"generation frame header is not JSON: {e}") from e
    pos = m + 4 + hlen
    cols: dict[str, Any] = {}  # lists of values; routes: the array itself
    route_shape, route_code = header.get("route_shape"), str(header.get("route_code", "h"))
    if route_code not in _ROUTE_CODES:
        raise ValueError(f"generation frame: route code {route_code!r} is not one of {sorted(_ROUTE_CODES)}")
    routed = (("route_rows", "I"), ("routes", route_code)) if route_shape is not None else ()
    for name, code in _ARRAYS + routed:
        a = array(code)
        n = int(header.get(name, -1))
        end = pos + n * a.itemsize
        if n < 0 or end > len(frame):
            raise ValueError(f"generation frame: array '{name}' of {n} items runs past the {len(frame)}-byte frame")
        a.frombytes(frame[pos:end])
        if header.get("byteorder") != sys.byteorder:
            a.byteswap()
        cols[name], pos = (a if name == "routes" else a.tolist()), end
    if pos != len(frame):
        raise ValueError(f"generation frame: {len(frame) - pos} bytes after the last array")
    if sum(cols["samples"]) != len(cols["lengths"]) or sum(cols["lengths"]) != len(cols["ids"]):
        raise ValueError("generation frame: sample counts, lengths and token ids do not add up")
    if sum(cols["logprob_lengths"]) != len(cols["logprobs"]) or max(cols["finish"], default=0) >= len(FINISH_REASONS):
        raise ValueError("generation frame: log-prob lengths or finish codes do not add up")
    routes = _split_routes(cols, route_shape) if route_shape is not None else None
    outputs: list[list[dict[str, Any]]] = []
    k = i = j = 0
    for count in cols["samples"]:
        group: list[dict[str, Any]] = []
        for _ in range(count):
            n, nl = cols["lengths"][k], cols["logprob_lengths"][k]
            group.append({
                "token_ids": cols["ids"][i : i + n],
                "logprobs": cols["logprobs"][j : j + nl],
                "finish_reason": FINISH_REASONS[cols["finish"][k]],
            })  # fmt: skip
            if routes is not None:
                group[-1]["routes"] = routes[k]
            k, i, j = k + 1, i + n, j + nl
        outputs.append(group)
    timings = {str(k): float(v) for k, v in dict(header.get("timings") or {}).items()}
    return int(header["version"]), outputs, timings


def _split_routes(cols: dict[str, Any], shape: Any) -> list[torch.Tensor]:
    """Each sample's routes (rows, layers, top-k) int16, from the frame's two route arrays."""
    layers, topk = (int(x) for x in shape)
    rows = cols["route_rows"]
    if len(rows) != len(cols["lengths"]) or sum(rows) * layers * topk != len(cols["routes"]):
        raise ValueError("generation frame: route rows and routes do not add up")
    raw, dtype = bytearray(cols["routes"].tobytes()), _ROUTE_CODES[cols["routes"].typecode]
    flat = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).to(torch.int16)
    return [r.view(-1, layers, topk) for r in flat.split([n * layers * topk for n in rows])]


# ------------------------------------------------------------------ CUDA IPC handles as JSON

_TENSOR_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_ARG_NAMES = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
"""Positional arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``."""


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s, validate=True)


def encode_rebuild_args(args: tuple[Any, ...]) -> dict[str, Any]:
    """``rebuild_cuda_tensor`` arguments → a JSON-safe dict (raises ValueError on anything else)."""
    if len(args) != len(_ARG_NAMES):
        raise ValueError(f"expected {len(_ARG_NAMES)} rebuild_cuda_tensor arguments, got {len(args)}")
    a = dict(zip(_ARG_NAMES, args))
    tcls = {v: k for k, v in _TENSOR_CLASSES.items()}.get(a["tensor_cls"])
    scls = {v: k for k, v in _STORAGE_CLASSES.items()}.get(a["storage_cls"])
    if tcls is None or scls is None:
        raise ValueError(f"cannot encode tensor class {a['tensor_cls']} / storage class {a['storage_cls']}")
    return {
        "tensor_cls": tcls,
        "tensor_size": [int(s) for s in a["tensor_size"]],
        "tensor_stride": [int(s) for s in a["tensor_stride"]],
        "tensor_offset": int(a["tensor_offset"]),
        "storage_cls": scls,
        "dtype": dtype_name(a["dtype"]),
        "storage_device": int(a["storage_device"]),
        "storage_handle": _b64(a["storage_handle"]),
        "storage_size_bytes": int(a["storage_size_bytes"]),
        "storage_offset_bytes": int(a["storage_offset_bytes"]),
        "requires_grad": bool(a["requires_grad"]),
        "ref_counter_handle": _b64(a["ref_counter_handle"]),
        "ref_counter_offset": int(a["ref_counter_offset"]),
        "event_handle": _b64(a["event_handle"]),
        "event_sync_required": bool(a["event_sync_required"]),
    }


def decode_rebuild_args(d: dict[str, Any], device: int | None = None) -> tuple[Any, ...]:
    """Inverse of :func:`encode_rebuild_args`; ``device`` replaces the sender's device index."""
    missing = [k for k in _ARG_NAMES if k not in d]
    if missing:
        raise ValueError(f"IPC handle lacks {missing}")
    if d["tensor_cls"] not in _TENSOR_CLASSES or d["storage_cls"] not in _STORAGE_CLASSES:
        raise ValueError(f"IPC handle names unknown classes {d['tensor_cls']!r} / {d['storage_cls']!r}")
    dtype = getattr(torch, str(d["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"IPC handle names unknown dtype {d['dtype']!r}")
    return (
        _TENSOR_CLASSES[d["tensor_cls"]],
        torch.Size(int(s) for s in d["tensor_size"]),
        tuple(int(s) for s in d["tensor_stride"]),
        int(d["tensor_offset"]),
        _STORAGE_CLASSES[d["storage_cls"]],
        dtype,
        int(d["storage_device"]) if device is None else int(device),
        _unb64(d["storage_handle"]),
        int(d["storage_size_bytes"]),
        int(d["storage_offset_bytes"]),
        bool(d["requires_grad"]),
        _unb64(d["ref_counter_handle"]),
        int(d["ref_counter_offset"]),
        _unb64(d["event_handle"]),
        bool(d["event_sync_required"]),
    )


def share_cuda(buf: torch.Tensor) -> dict[str, Any]:
    """A CUDA tensor → JSON handle another process on the same node can rebuild (CUDA only)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(buf)
    if fn is not rebuild_cuda_tensor:
        raise ValueError(f"tensor on {buf.device} cannot be shared by CUDA IPC")
    handle = encode_rebuild_args(args)
    handle["device_uuid"] = str(torch.cuda.get_device_properties(buf.device).uuid)
    return handle


def open_cuda(handle: dict[str, Any]) -> torch.Tensor:
    """Rebuild a tensor shared by :func:`share_cuda` on the local index of the same GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = handle.get("device_uuid")
    local = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    if not local:
        raise ValueError(f"CUDA IPC: GPU {uuid} of the trainer is not visible to this engine worker")
    return rebuild_cuda_tensor(*decode_rebuild_args(handle, device=local[0]))  # type: ignore[no-any-return]
